"""Tiny random Hugging Face checkpoints, built offline with transformers for tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
    "qwen3_tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(head_dim=16, tie_word_embeddings=True)),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict()),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=6)),
}


def make_model(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so parity tests see them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_model(model, path: Path, dtype=None, **kw) -> Path:
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, **kw)
    return path

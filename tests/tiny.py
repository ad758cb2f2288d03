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

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])

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
    # Proportional partial RoPE (Gemma 4's full layers): a quarter of the pairs rotate.
    "qwen3_prope": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        head_dim=16, rope_parameters=dict(rope_type="proportional", rope_theta=10000.0, partial_rotary_factor=0.25))),
    # Mixture of experts: a dense layer (mlp_only_layers) among the sparse ones, and k of 6
    # experts renormalised.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    # Sliding (window 8, shorter than the test prompts) and full layers alternating, sinks,
    # YaRN, biases everywhere, top-2 of 4 experts with the clamped SwiGLU.
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
        max_position_embeddings=1024, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=128, truncate=False))),
    # Hybrid (Qwen3.5): gated delta-net layers around one gated full-attention layer, partial
    # RoPE on a quarter of each head; two value heads per q/k head.
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, dict(LINEAR)),
    # ... and its MoE variant: every layer sparse, top-2 of 6 experts plus a gated shared expert.
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, dict(
        LINEAR, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    # Qwen3-Next: the same layers as Qwen3.5-MoE in a fused checkpoint layout (in_proj_qkvz, in_proj_ba),
    # with a dense layer (mlp_only_layers) among the sparse ones.
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, dict(
        LINEAR, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1])),
    # Gemma 4: sliding (window 8) and global layers of their own head shape (32 x 1 KV head, k = v,
    # proportional RoPE), the last two layers sharing K/V, per-layer inputs, experts beside the
    # MLP, soft-capped logits.
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM, dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8, num_hidden_layers=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, attention_k_eq_v=True,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=160,
        final_logit_softcapping=30.0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16)),
    # DeepSeek-V3 (Kimi-K2): MLA (q through a rank-24 latent, a 32 + 8 key latent, interleaved RoPE),
    # a dense first layer, then 2 of 8 experts in the 2 best of 4 groups, sigmoid scores with a
    # correction bias, times 2.5, plus a shared expert. transformers' MLA expands the latent per head:
    # its K/V heads must equal the attention heads.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, moe_intermediate_size=32,
        kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1)),
    # GLM-5: DeepSeek-V3's layers plus sparse attention, each query seeing the top 8 positions its
    # indexer (16 heads of 16: a score of exactly 0, where ties would make the pick arbitrary, is rare)
    # scores (fewer than the test prompts hold).
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM, dict(
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, moe_intermediate_size=32, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=16)),
    # MiniMax-M2: q/k norms over the whole projection (all heads at once), RoPE on the first 8 of each
    # head's 16 dimensions (`rotary_dim`), every layer 2 of 6 experts by sigmoid scores plus a correction
    # bias, renormalised. Its bos/eos defaults (ids 200034/200020) are out of a tiny vocabulary: none.
    "minimax_m2": (transformers.MiniMaxM2Config, transformers.MiniMaxM2ForCausalLM, dict(
        head_dim=16, rotary_dim=8, num_local_experts=6, num_experts_per_tok=2, intermediate_size=32,
        bos_token_id=None, eos_token_id=None)),
}
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")


def make_model(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so parity tests see them.
    with torch.no_grad():
        learned = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar"))]
        for name, p in learned:
            if "norm" in name or name.endswith(("bias", "sinks", "scale", "layer_scalar")):
                p.add_(0.1 * torch.randn_like(p))
            elif ".experts." in name and p.dim() == 3:  # experts start at std 0.02: make them count
                p.mul_(10.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias (a buffer, zero at init)
                b.add_(0.1 * torch.randn_like(b))
    return model


def save_model(model, path: Path, dtype=None, **kw) -> Path:
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, **kw)
    return path


def write_random_drafter(target: Path, out: Path, *, block_size: int, taps: tuple[int, ...], layers: int = 1,
                         sliding_windows: tuple | None = None, seed: int = 5) -> Path:
    """A random drafter in the z-lab format for the HF target at `target` (dense Qwen3 layers of
    the target's widths; `sliding_windows` per layer), mask token the last id."""
    import json

    import jax

    from dflash_jax.checkpoint import DRAFTER_TABLE, save_hf_params
    from dflash_jax.families import model_config_from_json
    from dflash_jax.drafter import DrafterConfig, dense_drafter_model, init_drafter_params

    t = model_config_from_json(target / "config.json")
    model = dense_drafter_model(t, layers, intermediate_size=96)
    if sliding_windows is not None:
        model = model.replace(sliding_windows=tuple(sliding_windows))
    config = DrafterConfig(model=model, block_size=block_size, mask_token_id=t.vocab_size - 1,
                           target_layer_ids=tuple(taps), num_target_layers=t.num_hidden_layers)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_hf_params(init_drafter_params(config, jax.random.PRNGKey(seed)), out / "model.safetensors",
                   table=DRAFTER_TABLE)
    return out


def train_cli_on_regenerated(target: Path, tmp_path: Path, steps: int, save_every: int) -> list[float]:
    """`python -m train` (configs/train/tiny.yaml) with `target`: it regenerates responses to 16
    random prompts with the target, then trains a new drafter for `steps` steps. Checks the
    regenerated data and returns the logged losses."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    repo = Path(__file__).resolve().parent.parent
    rs = np.random.RandomState(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": rs.randint(0, 159, int(rs.randint(4, 12))).tolist()}) + "\n"
                               for _ in range(16)))
    cmd = [sys.executable, "-m", "train", "--config", str(repo / "configs" / "train" / "tiny.yaml"), "--quiet",
           f"target={target}", f"train.output_dir={tmp_path / 'run'}", f"data.generate_from={prompts}",
           f"data.conversations={tmp_path / 'conv.jsonl'}", "data.generate_max_new_tokens=24", "data.seq_len=48",
           "data.eval_holdout=0", f"train.steps={steps}", f"train.save_every={save_every}", "train.log_every=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "conv.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(len(r["response_ids"]) > 0 for r in rows)
    metrics = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in metrics if "loss" in m]


def assert_plain_greedy_equals_generate(model, path: Path, lengths=(3, 19, 11), max_new_tokens: int = 12):
    """Our plain greedy decoding (2 slots for len(lengths) random prompts, 16-position pages)
    of the checkpoint at `path` equals transformers' `generate` of its PyTorch `model`."""
    import numpy as np

    from dflash_jax import load_target
    from dflash_jax.engine import BatchEngine

    config, params = load_target(path)
    rs = np.random.RandomState(11)
    prompts = [rs.randint(0, config.vocab_size, n).tolist() for n in lengths]
    gen = BatchEngine(config, params, batch_size=2, max_new_tokens=max_new_tokens, max_prompt_len=max(lengths) + 5,
                    page_size=16)
    ours = sorted(gen.generate(prompts), key=lambda r: r.index)
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # every token real: generate would take pad_token_id 0 for padding
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.output_ids == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"


def prefill_in_pieces(params, config, ids, lengths, width: int, cache_len: int, pad: int = 7):
    """Run rows of `ids` as right-padded prefill pieces `width` wide, row r's piece j holding
    lengths[r][j] real tokens (the rest `pad`, which must change nothing). Returns each row's
    logits at its real positions, concatenated over the pieces."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax import forward, init_cache

    lengths = np.asarray(lengths)
    rows = len(lengths)
    cache = init_cache(config, rows, cache_len)
    got, start = [[] for _ in range(rows)], np.zeros(rows, int)
    for piece in range(lengths.shape[1]):
        tokens = np.full((rows, width), pad, np.int32)
        for r in range(rows):
            tokens[r, :lengths[r, piece]] = ids[r, start[r]:start[r] + lengths[r, piece]]
        out = forward(params, config, jnp.asarray(tokens), cache, num_tokens=jnp.asarray(lengths[:, piece]))
        cache = out.cache
        for r in range(rows):
            got[r].append(np.asarray(out.logits[r, :lengths[r, piece]]))
        start += lengths[:, piece]
    return [np.concatenate(g) for g in got]

"""Model families: what each Hugging Face `model_type` needs from the one decoder.

The decoder (`dflash_jax.model`) is built from shared layers configured by switches. A family
is a small module here that registers a `Family`: the switches its checkpoints use, a parser
for the config fields only it has (experts, router, activation), and its HF <-> Flax name
table. Adding a family that reuses existing layers is a module here, not a new decoder.

| model_type | module | what differs from a Llama block |
|---|---|---|
| llama, qwen2, qwen3, mistral | `dense` | q/k norm, biases, sliding windows |
| qwen3_moe | `qwen3_moe` | sparse MoE block (softmax then top-k) on some layers |
| gpt_oss | `gpt_oss` | attention sinks, MoE with biases and clamped SwiGLU, MXFP4 experts |
| gemma4_text, gemma4 | `gemma4` | sliding and global layers of two head shapes and RoPEs, k = v, shared K/V, sandwich norms, scaled embeddings, per-layer inputs, MoE beside the MLP, soft-capped logits |
| qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe | `qwen3_5` | gated delta-net linear-attention layers, gated attention, partial RoPE, (1 + w) norms, MoE with a shared expert |
| qwen3_next | `qwen3_next` | Qwen3.5-MoE's layers; fused delta-net input projections cut at load (`split`), MoE placed as Qwen3-MoE's |
"""

from dflash_jax.families.registry import FAMILIES, Family, family, register  # noqa: F401
from dflash_jax.families.hf import model_config, model_config_from_json, read_config_json  # noqa: F401
from dflash_jax.families import dense, gemma4, gpt_oss, qwen3_5, qwen3_moe, qwen3_next  # noqa: E402,F401  (they register)

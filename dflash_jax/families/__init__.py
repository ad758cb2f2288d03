"""Model families: what each Hugging Face `model_type` needs from the one decoder.

The decoder (`dflash_jax.model`) is built from shared layers configured by switches. A family
is a small module here that registers a `Family`: the switches its checkpoints use, a parser
for the config fields only it has (experts, router, activation), and its HF <-> Flax name
table. Adding a family that reuses existing layers is a module here, not a new decoder.

Beside the families: `hf` reads a Hugging Face `config.json` into a `ModelConfig` (the fields every
family shares, then the family's own), `registry` holds the `Family` of each `model_type`, and
`table` the rows of the HF <-> Flax name table every family shares.

| model_type | module | what differs from a Llama block |
|---|---|---|
| llama, qwen2, qwen3, mistral | `dense` | q/k norm, biases, sliding windows |
| qwen3_moe | `qwen3_moe` | sparse MoE block (softmax then top-k) on some layers |
| gpt_oss | `gpt_oss` | attention sinks, MoE with biases and clamped SwiGLU, MXFP4 experts |
| gemma4_text, gemma4 | `gemma4` | sliding and global layers of two head shapes and RoPEs, k = v, shared K/V, sandwich norms, scaled embeddings, per-layer inputs, MoE beside the MLP, soft-capped logits |
| qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe | `qwen3_5` | gated delta-net linear-attention layers, gated attention, partial RoPE, (1 + w) norms, MoE with a shared expert |
| deepseek_v3 (Kimi-K2) | `deepseek_v3` | multi-head latent attention over a latent cache, sigmoid group-limited routing with a correction bias, shared experts, first layers dense |
| kimi_k25 (Kimi-K2.5, K2.6), kimi_k2 | `kimi_k25` | DeepSeek-V3's layers; K2.5's decoder in `text_config`, its tensors under `language_model.`, the vision tower skipped; compressed-tensors INT4 experts |
| glm_moe_dsa (GLM-5) | `glm_moe_dsa` | DeepSeek-V3's layers plus sparse attention: an indexer picks each query's top-k positions, its keys cached beside the latent |
| minimax_m2 (MiniMax-M2, M2.1, M2.5) | `minimax_m2` | q/k norms over the whole projection (all heads at once), partial RoPE (`rotary_dim`), MoE on every layer with sigmoid routing and a correction bias |
| qwen3_next | `qwen3_next` | Qwen3.5-MoE's layers; fused delta-net input projections cut at load (`split`), MoE placed as Qwen3-MoE's |
"""

from dflash_jax.families.registry import FAMILIES, Family, family, register  # noqa: F401
from dflash_jax.families.hf import model_config, model_config_from_json, read_config_json  # noqa: F401
from dflash_jax.families import (  # noqa: E402,F401  (they register)
    deepseek_v3, dense, gemma4, glm_moe_dsa, gpt_oss, kimi_k25, minimax_m2, qwen3_5, qwen3_moe, qwen3_next)

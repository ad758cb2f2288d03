"""The target decoder, as a package of shared layers configured per family.

- `layers`: RMSNorm, RoPE (default, linear, Llama 3, YaRN), attention over the paged cache
  (q/k norm, biases, sliding windows, sinks), the dense gated MLP.
- `rope`: RoPE frequencies with Hugging Face's scaling rules, for a `RopeConfig`.
- `moe`: the sparse mixture-of-experts block (router, dispatch by expert, grouped matmuls).
- `delta_rule`: the gated delta rule and Qwen3.5's gated delta-net layer (linear attention
  with a recurrent state), chunked and per token, and the settling of a verify pass's state.
- `mla`: multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-5) over a latent cache, and
  sparse attention's indexer.
- `weights`: every weight matmul (`project`, `Projection`) through a registry of weight
  formats (how a weight is stored and multiplied), a format per weight by its path (`FormatRules`).
- `formats`: the quantized weight formats, one module each, and the rules a checkpoint's
  `quantization_config` gives.
- `decoder`: the decoder layer and model, and `forward`, the one jit-compiled
  entry point for prefill, decoding and verification.

Which switches a checkpoint turns on is its family's business (`dflash_jax.families`).
"""

from dflash_jax.model.decoder import (  # noqa: F401
    CausalLM, Decoder, DecoderLayer, ForwardOutput, abstract_params, forward, init_params, settle,
)
from dflash_jax.model.layers import MLP, Attention, RMSNorm, apply_rope, rope_angles, unfused  # noqa: F401
from dflash_jax.model.moe import MoE  # noqa: F401
import dflash_jax.model.formats  # noqa: F401,E402  (registers the quantized weight formats)

"""Qwen3-Next (`Qwen3NextForCausalLM`: Qwen3-Next-80B-A3B, Qwen3-Coder-Next): Qwen3.5's hybrid
decoder in an older checkpoint layout. The layers are Qwen3.5-MoE's (`qwen3_5`): gated delta-net
linear-attention layers and gated full-attention layers (`layer_types`, else every
`full_attention_interval`-th layer is attention), q/k norms, RoPE on the first
`partial_rotary_factor` of each head (0.25 when the config does not say), (1 + w) RMSNorms, and
a sparse block (softmax, top k) plus a shared expert gated by sigmoid(shared_expert_gate(x)).

What differs, all read at load into Qwen3.5's parameters (no layer of its own):

- The delta-net's input projections are fused. `in_proj_qkvz` holds, per q/k head g, that head's
  query and key (`linear_key_head_dim` each), then the values and output gates of its
  v_heads / k_heads value heads; `in_proj_ba` per q/k head its value heads' b, then their a.
  `split` cuts them into Qwen3.5's `in_proj_qkv` (every head's q, every k, every v: the
  convolution's channel order, which both models share), `in_proj_z`, `in_proj_b`, `in_proj_a`.
- The sparse block sits where Qwen3-MoE puts it: not on `mlp_only_layers`, and only where
  `(i + 1) % decoder_sparse_step == 0`; the other layers keep the dense MLP of width
  `intermediate_size` (`num_experts` 0: every layer dense). Top-k weights renormalised only when
  `norm_topk_prob` (transformers' default: true).
- Multi-token-prediction weights (`mtp.*`) are not read.
"""

import numpy as np

from dflash_jax.errors import ConfigError
from dflash_jax.families import qwen3_5
from dflash_jax.families.hf import moe_config, rope_config
from dflash_jax.families.qwen3_moe import moe_rows, sparse_layers
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, attention_rows, dense_mlp_rows

FUSED = (("in_proj_qkvz", ("qkv", "z"), ("in_proj_qkv", "in_proj_z")),
         ("in_proj_ba", ("b", "a"), ("in_proj_b", "in_proj_a")))


def linear_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    """Qwen3.5's delta-net rows, its four input projections cut from Qwen3-Next's two fused ones."""
    rows = [row for row in qwen3_5.linear_rows(hf_prefix, flax_prefix)
            if not any(f"linear_attn.{name}." in row.hf for _, _, names in FUSED for name in names)]
    for fused, pieces, names in FUSED:
        rows += [Row(f"{hf_prefix}linear_attn.{fused}.weight", f"{flax_prefix}linear_attn/{name}/kernel", True,
                     piece=piece) for piece, name in zip(pieces, names)]
    return rows


def table() -> tuple[Row, ...]:
    prefix, flax_prefix = "model.layers.{i}.", "model/layers_{i}/"
    return (
        Row("model.embed_tokens.weight", "model/embed_tokens/embedding"),
        *attention_rows(prefix, flax_prefix), *linear_rows(prefix, flax_prefix),
        *dense_mlp_rows(prefix, flax_prefix), *moe_rows(prefix, flax_prefix),
        *qwen3_5.shared_expert_rows(prefix, flax_prefix),
        Row("model.norm.weight", "model/norm/weight"),
        Row("lm_head.weight", "lm_head/kernel", True),
    )


def split(config, name: str, kernel: np.ndarray) -> dict[str, np.ndarray]:
    """Qwen3.5's projections of a fused kernel [hidden, out] (Flax layout), whose output axis is
    grouped by q/k head (see the module's docstring)."""
    la = config.linear_attention
    per = la.v_heads // la.k_heads  # value heads per q/k head
    grouped = kernel.reshape(kernel.shape[0], la.k_heads, -1)
    flat = lambda x: x.reshape(kernel.shape[0], -1)
    if name.endswith("in_proj_qkvz.weight"):
        q, k, v, z = np.split(grouped, np.cumsum([la.k_dim, la.k_dim, per * la.v_dim]), axis=-1)
        return dict(qkv=np.concatenate([flat(q), flat(k), flat(v)], axis=-1), z=flat(z))
    return dict(b=flat(grouped[..., :per]), a=flat(grouped[..., per:]))


def parse(cfg: dict, layers: int) -> dict:
    out = qwen3_5.parse(cfg, layers)  # layer_types, the delta-net's heads, silu
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in cfg:  # transformers' default
        out["rope"] = rope_config({**cfg, "partial_rotary_factor": 0.25})
    if cfg.get("num_experts", 1) == 0:  # transformers: no sparse block anywhere
        return out
    shared = cfg.get("shared_expert_intermediate_size")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared <= 0:
        raise ConfigError(f"config.json (qwen3_next) field 'shared_expert_intermediate_size' must be a positive "
                          f"integer, got {shared!r}")
    moe = moe_config(cfg, "qwen3_next", experts=("num_experts",), router="softmax_topk",
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), shared_expert_size=shared)
    return dict(out, moe=moe, sparse_layers=sparse_layers(cfg, layers, "qwen3_next"))


register(Family("qwen3_next", qwen3_5.SWITCHES, table(), parse=parse, split=split, ignore=(r"mtp\..*",)))

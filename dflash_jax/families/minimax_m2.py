"""MiniMax-M2 / M2.1 / M2.5 (`MiniMaxM2ForCausalLM`): grouped-query attention with whole-projection
q/k norms and partial RoPE, and a sparse MoE block on every layer.

Attention: `q_norm` and `k_norm` are one RMSNorm each over the whole q / k projection (heads x
head_dim, a weight per element), applied before the split into heads (`qk_norm_type: per_layer`;
`ModelConfig.qk_norm_whole`), not per head as Qwen3's. RoPE rotates the first `rotary_dim` dimensions
of each head, half-split inside them (transformers turns `rotary_dim` into `partial_rotary_factor` =
rotary_dim / head_dim, which a `partial_rotary_factor` given in the config overrides); the rest pass
through. No biases, no sliding window; `head_dim` defaults to 128 and `rope_theta` to 5e6, as
transformers'.

MoE (Mixtral's block, `block_sparse_moe` in checkpoints): sigmoid scores; the top
`num_experts_per_tok` of scores + `e_score_correction_bias` (float32) are chosen, weighted by their
plain scores renormalised: our "sigmoid_grouped" router with one group and no scaling. No shared
expert. Experts `w1` (gate), `w3` (up), `w2` (down), one tensor per expert, `intermediate_size` wide.
Multi-token-prediction layers stored as `model.layers.{num_hidden_layers + i}.*` are not read.

Refused (one line): `use_qk_norm` false, a `qk_norm_type` other than per_layer, a `scoring_func`
other than sigmoid, `use_routing_bias` false, `shared_intermediate_size` > 0, an `attn_type_list`
entry other than 1 (MiniMax-Text-01's lightning attention), `hidden_act` other than silu.
"""

from __future__ import annotations

from dflash_jax.errors import ConfigError
from dflash_jax.families.hf import moe_config, rope_config
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, decoder_rows

MODEL_TYPE = "minimax_m2"
HEAD_DIM = 128  # transformers' MiniMaxM2Config defaults
ROPE_THETA = 5e6


def moe_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    moe, flax = f"{hf_prefix}block_sparse_moe.", f"{flax_prefix}mlp/"
    rows = [Row(f"{moe}gate.weight", f"{flax}router/kernel", True),
            Row(f"{moe}e_score_correction_bias", f"{flax}e_score_correction_bias")]
    return rows + [Row(f"{moe}experts.{{e}}.{w}.weight", f"{flax}experts/{p}", True)
                   for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]


def refuse_unsupported(cfg: dict) -> None:
    def bad(field, value, supported):
        raise ConfigError(f"config.json ({MODEL_TYPE}) {field} {value!r} is not supported ({supported})")

    if cfg.get("use_qk_norm", True) is not True:
        bad("use_qk_norm", cfg["use_qk_norm"], "transformers' MiniMaxM2 always norms q and k")
    if cfg.get("qk_norm_type", "per_layer") != "per_layer":
        bad("qk_norm_type", cfg["qk_norm_type"], "per_layer only")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        bad("scoring_func", cfg["scoring_func"], "sigmoid only")
    if cfg.get("use_routing_bias", True) is not True:
        bad("use_routing_bias", cfg["use_routing_bias"], "the router's e_score_correction_bias is always read")
    if cfg.get("shared_intermediate_size") or 0:
        bad("shared_intermediate_size", cfg["shared_intermediate_size"], "no shared expert")
    kinds = sorted({t for t in cfg.get("attn_type_list") or () if t != 1}, key=str)
    if kinds:
        bad("attn_type_list entry", kinds[0], "1 only: full attention on every layer")
    if cfg.get("hidden_act", "silu") != "silu":
        bad("hidden_act", cfg["hidden_act"], "silu only")


def parse(cfg: dict, layers: int) -> dict:
    refuse_unsupported(cfg)
    head_dim = cfg.get("head_dim") or HEAD_DIM
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"config.json ({MODEL_TYPE}) field 'head_dim' must be a positive integer, got {head_dim!r}")
    rope_cfg = {"rope_theta": ROPE_THETA, **cfg}
    rotary_dim = cfg.get("rotary_dim")
    if rotary_dim is not None:
        if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or not 0 < rotary_dim <= head_dim \
                or rotary_dim % 2:
            raise ConfigError(f"config.json ({MODEL_TYPE}) rotary_dim must be an even integer in 2..head_dim "
                              f"{head_dim}, got {rotary_dim!r}")
        rope_cfg = {"partial_rotary_factor": rotary_dim / head_dim, **rope_cfg}
    moe = moe_config(cfg, MODEL_TYPE, experts=("num_local_experts", "num_experts"), router="sigmoid_grouped",
                     norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    return dict(head_dim=head_dim, rope=rope_config(rope_cfg), moe=moe, sparse_layers=(True,) * layers,
                sliding_windows=(None,) * layers)


register(Family(MODEL_TYPE, dict(qk_norm=True, qk_norm_whole=True), decoder_rows(moe_rows), parse=parse,
                extra_layers=True))

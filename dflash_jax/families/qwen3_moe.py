"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention, and on most layers a sparse MoE block.

The router is a bias-free linear layer (`mlp.gate`, our `mlp/router`); softmax over every expert, then the top
`num_experts_per_tok`, renormalised when `norm_topk_prob`. Layer i is sparse unless it is in
`mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`; those layers keep the dense MLP of
width `intermediate_size`. Checkpoints store each expert's projections separately
(`mlp.experts.{e}.gate_proj.weight`); they fill one stacked `[experts, ...]` parameter each.
"""

from dflash_jax.errors import ConfigError
from dflash_jax.families.hf import moe_config
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, decoder_rows


def moe_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    rows = [Row(f"{hf_prefix}mlp.gate.weight", f"{flax_prefix}mlp/router/kernel", True)]
    for p in ("gate_proj", "up_proj", "down_proj"):
        rows.append(Row(f"{hf_prefix}mlp.experts.{{e}}.{p}.weight", f"{flax_prefix}mlp/experts/{p}", True))
    return rows


def sparse_layers(cfg: dict, layers: int, model_type: str) -> tuple[bool, ...]:
    """Per layer whether it has the sparse block: not in `mlp_only_layers`, and `(i + 1) %
    decoder_sparse_step == 0` (Qwen3-MoE, Qwen3-Next)."""
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise ConfigError(f"config.json ({model_type}) field 'decoder_sparse_step' must be a positive integer, "
                          f"got {step!r}")
    dense = cfg.get("mlp_only_layers") or []
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise ConfigError(f"config.json ({model_type}) mlp_only_layers {bad} are not layers of a {layers}-layer model")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def parse(cfg: dict, layers: int) -> dict:
    moe = moe_config(cfg, "qwen3_moe", experts=("num_experts", "num_local_experts"), router="softmax_topk",
                          norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json (qwen3_moe) hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    return dict(moe=moe, sparse_layers=sparse_layers(cfg, layers, "qwen3_moe"))


register(Family("qwen3_moe", dict(qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias"),
                decoder_rows(moe_rows), parse=parse))

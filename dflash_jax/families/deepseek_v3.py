"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; Kimi-K2 / K2.5's text model): multi-head latent attention
and DeepSeek-MoE.

Attention is MLA (`dflash_jax.model.mla`): queries through `q_lora_rank` (q_a_proj, q_a_layernorm,
q_b_proj) or one q_proj when it is null; keys and values through one latent per position
(`kv_a_proj_with_mqa` -> `kv_lora_rank` + `qk_rope_head_dim`, `kv_a_layernorm`, `kv_b_proj`), the
cache holding only the latent. RoPE covers the `qk_rope_head_dim` dimensions, in interleaved pairs
when `rope_interleave` (the default); the softmax scale is qk_head_dim ** -0.5, times YaRN's
mscale(factor, `mscale_all_dim`) squared as transformers' `yarn_apply_mscale`.

The first `first_k_dense_replace` layers have a dense MLP (`intermediate_size`); the others a MoE
block: sigmoid scores with `e_score_correction_bias` choosing the experts among the `topk_group` best
of `n_group` groups, weights renormalised (`norm_topk_prob`) times `routed_scaling_factor`, plus
`n_shared_experts` shared experts as one ungated MLP of n x `moe_intermediate_size`. Checkpoints
store each expert's projections separately; the multi-token-prediction layer
(`num_nextn_predict_layers`: `model.layers.{num_hidden_layers}.*`) is not read.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.config import MlaConfig
from dflash_jax.errors import ConfigError
from dflash_jax.families.hf import moe_config, yarn_mscale
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, decoder_rows

SWITCHES = dict(qkv_bias="attention_bias", o_bias="attention_bias")


def mla_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    attn, flax = f"{hf_prefix}self_attn.", f"{flax_prefix}self_attn/"
    rows = [Row(f"{attn}{p}.weight", f"{flax}{p}/kernel", True)
            for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")]
    rows.append(Row(f"{attn}kv_b_proj.weight", f"{flax}kv_b_proj/kernel"))  # HF layout: [heads x (nope + v), latent]
    rows += [Row(f"{attn}{p}.bias", f"{flax}{p}/bias") for p in ("q_a_proj", "kv_a_proj_with_mqa")]
    return rows + [Row(f"{attn}{n}.weight", f"{flax}{n}/weight") for n in ("q_a_layernorm", "kv_a_layernorm")]


def moe_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    mlp, flax = f"{hf_prefix}mlp.", f"{flax_prefix}mlp/"
    rows = [Row(f"{mlp}gate.weight", f"{flax}router/kernel", True),
            Row(f"{mlp}gate.e_score_correction_bias", f"{flax}e_score_correction_bias")]
    rows += [Row(f"{mlp}experts.{{e}}.{p}.weight", f"{flax}experts/{p}", True)
             for p in ("gate_proj", "up_proj", "down_proj")]
    return rows + [Row(f"{mlp}shared_experts.{p}.weight", f"{flax}shared_expert/{p}/kernel", True)
                   for p in ("gate_proj", "up_proj", "down_proj")]


def positive(cfg: dict, key: str, model_type: str, default=None) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json ({model_type}) field {key!r} must be a positive integer, got {value!r}")
    return value


def mla_config(cfg: dict, model_type: str) -> MlaConfig:
    q_lora = cfg.get("q_lora_rank")
    mla = MlaConfig(kv_lora_rank=positive(cfg, "kv_lora_rank", model_type),
                    qk_nope_head_dim=positive(cfg, "qk_nope_head_dim", model_type),
                    qk_rope_head_dim=positive(cfg, "qk_rope_head_dim", model_type),
                    v_head_dim=positive(cfg, "v_head_dim", model_type),
                    q_lora_rank=None if q_lora is None else positive(cfg, "q_lora_rank", model_type),
                    rope_interleave=bool(cfg.get("rope_interleave", True)))
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(f"config.json ({model_type}) qk_rope_head_dim {mla.qk_rope_head_dim} must be even")
    return mla


def mla_fields(cfg: dict, model_type: str) -> dict:
    """The ModelConfig fields of MLA: the config, RoPE's width and the softmax scale."""
    mla = mla_config(cfg, model_type)
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    scale = mla.qk_head_dim ** -0.5
    if rope.get("rope_type", rope.get("type", "default")) not in (None, "default") and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return dict(mla=mla, head_dim=mla.qk_rope_head_dim, attention_scale=scale)


def routed_moe(cfg: dict, model_type: str, layers: int) -> dict:
    """DeepSeek-MoE: the sigmoid grouped router, shared experts, the first dense layers."""
    groups, top_groups = positive(cfg, "n_group", model_type, 1), positive(cfg, "topk_group", model_type, 1)
    moe = moe_config(cfg, model_type, experts=("n_routed_experts", "num_local_experts"), router="sigmoid_grouped",
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), n_group=groups, topk_group=top_groups,
                     routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), shared_expert_gated=False,
                     router_float32=True)
    if moe.num_experts % groups or moe.num_experts // groups < 2:
        raise ConfigError(f"config.json ({model_type}): {moe.num_experts} experts do not split into n_group {groups} "
                          "groups of at least 2")
    if top_groups > groups:
        raise ConfigError(f"config.json ({model_type}): topk_group {top_groups} > n_group {groups}")
    if top_groups * (moe.num_experts // groups) < moe.top_k:
        raise ConfigError(f"config.json ({model_type}): topk_group {top_groups} groups hold fewer experts than "
                          f"num_experts_per_tok {moe.top_k}")
    shared = cfg.get("n_shared_experts") or 0
    if not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config.json ({model_type}) field 'n_shared_experts' must be a non-negative integer")
    moe = dataclasses.replace(moe, shared_expert_size=shared * moe.intermediate_size)
    dense = cfg.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense <= layers:
        raise ConfigError(f"config.json ({model_type}) first_k_dense_replace must be in 0..{layers}, got {dense!r}")
    return dict(moe=moe, sparse_layers=tuple(i >= dense for i in range(layers)))


def parse(cfg: dict, layers: int) -> dict:
    model_type = cfg.get("model_type")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json ({model_type}) hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    return {**mla_fields(cfg, model_type), **routed_moe(cfg, model_type, layers)}


register(Family("deepseek_v3", SWITCHES, decoder_rows(mla_rows, moe_rows), parse=parse, extra_layers=True))

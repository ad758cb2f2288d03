"""Qwen3.5 / Qwen3.6 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the text model of
the multimodal `Qwen3_5ForConditionalGeneration` checkpoints): a hybrid decoder.

`layer_types` mixes gated delta-net linear-attention layers (`linear_attn.*`: a recurrent
state and a short causal convolution per row, no KV cache; `dflash_jax.model.delta_rule`)
with full-attention layers (`self_attn.*`) whose q_proj also yields an output gate
(output * sigmoid(gate)), with q/k norms and RoPE on the first `partial_rotary_factor` of
each head. Every RMSNorm but the delta-net's own stores its weight as an offset from 1. The
MoE variant has a sparse block on every layer (softmax, top k, renormalised) plus a shared
expert gated by sigmoid(shared_expert_gate(x)); its checkpoints store experts one by one.

The multimodal checkpoints (`qwen3_5`, `qwen3_5_moe`) keep the text model's config in
`text_config` and its weights under `model.language_model.`; the vision tower and the
multi-token-prediction head (`mtp.*`) are not read.
"""

from dflash_jax.config import LinearAttentionConfig
from dflash_jax.errors import ConfigError
from dflash_jax.families.hf import moe_config
from dflash_jax.families.registry import Family, register
from dflash_jax.families.qwen3_moe import moe_rows
from dflash_jax.families.table import Row, attention_rows, dense_mlp_rows

SWITCHES = dict(qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", attention_output_gate=True,
                norm_zero_centered=True)
LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def linear_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    rows = [Row(f"{hf_prefix}linear_attn.{p}.weight", f"{flax_prefix}linear_attn/{p}/kernel", True) for p in LINEAR]
    rows += [Row(f"{hf_prefix}linear_attn.{p}", f"{flax_prefix}linear_attn/{p}") for p in ("dt_bias", "A_log")]
    rows += [Row(f"{hf_prefix}linear_attn.conv1d.weight", f"{flax_prefix}linear_attn/conv1d"),
             Row(f"{hf_prefix}linear_attn.norm.weight", f"{flax_prefix}linear_attn/norm/weight")]
    return rows


def shared_expert_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    rows = [Row(f"{hf_prefix}mlp.shared_expert.{p}.weight", f"{flax_prefix}mlp/shared_expert/{p}/kernel", True)
            for p in ("gate_proj", "up_proj", "down_proj")]
    return rows + [Row(f"{hf_prefix}mlp.shared_expert_gate.weight", f"{flax_prefix}mlp/shared_expert_gate/kernel",
                       True)]


def table(hf_model: str, moe: bool) -> tuple[Row, ...]:
    prefix, flax_prefix = f"{hf_model}layers.{{i}}.", "model/layers_{i}/"
    mlp = moe_rows(prefix, flax_prefix) + shared_expert_rows(prefix, flax_prefix) if moe else dense_mlp_rows(
        prefix, flax_prefix)
    return (
        Row(f"{hf_model}embed_tokens.weight", "model/embed_tokens/embedding"),
        *attention_rows(prefix, flax_prefix), *linear_rows(prefix, flax_prefix), *mlp,
        Row(f"{hf_model}norm.weight", "model/norm/weight"),
        Row("lm_head.weight", "lm_head/kernel", True),
    )


def parse(cfg: dict, layers: int, moe: bool = False) -> dict:
    model_type = cfg.get("model_type")
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is attention
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise ConfigError(f"config.json ({model_type}) layer_types has unsupported kind(s) {bad}")

    def need(key):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config.json ({model_type}) field {key!r} must be a positive integer, got {value!r}")
        return value

    linear = LinearAttentionConfig(k_heads=need("linear_num_key_heads"), v_heads=need("linear_num_value_heads"),
                                   k_dim=need("linear_key_head_dim"), v_dim=need("linear_value_head_dim"),
                                   conv_kernel=need("linear_conv_kernel_dim"))
    if linear.v_heads % linear.k_heads:
        raise ConfigError(f"config.json ({model_type}) linear_num_value_heads {linear.v_heads} is not a multiple "
                          f"of linear_num_key_heads {linear.k_heads}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json ({model_type}) hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    out = dict(linear_attention=linear, linear_layers=tuple(t == "linear_attention" for t in types))
    if moe:
        shared = cfg.get("shared_expert_intermediate_size") or 0
        out.update(moe=moe_config(cfg, model_type, experts=("num_experts",), router="softmax_topk",
                                       norm_topk_prob=True, shared_expert_size=int(shared)),
                   sparse_layers=(True,) * layers)
    return out


def parse_moe(cfg: dict, layers: int) -> dict:
    return parse(cfg, layers, moe=True)


IGNORE = (r"model\.visual\..*", r"mtp\..*")
register(Family("qwen3_5_text", SWITCHES, table("model.", False), parse=parse, ignore=IGNORE))
register(Family("qwen3_5_moe_text", SWITCHES, table("model.", True), parse=parse_moe, ignore=IGNORE))
register(Family("qwen3_5", SWITCHES, table("model.language_model.", False), parse=parse, ignore=IGNORE,
                text_config=True))
register(Family("qwen3_5_moe", SWITCHES, table("model.language_model.", True), parse=parse_moe, ignore=IGNORE,
                text_config=True))

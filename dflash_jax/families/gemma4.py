"""Gemma 4 (`Gemma4ForCausalLM`, and the text model of the multimodal
`Gemma4ForConditionalGeneration` checkpoints).

Layers are sliding or full attention (`layer_types`); the full ("global") layers have their own
head_dim and KV heads (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`),
their own RoPE (`rope_parameters` per layer type; the full layers' is proportional and partial),
and with `attention_k_eq_v` their values are their keys' projection. q, k and v are RMS-normed
(v without a weight) and the softmax is unscaled. The last `num_kv_shared_layers` layers read the
K/V of the last earlier layer of their type instead of their own. Each block is "sandwiched": norms
before and after attention and MLP, and a learned scalar on its output. Embeddings are scaled by
sqrt(hidden); the MLP is a gated tanh-GELU; logits are soft-capped. Optional: per-layer inputs
(a second embedding and a projection of the first, a slice per layer through a small gated
projection), and an MoE block beside the MLP (its router scores the block's normed input, its
experts store gate and up as the halves of one `gate_up_proj`).

The multimodal checkpoints (`gemma4`) keep the text config in `text_config` and the weights under
`model.language_model.`; the vision and audio towers are not read.
"""

from dflash_jax.config import MoeConfig
from dflash_jax.errors import ConfigError
from dflash_jax.families.hf import rope_config
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, attention_rows, dense_mlp_rows

NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
         "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "post_per_layer_input_norm")
SWITCHES = dict(qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", norm_weight_in_float32=True)


def layer_rows(prefix: str, flax: str) -> list[Row]:
    rows = attention_rows(prefix, flax) + dense_mlp_rows(prefix, flax)
    rows += [Row(f"{prefix}{n}.weight", f"{flax}{n}/weight") for n in NORMS]
    rows += [Row(f"{prefix}{p}.weight", f"{flax}{p}/kernel", True) for p in ("per_layer_input_gate",
                                                                              "per_layer_projection")]
    rows += [
        Row(f"{prefix}layer_scalar", f"{flax}layer_scalar"),
        Row(f"{prefix}router.proj.weight", f"{flax}moe/router/kernel", True),
        Row(f"{prefix}router.scale", f"{flax}moe/router_scale"),
        Row(f"{prefix}router.per_expert_scale", f"{flax}moe/per_expert_scale"),
        # [experts, 2 * inter, hidden] and [experts, hidden, inter]: whole stacks, the last two axes swapped
        Row(f"{prefix}experts.gate_up_proj", f"{flax}moe/experts/gate_up_proj", True),
        Row(f"{prefix}experts.down_proj", f"{flax}moe/experts/down_proj", True),
    ]
    return rows


def table(hf_model: str) -> tuple[Row, ...]:
    return (
        Row(f"{hf_model}embed_tokens.weight", "model/embed_tokens/embedding"),
        Row(f"{hf_model}embed_tokens_per_layer.weight", "model/embed_tokens_per_layer/embedding"),
        Row(f"{hf_model}per_layer_model_projection.weight", "model/per_layer_model_projection/kernel", True),
        Row(f"{hf_model}per_layer_projection_norm.weight", "model/per_layer_projection_norm/weight"),
        *layer_rows(f"{hf_model}layers.{{i}}.", "model/layers_{i}/"),
        Row(f"{hf_model}norm.weight", "model/norm/weight"),
        Row("lm_head.weight", "lm_head/kernel", True),
    )


def _positive(cfg, key, model_type, default=None):
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json ({model_type}) field {key!r} must be a positive integer, got {value!r}")
    return value


def global_shape(cfg: dict, types: list, model_type: str) -> tuple[int | None, int | None]:
    """(head_dim, KV heads) of the full layers: `per_layer_config` (as transformers writes it),
    else `global_head_dim` / `num_global_key_value_heads`."""
    per_layer = cfg.get("per_layer_config")
    if per_layer:
        shapes = {(v.get("head_dim"), v.get("num_key_value_heads")) for v in per_layer.values()}
        full = {i for i, t in enumerate(types) if t == "full_attention"}
        if len(shapes) != 1 or {int(k) for k in per_layer} != full:
            raise ConfigError(f"config.json ({model_type}) per_layer_config must give every full_attention layer "
                              f"(and only those) one shape, got {per_layer}")
        return next(iter(shapes))
    if "global_head_dim" in cfg or "num_global_key_value_heads" in cfg:
        return cfg.get("global_head_dim"), cfg.get("num_global_key_value_heads")
    return None, None


def kv_shared_from(types: list, shared: int, model_type: str) -> tuple:
    """Per layer, the layer whose K/V it reads: the last of the first L - shared layers of its
    type (None: its own), as transformers' `kv_sharing_modes`."""
    first = len(types) - shared
    if shared == 0:
        return ()
    producers = {}
    for i in range(first):
        producers[types[i]] = i
    missing = sorted({t for t in types[first:]} - set(producers))
    if missing:
        raise ConfigError(f"config.json ({model_type}) num_kv_shared_layers {shared}: no earlier layer of type "
                          f"{missing[0]!r} to share K/V from")
    return tuple(None if i < first else producers[types[i]] for i in range(len(types)))


def parse(cfg: dict, layers: int) -> dict:
    model_type = cfg.get("model_type")
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: five sliding layers, then a full one
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        cfg = {**cfg, "layer_types": types}
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ConfigError(f"config.json ({model_type}) layer_types has unsupported kind(s) {bad}")
    for key, why in (("use_double_wide_mlp", "double-wide MLPs"), ("use_bidirectional_attention", "bidirectional attention")):
        if cfg.get(key):
            raise ConfigError(f"config.json ({model_type}) {key}={cfg[key]!r}: {why} are not supported")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"config.json ({model_type}) hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    rope = cfg.get("rope_parameters") or {}
    by_type = {t: rope_config({"rope_parameters": rope[t]}) if isinstance(rope.get(t), dict) else None
               for t in ("sliding_attention", "full_attention")}
    head_dim, kv_heads = global_shape(cfg, types, model_type)
    shared = cfg.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or not 0 <= shared < layers:
        raise ConfigError(f"config.json ({model_type}) num_kv_shared_layers must be in 0..{layers - 1}, got {shared!r}")
    out = dict(
        global_head_dim=head_dim, global_kv_heads=kv_heads, global_rope=by_type["full_attention"],
        attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)), kv_shared_from=kv_shared_from(types, shared, model_type),
        value_norm=True, attention_scale=1.0, block_norms="sandwich", embed_scale=True,
        final_logit_softcap=cfg.get("final_logit_softcapping"), mlp_activation="gelu_tanh", layer_scalar=True,
    )
    if by_type["sliding_attention"] is not None:
        out["rope"] = by_type["sliding_attention"]
    if cfg.get("hidden_size_per_layer_input"):
        out.update(per_layer_input_size=_positive(cfg, "hidden_size_per_layer_input", model_type),
                   per_layer_vocab_size=_positive(cfg, "vocab_size_per_layer_input", model_type))
    if cfg.get("enable_moe_block"):
        experts, top_k = _positive(cfg, "num_experts", model_type), _positive(cfg, "top_k_experts", model_type)
        if top_k > experts:
            raise ConfigError(f"config.json ({model_type}): top_k_experts {top_k} > num_experts {experts}")
        out.update(moe=MoeConfig(num_experts=experts, top_k=top_k,
                                 intermediate_size=_positive(cfg, "moe_intermediate_size", model_type),
                                 router="softmax_topk", norm_topk_prob=True, gate_up_halves=True,
                                 router_input_norm=True, per_expert_scale=True, activation="gelu_tanh"),
                   sparse_layers=(True,) * layers)
    return out


IGNORE = (r"model\.(vision_tower|audio_tower|embed_vision|embed_audio)\..*",)
register(Family("gemma4_text", SWITCHES, table("model."), parse=parse, ignore=IGNORE))
register(Family("gemma4", SWITCHES, table("model.language_model."), parse=parse, ignore=IGNORE, text_config=True))

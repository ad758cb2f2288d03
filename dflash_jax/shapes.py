"""Published models' shapes, for compiling or timing them without their weights: Qwen3-8B with
the z-lab Qwen3-8B-DFlash-b16 drafter, the config.json fields of other published targets
(Qwen3.5-27B, Gemma 4 31B, gpt-oss, Qwen3-30B-A3B, MiniMax-M2, Qwen3-Coder-Next, DeepSeek-V3, Kimi-K2.5,
GLM-5.1) with the drafter the z-lab recipe gives them,
and published DFlash2 pairs (`PUBLISHED_DFLASH2`: Qwen3.8-27B with its DFlash2 drafter).
`published_configs(scale, dtype, shape)` scales them down for tests and small machines.
(`python -m bench --aot / --published-shapes / --cost`, `python -m train --aot --shape`.)"""

from __future__ import annotations


# Published targets besides Qwen3-8B (config.json fields our parser reads), with the drafter
# shape the z-lab recipe gives them (dense layers of the target's widths, block 16).
PUBLISHED_TARGETS = {
    "qwen3.5-27b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16, full_attention_interval=4, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)),
}
PUBLISHED_TARGETS["gemma4-31b"] = dict(
    model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
    num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
    attention_k_eq_v=True, sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
    final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0,
    num_kv_shared_layers=0, enable_moe_block=False, rms_norm_eps=1e-6, tie_word_embeddings=True,
    max_position_embeddings=262144, rope_parameters=dict(
        full_attention=dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1e6),
        sliding_attention=dict(rope_type="default", rope_theta=10000.0)))
# Published mixture-of-experts configs (the fields our parser reads), from the models' config.json files.
PUBLISHED_MOE = {
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"] * 12, dtype="bfloat16",
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=4096, truncate=False)),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1e6, dtype="bfloat16"),
    # MiniMax-M2 (M2.1 and M2.5 share its shape): bfloat16 here (the released weights are FP8 blocks).
    "MiniMax-M2": dict(
        model_type="minimax_m2", vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
        num_attention_heads=48, num_key_value_heads=8, head_dim=128, rotary_dim=64, num_local_experts=256,
        num_experts_per_tok=8, use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
        use_routing_bias=True, shared_intermediate_size=0, tie_word_embeddings=False, max_position_embeddings=196608,
        rope_theta=5e6, rms_norm_eps=1e-6, dtype="bfloat16"),
}
# Qwen3-Coder-Next (and Qwen3-Next-80B-A3B, the same shape): a hybrid MoE, 3 gated delta-net layers to 1
# gated attention layer, every layer sparse (512 experts, top 10) with a shared expert; rope_theta and the
# (unused: no dense layer) intermediate_size are Qwen3-Next-80B-A3B's config.json values.
PUBLISHED_MOE["Qwen3-Coder-Next"] = dict(
    model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12, full_attention_interval=4, num_experts=512,
    num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
    max_position_embeddings=262144, rope_theta=1e7, partial_rotary_factor=0.25, dtype="bfloat16")
PUBLISHED_MOE["gpt-oss-120b"] = dict(
    PUBLISHED_MOE["gpt-oss-20b"], num_hidden_layers=36, num_local_experts=128,
    layer_types=["sliding_attention", "full_attention"] * 18)

PUBLISHED_TARGETS.update({name.lower(): hf for name, hf in PUBLISHED_MOE.items()})
# Multi-head latent attention targets (config.json fields): DeepSeek-V3, Kimi-K2.5's text model (DeepSeek-V3's
# layers with 64 heads, 384 experts, one dense layer) and GLM-5.1 (sparse attention: an indexer picks 2048
# positions a query).
PUBLISHED_MLA = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=163840, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
}
PUBLISHED_MLA["kimi-k2.5"] = dict(
    PUBLISHED_MLA["deepseek-v3"], vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
    n_routed_experts=384, n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
    max_position_embeddings=262144, rope_parameters=dict(
        rope_type="yarn", rope_theta=50000.0, factor=64.0, original_max_position_embeddings=4096, beta_fast=1.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
PUBLISHED_MLA["glm-5.1"] = dict(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=2048,
    qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_topk=2048, index_head_dim=128,
    index_n_heads=32, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=202752,
    rope_parameters=dict(rope_type="default", rope_theta=1e6))
PUBLISHED_TARGETS.update(PUBLISHED_MLA)
# The biggest targets as their checkpoints ship: the `quantization_config` of each config.json (MiniMax-M2.5
# has MiniMax-M2's shape; Kimi-K2.5 ships as `kimi_k25` with this text model in its `text_config`).
_FP8_BLOCKS = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
SHIPPED_QUANTIZATION = {
    "deepseek-v3": _FP8_BLOCKS,
    "glm-5.1": _FP8_BLOCKS,
    "minimax-m2.5": dict(_FP8_BLOCKS, fmt="float8_e4m3fn", modules_to_not_convert=["gate", "e_score_correction_bias",
                                                                                   "lm_head"]),
    "kimi-k2.5": dict(
        quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
        config_groups=dict(group_0=dict(targets=["Linear"], input_activations=None, output_activations=None, weights=dict(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False, observer="minmax"))),
        ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
        kv_cache_scheme=None),
    "gpt-oss-120b": dict(quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]),
}
SHIPPED_SHAPES = {"minimax-m2.5": "minimax-m2"}  # a shipped name whose shape is another's


def shipped_config(shape: str, layers: int | None = None, dense: int | None = None) -> dict:
    """The config.json dict of a published target as its checkpoint ships (`SHIPPED_QUANTIZATION`);
    with `layers`, cut to its first `layers` layers (its first dense layers kept, or `dense` of them)."""
    if shape not in SHIPPED_QUANTIZATION:
        raise ValueError(f"no shipped quantization for {shape!r}; choose one of {', '.join(SHIPPED_QUANTIZATION)}")
    text = dict(PUBLISHED_TARGETS[SHIPPED_SHAPES.get(shape, shape)])
    if layers is not None:
        text["num_hidden_layers"] = layers
        if "first_k_dense_replace" in text:
            text["first_k_dense_replace"] = min(text["first_k_dense_replace"] if dense is None else dense, layers)
        if text.get("layer_types"):
            text["layer_types"] = text["layer_types"][:layers]
    quant = SHIPPED_QUANTIZATION[shape]
    if shape == "kimi-k2.5":
        text.pop("model_type")
        return dict(model_type="kimi_k25", architectures=["KimiK25ForConditionalGeneration"], text_config=text,
                    quantization_config=quant, dtype="bfloat16")
    return dict(text, quantization_config=quant, dtype="bfloat16")
# Published DFlash2 drafters (`dflash_jax.dflash2`) and the target shape each is compiled against.
# Qwen3.8-27B-DFlash2: hidden 5120, block 8, taps [5, 19, 33, 47, 61] of a 64-layer target, and its
# dflash_config's DFlash2 keys. Qwen3.8-27B's config.json is not available here; the qwen3.5-27b
# shape (the same family: hybrid, hidden 5120, 64 layers, vocab 248320) stands in for it. The
# drafter's layers are the z-lab recipe's (5 dense layers of the target's widths).
PUBLISHED_DFLASH2 = {
    "qwen3.8-27b": dict(target="qwen3.5-27b", block_size=8, target_layer_ids=(5, 19, 33, 47, 61),
                        dflash2=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)),
}
SHAPES = ("qwen3-8b", *PUBLISHED_TARGETS, *PUBLISHED_DFLASH2)


def published_configs(scale: float = 1.0, dtype: str = "bfloat16", shape: str = "qwen3-8b"):
    """A published target and its 5-layer block-16 drafter, scaled: layers, heads and widths
    times `scale` (head dims kept; at least 1 head, 2 target layers, 1 drafter layer; widths
    rounded to multiples of 128; a hybrid's layer pattern kept whole).
    qwen3-8b: Qwen3-8B and the z-lab Qwen3-8B-DFlash-b16 drafter (the z-lab checkpoints' published shapes).
    A DFlash2 shape (`PUBLISHED_DFLASH2`): its target's shape with its drafter: the block size,
    DFlash2 keys (selector rank and top-k are not scaled) and taps it publishes, the taps moved
    in proportion when the target's layers shrink (`scaled_taps`)."""
    from dflash_jax.config import ModelConfig, RopeConfig
    from dflash_jax.families import model_config
    from dflash_jax.drafter import DrafterConfig, default_target_layer_ids, dense_drafter_model

    if shape in PUBLISHED_DFLASH2:
        return _dflash2_configs(scale, dtype, shape)
    mult = lambda n: max(128, round(n * scale / 128) * 128)
    dlayers = max(1, round(5 * scale))
    if shape == "qwen3-8b":
        head_dim = 128
        heads = max(1, round(32 * scale))
        kv = max(1, min(heads, round(8 * scale)))
        while heads % kv:
            kv -= 1
        layers = max(2, round(36 * scale))
        vocab = mult(151936)
        target = ModelConfig(
            model_type="qwen3", vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=mult(12288),
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6), max_position_embeddings=40960, qk_norm=True,
            sliding_windows=(None,) * layers, dtype=dtype,
        )
        mask = min(151669, vocab - 1)
    elif shape in PUBLISHED_TARGETS:
        target = model_config(_scaled(PUBLISHED_TARGETS[shape], scale, mult), dtype=dtype)
        layers, mask = target.num_hidden_layers, target.vocab_size - 1
    else:
        raise ValueError(f"unknown published shape {shape!r}; choose one of {', '.join(SHAPES)}")
    drafter = DrafterConfig(
        model=dense_drafter_model(target, dlayers), block_size=16, mask_token_id=mask,
        target_layer_ids=default_target_layer_ids(layers, dlayers), num_target_layers=layers,
    )
    return target, drafter


def _dflash2_configs(scale: float, dtype: str, shape: str):
    """A DFlash2 shape: its target's published configs with the drafter made a DFlash2 drafter."""
    import dataclasses

    from dflash_jax.dflash2 import DFlash2Config

    pub = PUBLISHED_DFLASH2[shape]
    target, drafter = published_configs(scale, dtype, pub["target"])
    d2 = DFlash2Config(**pub["dflash2"])
    if drafter.model.hidden_size % d2.conv_group_size:  # a scaled hidden is a multiple of 128: never here
        raise ValueError(f"{shape} at scale {scale}: conv_group_size {d2.conv_group_size} does not divide hidden "
                         f"{drafter.model.hidden_size}")
    taps = scaled_taps(pub["target_layer_ids"], PUBLISHED_TARGETS[pub["target"]]["num_hidden_layers"],
                       target.num_hidden_layers)
    return target, dataclasses.replace(drafter, block_size=pub["block_size"], dflash2=d2, target_layer_ids=taps)


def scaled_taps(taps, full_layers: int, layers: int) -> tuple[int, ...]:
    """Published taps of a `full_layers` target moved to a `layers` one in proportion: tap t to
    round(t x layers / full_layers), never the last layer (at most layers - 2, as
    `default_target_layer_ids`), taps that meet merged. The published taps at full scale."""
    top = max(layers - 2, 0)
    return tuple(sorted({min(max(round(t * layers / full_layers), 0), top) for t in taps}))


def _scaled(hf: dict, scale: float, mult) -> dict:
    """A published config.json scaled: heads (key/value heads dividing them; a delta-net's
    value heads a multiple of its key heads), hidden, MLP and vocabulary widths, and layers as
    whole repeats of the layer_types pattern."""
    out = dict(hf)
    heads = max(1, round(hf["num_attention_heads"] * scale))
    kv = max(1, min(heads, round(hf["num_key_value_heads"] * scale)))
    while heads % kv:
        kv -= 1
    out.update(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=mult(hf["hidden_size"]),
               intermediate_size=mult(hf["intermediate_size"]), vocab_size=mult(hf["vocab_size"]))
    if "num_global_key_value_heads" in hf:
        out["num_global_key_value_heads"] = max(1, min(heads, round(hf["num_global_key_value_heads"] * scale)))
        while heads % out["num_global_key_value_heads"]:
            out["num_global_key_value_heads"] -= 1
    if "linear_num_key_heads" in hf:
        k = max(1, round(hf["linear_num_key_heads"] * scale))
        out.update(linear_num_key_heads=k,
                   linear_num_value_heads=k * (hf["linear_num_value_heads"] // hf["linear_num_key_heads"]))
    types = hf.get("layer_types") or [None]
    period = next(p for p in range(1, len(types) + 1) if len(types) % p == 0 and types == types[:p] * (len(types) // p))
    pattern = types[:period]
    repeats = max(1, round(hf["num_hidden_layers"] * scale / len(pattern)))
    layers = max(2, repeats * len(pattern))
    out["num_hidden_layers"] = layers
    if hf.get("layer_types"):
        out["layer_types"] = (pattern * layers)[:layers]
    return out

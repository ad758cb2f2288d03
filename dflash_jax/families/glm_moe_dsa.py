"""GLM-5 / GLM-5.1 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's layers (`deepseek_v3`: MLA, the sigmoid
grouped router, shared experts) with DeepSeek sparse attention.

Each layer's `self_attn.indexer` (wq_b from the q latent, wk and a LayerNorm `k_norm`, weights_proj)
picks the `index_topk` cached positions each query attends to (`dflash_jax.model.mla.Indexer`),
`index_n_heads` heads of `index_head_dim`; its keys live in the cache beside the latent.
`indexer_types` (or `index_topk_pattern` / `index_topk_freq`) may mark layers "shared": they run no
indexer and reuse the previous layer's positions. RoPE is interleaved everywhere (MLA and indexer).
`mlp_layer_types` (default: `first_k_dense_replace` dense layers, then sparse) says which layers
have experts. The multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is not read.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.config import IndexerConfig
from dflash_jax.errors import ConfigError
from dflash_jax.families.deepseek_v3 import SWITCHES, mla_fields, mla_rows, moe_rows, positive, routed_moe
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, decoder_rows


def indexer_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    ix, flax = f"{hf_prefix}self_attn.indexer.", f"{flax_prefix}self_attn/indexer/"
    rows = [Row(f"{ix}{p}.weight", f"{flax}{p}/kernel", True) for p in ("wq_b", "wk", "weights_proj")]
    return rows + [Row(f"{ix}k_norm.weight", f"{flax}k_norm/scale"), Row(f"{ix}k_norm.bias", f"{flax}k_norm/bias")]


def indexer_types(cfg: dict, layers: int, model_type: str) -> list[str]:
    """transformers' per-layer indexer modes: `indexer_types`, else `index_topk_pattern`, else the
    `index_topk_freq` / `index_skip_topk_offset` schedule (default: every layer runs its indexer)."""
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or set(types) - {"full", "shared"}:
        raise ConfigError(f"config.json ({model_type}) indexer_types must give each of the {layers} layers "
                          f"'full' or 'shared', got {types!r}")
    if types[0] == "shared":
        raise ConfigError(f"config.json ({model_type}) indexer_types: the first layer has no earlier indexer to share")
    return list(types)


def parse(cfg: dict, layers: int) -> dict:
    model_type = cfg.get("model_type")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json ({model_type}) hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("q_lora_rank") is None:
        raise ConfigError(f"config.json ({model_type}) needs 'q_lora_rank': the indexer reads the q latent")
    out = {**mla_fields({**cfg, "rope_interleave": True}, model_type), **routed_moe(cfg, model_type, layers)}
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is not None:
        if len(mlp_types) != layers or set(mlp_types) - {"dense", "sparse"}:
            raise ConfigError(f"config.json ({model_type}) mlp_layer_types must give each of the {layers} layers "
                              f"'dense' or 'sparse', got {mlp_types!r}")
        out["sparse_layers"] = tuple(t == "sparse" for t in mlp_types)
    types = indexer_types(cfg, layers, model_type)
    indexer = IndexerConfig(heads=positive(cfg, "index_n_heads", model_type, 32),
                            head_dim=positive(cfg, "index_head_dim", model_type, 128),
                            top_k=positive(cfg, "index_topk", model_type, 2048),
                            shared=tuple(t == "shared" for t in types))
    if indexer.head_dim < out["mla"].qk_rope_head_dim:
        raise ConfigError(f"config.json ({model_type}) index_head_dim {indexer.head_dim} is smaller than "
                          f"qk_rope_head_dim {out['mla'].qk_rope_head_dim}")
    out["mla"] = dataclasses.replace(out["mla"], indexer=indexer)
    return out


register(Family("glm_moe_dsa", SWITCHES, decoder_rows(mla_rows, indexer_rows, moe_rows), parse=parse,
                extra_layers=True))

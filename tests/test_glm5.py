"""GLM-5 / GLM-5.1 targets (`glm_moe_dsa`): MLA and DeepSeek-MoE with DeepSeek sparse attention, against
transformers, on tiny random checkpoints (the checks of tests/test_mla.py, for this family).

- Six configs (`CASES`: every layer's own indexer or every other layer sharing the previous one's
  positions, YaRN, an index_topk wider than any prompt (dense attention), biases and one group, an
  explicit dense/sparse layer pattern with tied embeddings): logits equal transformers', whole and
  in right-padded prefill pieces; plain greedy decoding equals `generate`; DFlash with a random
  drafter on a page pool equals plain decoding, greedy and seeded sampled (decoding: the configs in
  `DECODED`). (Everyday: the first config's logits; the rest `-m heavy`.)
- `python -m infer` equals transformers, and on a 2-device mesh with a page pool equals one device,
  greedy and sampled (`-m heavy`).
- Sparse attention matters: the same weights attending densely give other logits; the cache holds
  the indexer's keys beside the latent; a draft tree is refused.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import forward, init_cache, load_target
from dflash_jax.engine.cycles import check_tree
from dflash_jax.errors import ConfigError, InputError
from dflash_jax.families import model_config
from test_mla import (VOCAB, build, case_params, check_against_transformers, check_cli_on_two_devices,
                      check_decoding, tiny_config)

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
CASES = {
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    "glm_moe_dsa-shared-indexers": ("glm_moe_dsa", dict(indexer_types=["full", "shared", "full", "shared"])),
    "glm_moe_dsa-yarn": ("glm_moe_dsa", dict(rope_parameters=YARN)),
    "glm_moe_dsa-dense-top-k": ("glm_moe_dsa", dict(index_topk=64)),
    "glm_moe_dsa-biased-one-group": ("glm_moe_dsa", dict(attention_bias=True, n_group=1, topk_group=1,
                                                         routed_scaling_factor=1.0)),
    "glm_moe_dsa-layer-pattern-tied": ("glm_moe_dsa", dict(mlp_layer_types=["sparse", "dense", "sparse", "dense"],
                                                           tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name", case_params(CASES, ("glm_moe_dsa",)))
def test_logits_equal_transformers_whole_and_in_padded_pieces(name, tmp_path):
    model, path, _ = build(name, tmp_path, CASES)
    config, params = load_target(path)
    assert config.mla.indexer is not None and config.mla.rope_interleave
    check_against_transformers(model, config, params, name)


# Decoding (plain as transformers' `generate`, DFlash as plain) runs on the configs that change what a
# decode step reads or caches; the configs that change only RoPE, routing, biases or ties are checked
# against transformers by their logits, whole and in padded pieces (the cached path), and their decoding
# went for .ci/run's 50 minutes (2026-12-08).
DECODED = ("glm_moe_dsa", "glm_moe_dsa-shared-indexers", "glm_moe_dsa-dense-top-k")


@pytest.mark.heavy  # engines compile for a minute per case
@pytest.mark.parametrize("name", DECODED)
def test_plain_decoding_equals_transformers_and_dflash_equals_plain(name, tmp_path):
    check_decoding(*build(name, tmp_path, CASES))


def test_sparse_attention_selects_and_its_keys_are_cached(tmp_path):
    _, path, _ = build("glm_moe_dsa", tmp_path, CASES)
    config, params = load_target(path)
    cache = init_cache(config, 2, 48, page_size=16)
    assert cache.index_k.shape == (4, 2, 48, 16) and cache.k.shape == (4, 2, 48, 32) and cache.v.shape == (4, 2, 48, 8)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, VOCAB, (2, 40)), jnp.int32)
    sparse = np.asarray(forward(params, config, ids, cache).logits)
    import dataclasses

    dense = config.replace(mla=dataclasses.replace(config.mla, indexer=dataclasses.replace(config.mla.indexer,
                                                                                           top_k=48)))
    dense_logits = np.asarray(forward(params, dense, ids, cache).logits)
    # the first 8 positions see at most 8 keys: the same; later ones attend to a selection
    np.testing.assert_allclose(sparse[:, :8], dense_logits[:, :8], atol=1e-5)
    assert np.abs(sparse[:, 9:] - dense_logits[:, 9:]).max() > 1e-3
    with pytest.raises(InputError, match="sparse attention"):
        check_tree(config, 4, 8)


@pytest.mark.parametrize("change,message", [
    (dict(indexer_types=["shared", "full", "full"]), "the first layer has no earlier indexer to share"),
    (dict(indexer_types=["full"]), "indexer_types must give each of the 3 layers"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types must give each of the 3 layers"),
    (dict(q_lora_rank=None), "needs 'q_lora_rank'"),
    (dict(index_head_dim=4), "index_head_dim 4 is smaller than qk_rope_head_dim 8"),
    (dict(index_topk=0), "'index_topk' must be a positive integer"),
])
def test_bad_glm5_config_is_a_one_line_error(change, message):
    cfg = tiny_config(**{"model_type": "glm_moe_dsa", "index_topk": 8, "index_head_dim": 16, "index_n_heads": 4,
                         **change})
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        model_config(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.heavy  # four `python -m infer` runs
def test_infer_cli_equals_transformers_and_on_two_devices_equals_one(tmp_path):
    check_cli_on_two_devices(*build("glm_moe_dsa", tmp_path, CASES), tmp_path)

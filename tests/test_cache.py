"""The static KV cache with a length per row: prefill, decode, per-row offsets, rollback; the axes
each of its arrays declares; a ring's writes and reads, dense and latent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import ConfigError, ModelConfig, forward, init_cache
from dflash_jax.config import IndexerConfig, MlaConfig
from dflash_jax.drafter import DrafterConfig
from dflash_jax.kv import init_context_cache, read_kv, write_kv
from dflash_jax.model import init_params
from fixtures import model_config

CONFIG = ModelConfig(
    model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
    sliding_windows=(None, 5, None),  # one windowed layer, so windows are exercised too
)
PARAMS = init_params(CONFIG, jax.random.PRNGKey(3))
TAPS = (0, 2)
TOL = dict(atol=2e-5, rtol=0)


def run(tokens, cache, **kw):
    return forward(PARAMS, CONFIG, jnp.asarray(tokens, jnp.int32), cache, taps=TAPS, **kw)


def full(seq):
    """Logits and taps of one sequence processed in a single call."""
    out = run(np.asarray(seq)[None], init_cache(CONFIG, 1, 32))
    return np.asarray(out.logits[0]), np.asarray(out.tap_features[0])


def ids(n, seed):
    return np.random.RandomState(seed).randint(0, CONFIG.vocab_size, n)


def test_prefill_then_token_by_token_decode_equals_full_forward():
    seq = ids(14, 0)
    ref_logits, ref_taps = full(seq)
    out = run(seq[None, :6], init_cache(CONFIG, 1, 32))
    logits, taps = [np.asarray(out.logits[0])], [np.asarray(out.tap_features[0])]
    cache = out.cache
    for t in range(6, 14):
        out = run(seq[None, t:t + 1], cache)
        cache = out.cache
        logits.append(np.asarray(out.logits[0]))
        taps.append(np.asarray(out.tap_features[0]))
    assert int(cache.lengths[0]) == 14
    np.testing.assert_allclose(np.concatenate(logits), ref_logits, **TOL)
    np.testing.assert_allclose(np.concatenate(taps), ref_taps, **TOL)


def test_chunk_at_per_row_offsets_equals_per_row_runs():
    a, b = ids(12, 1), ids(12, 2)
    # Row 0 has 4 tokens cached, row 1 has 7; both then take a chunk of 5 at their own offset.
    cache = init_cache(CONFIG, 2, 32)
    prompt = np.zeros((2, 7), np.int64)
    prompt[0, :4], prompt[1, :7] = a[:4], b[:7]
    cache = run(prompt, cache, num_tokens=jnp.array([4, 7])).cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), [4, 7])
    chunk = np.stack([a[4:9], b[7:12]])
    out = run(chunk, cache)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), [9, 12])
    for row, seq, start in ((0, a, 4), (1, b, 7)):
        ref_logits, ref_taps = full(seq[:start + 5])
        np.testing.assert_allclose(np.asarray(out.logits[row]), ref_logits[start:], **TOL)
        np.testing.assert_allclose(np.asarray(out.tap_features[row]), ref_taps[start:], **TOL)


@pytest.mark.parametrize("bucket", [12, 16])
def test_padded_batch_of_different_prompt_lengths_equals_each_alone(bucket):
    lengths = [3, 12, 7, 1]
    seqs = [ids(n + 4, 10 + i) for i, n in enumerate(lengths)]
    tokens = np.zeros((4, bucket), np.int64)
    for i, n in enumerate(lengths):
        tokens[i, :n] = seqs[i][:n]
    last = jnp.array(lengths)[:, None] - 1
    out = run(tokens, init_cache(CONFIG, 4, 32), num_tokens=jnp.array(lengths), logits_indices=last)
    assert out.logits.shape == (4, 1, CONFIG.vocab_size)
    cache = out.cache
    # Then four decode steps for the whole batch: padding written past each row's length
    # is stale and must never be read.
    steps = [np.asarray(out.logits[:, 0])]
    for t in range(4):
        step_tokens = np.array([[s[n + t]] for s, n in zip(seqs, lengths)])
        out = run(step_tokens, cache)
        cache = out.cache
        steps.append(np.asarray(out.logits[:, 0]))
    for i, n in enumerate(lengths):
        ref_logits, _ = full(seqs[i][:n + 4])
        np.testing.assert_allclose(np.stack([s[i] for s in steps]), ref_logits[n - 1:n + 4], **TOL)


def test_rollback_is_a_length_update():
    seq, wrong = ids(10, 5), ids(4, 6)
    cache = run(seq[None, :6], init_cache(CONFIG, 1, 32)).cache
    # A verify-like pass writes 4 tokens, then all but one are rejected.
    cache = run(wrong[None], cache).cache
    cache = cache.replace(lengths=cache.lengths - 3)
    assert int(cache.lengths[0]) == 7
    # Continue with different tokens; the rejected entries at 7..9 are overwritten or masked.
    true_seq = np.concatenate([seq[:6], wrong[:1], seq[6:9]])
    out = run(true_seq[None, 7:], cache)
    ref_logits, ref_taps = full(true_seq)
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref_logits[7:], **TOL)
    # And a stale entry past the length (rejected token at 9) is not read by a short chunk.
    cache = run(seq[None, :6], init_cache(CONFIG, 1, 32)).cache
    cache = run(wrong[None], cache).cache.replace(lengths=jnp.array([6]))
    out = run(seq[None, 6:7], cache)
    np.testing.assert_allclose(np.asarray(out.logits[0]), full(seq[:7])[0][6:], **TOL)


def test_bad_tap_is_refused():
    with pytest.raises(ConfigError, match="outside the target's 3 layers"):
        forward(PARAMS, CONFIG, jnp.zeros((1, 2), jnp.int32), init_cache(CONFIG, 1, 8), taps=(3,))


# --------------------------------------------------------------------------- the cache describes itself

BATCH, PAGES = 3, 20  # distinct sizes, so a row axis is told from a pool's pages or a ring's positions
LATENT = CONFIG.replace(model_type="deepseek_v3", sliding_windows=None,
                        mla=MlaConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                      indexer=IndexerConfig(heads=2, head_dim=8, top_k=4)))
POOL = dict(page_size=8, num_pages=PAGES)
CACHES = {  # name: (a cache of 3 rows of 48 positions, its kind)
    "dense": (lambda: init_cache(CONFIG, BATCH, 48, page_size=8), "dense"),
    "dense pool": (lambda: init_cache(CONFIG, BATCH, 48, **POOL), "dense"),
    # Gemma 4: its sliding group a ring of 16 positions per row, its global group pooled
    "ring and pool": (lambda: init_cache(model_config("gemma4", 8, 3), BATCH, 48, **POOL, ring_chunk=10), "dense"),
    "hybrid": (lambda: init_cache(model_config("qwen3_5", 8, 3), BATCH, 48, **POOL), "dense"),
    "latent": (lambda: init_cache(LATENT, BATCH, 48, page_size=8), "latent"),
    "latent pool": (lambda: init_cache(LATENT, BATCH, 48, **POOL), "latent"),
    "context ring": (lambda: init_context_cache(DrafterConfig(model=CONFIG, block_size=4, mask_token_id=0,
                                                              target_layer_ids=(0,), num_target_layers=3),
                                                BATCH, 96, page_size=8, window=8, ring_chunk=8), "dense"),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_a_cache_names_the_axes_of_each_of_its_arrays(name):
    make, kind = CACHES[name]
    cache = make()
    assert cache.kind == kind
    seen = []
    out = cache.map_arrays(lambda x, axes: seen.append((x, axes)) or -x)
    leaves = jax.tree_util.tree_leaves(cache)
    assert sorted(map(id, (x for x, _ in seen))) == sorted(map(id, leaves))  # every array, once
    for a, b in zip(jax.tree_util.tree_leaves(out), leaves):  # and f's results are the cache's arrays
        np.testing.assert_array_equal(np.asarray(a), -np.asarray(b))
    for x, axes in seen:
        assert len(axes) == x.ndim, (x.shape, axes)
        if "batch" in axes:  # the rows' axis (what a narrowed state gathers, what `data` splits)
            assert x.shape[axes.index("batch")] == BATCH, (x.shape, axes)
    axes = cache.logical_axes()
    for field in cache.kv_names():
        buf, args, kind_of = getattr(cache, field), cache.kv_args(field), cache.kind_of(field)
        assert kind_of == ("latent" if field == "index_k" else "dense" if field.endswith("global") else kind)
        assert buf.ndim == 4  # a position's K/V heads (or its latent) one row
        if kind_of == "dense":  # split over `model` by whole heads only
            heads = cache.heads_of(field)
            assert axes[field][-1] == ("kv_heads", heads) and buf.shape[-1] % heads == 0
        else:
            assert axes[field][-1] is None
        if args["pages"] is None:  # per row (a ring too): rows on axis 1
            assert axes[field][1] == "batch" and (buf.shape[2] < 48 if args["ring"] else buf.shape[2] >= 48)
        else:  # a pool's pages and their positions belong to no row
            assert axes[field][1:3] == (None, None) and buf.shape[1] == PAGES
    assert ("state" in axes) == (name == "hybrid") and ("index_k" in axes) == name.startswith("latent")
    assert cache.ring == (name in ("ring and pool", "context ring"))


@pytest.mark.parametrize("layer", [1, None])
@pytest.mark.parametrize("kind", ["dense", "latent"])
def test_a_ring_write_lands_at_p_mod_ring_and_read_kv_finds_it(kind, layer):
    """Two chunks of 5 into a ring of 8 positions per row (the second wrapping round), into rows 2 and
    0 (a third, padding row dropped): each value lands at position % 8 of its row, its heads one row,
    and nowhere else, and read_kv gives it back (with `heads`, as written; without, as stored)."""
    rs = np.random.RandomState(7)
    layers, ring, t = 3, 8, 5
    written = (2, 4) if kind == "dense" else (1, 6)  # [kv_heads, head_dim], or a latent's one head
    buf = jnp.asarray(rs.randn(layers, BATCH, ring, written[0] * written[1]), jnp.float32)
    expected = np.asarray(buf).copy()
    rows = jnp.asarray([2, 0, BATCH])
    at = slice(None) if layer is None else layer
    for offsets in ([3, 6, 0], [8, 11, 5]):
        new = rs.randn(*((layers,) if layer is None else ()), 3, t, *written).astype(np.float32)
        buf = write_kv(buf, layer, jnp.asarray(new), jnp.asarray(offsets), rows, ring=True)
        for i, (row, offset) in enumerate(zip([2, 0], offsets)):
            for j in range(t):
                expected[at, row, (offset + j) % ring] = new[..., i, j, :, :].reshape(*new.shape[:-4], -1)
        np.testing.assert_array_equal(np.asarray(buf), expected)
        positions = jnp.asarray(offsets[:2])[:, None] + jnp.arange(t)[None, :]
        got = read_kv(buf, layer, positions, rows[:2], ring=True, heads=written[0])
        np.testing.assert_array_equal(np.asarray(got), new[..., :2, :, :, :])
        as_stored = read_kv(buf, layer, positions, rows[:2], ring=True)
        np.testing.assert_array_equal(np.asarray(as_stored), new[..., :2, :, :, :].reshape(*got.shape[:-2], -1))


def test_a_cache_row_splits_over_model_by_whole_heads_only():
    """A dense row of 2 heads x 64 is 128 values, which 4 devices divide, but not its heads: it stays
    whole (as a head axis of 2 did); 8 heads split 4 ways; a latent row never splits."""
    from types import SimpleNamespace

    from dflash_jax.sharding import logical_spec

    mesh = SimpleNamespace(shape={"data": 1, "model": 4})  # all logical_spec reads of a mesh
    for heads, want in ((2, None), (8, "model")):
        cache = init_cache(CONFIG.replace(num_key_value_heads=heads, num_attention_heads=8, head_dim=64), BATCH, 48)
        axes = cache.logical_axes()["k"]
        assert axes[-1] == ("kv_heads", heads) and cache.k.shape[-1] == heads * 64
        assert logical_spec(axes, cache.k.shape, mesh)[-1] == want
    latent = init_cache(LATENT, BATCH, 48)
    assert latent.k.shape[-1] % 4 == 0 and logical_spec(latent.logical_axes()["k"], latent.k.shape, mesh)[-1] is None



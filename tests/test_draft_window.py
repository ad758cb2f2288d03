"""The draft window (`--draft-window N`, `EngineSpec.draft_window`): each block of the drafter sees
only its row's last N committed positions, and the drafter's context cache is a ring of them.

- A block drafted over a ring context, written chunk after chunk until it has gone round several
  times, equals the training path's block (every position's context K/V) under the mask "context
  positions anchor - N .. anchor - 1", with and without a layer's own sliding window (both: the
  smaller rules, query by query).
- The context cache's bytes do not depend on the cache length once a window is set (a page pool
  or not: the ring is per row), and N < 1 is a one-line error.
- Lossless whatever N (`-m heavy`): for N = 1, a small N and one longer than the prompts, per-slot
  and on a page pool, and a draft tree, greedy rows equal plain greedy and seeded sampled rows plain
  sampling with the same seed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter import DFlashDrafter, draft_hidden, extend_context, init_drafter_params
from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.engine.options import EngineOptions
from dflash_jax.engine.step import init_state
from dflash_jax.errors import DFlashError, InputError
from dflash_jax.kv import init_context_cache
from fixtures import CHUNK, MAX_NEW, MAX_PROMPT, PAGE, by_index, heavy, prompts, setup


@pytest.mark.parametrize("layer_windows", [(6, None), heavy((None, None))])
def test_a_block_over_a_ring_sees_the_last_n_positions(layer_windows):
    """Ring of 16 (window 3 + chunks of 8 -> two pages of 8) per row; three rows at different
    lengths; after each chunk, the drafted block equals the training path's with the window mask."""
    _, _, drafter, _ = setup("qwen3-v8")
    drafter = dataclasses.replace(drafter, model=drafter.model.replace(sliding_windows=layer_windows))
    dparams = init_drafter_params(drafter, jax.random.PRNGKey(3))
    window, chunk, page, b = 3, 8, 8, drafter.block_size
    rs = np.random.RandomState(0)
    n, total = 3, 56
    feats = jnp.asarray(rs.randn(n, total, drafter.num_taps * drafter.model.hidden_size), jnp.float32)
    embeds = jnp.asarray(rs.randn(n, b, drafter.model.hidden_size), jnp.float32)
    ring = init_context_cache(drafter, n, 64, page_size=page, window=window, ring_chunk=chunk)
    assert ring.ring and ring.k.shape[2] == 16 and ring.window == window
    for step in range(6):  # rows commit different counts, so their rings wrap at different steps
        lengths = np.asarray(ring.lengths)
        taken = np.array([(step * 3 + r) % chunk + 1 for r in range(n)])  # a write of `chunk`, `taken` committed
        piece = jnp.stack([jax.lax.dynamic_slice_in_dim(feats[r], int(lengths[r]), chunk) for r in range(n)])
        ring = extend_context(dparams, drafter, piece, ring, jnp.asarray(taken))
        got = draft_hidden(dparams, drafter, embeds, ring)
        lengths = np.asarray(ring.lengths)
        for r in range(n):
            anchor = int(lengths[r])
            pos = jnp.arange(b)[None] + anchor
            s = jnp.arange(total)
            ctx = (s >= anchor - window) & (s < anchor)
            want = DFlashDrafter(drafter).apply({"params": dparams}, embeds[r:r + 1], pos, feats[r:r + 1],
                                                jnp.broadcast_to(ctx, (1, b, total)),
                                                method=DFlashDrafter.train_hidden)
            np.testing.assert_allclose(np.asarray(got[r]), np.asarray(want[0]), atol=2e-5, rtol=1e-5,
                                       err_msg=f"step {step}, row {r}, anchor {anchor}")
    assert int(np.asarray(ring.lengths).min()) > 16 + window  # every ring went round


def _context_bytes(**kw):
    target, _, drafter, _ = setup("qwen3-v8")
    spec_of = lambda prompt: BatchEngine(target, None, drafter, None, block_size=8, batch_size=3, max_new_tokens=24,
                                         max_prompt_len=prompt, page_size=PAGE, prefill_chunk=CHUNK, speculation="fixed", **kw).spec
    out = []
    for prompt in (64, 4096):
        cache = jax.eval_shape(lambda spec=spec_of(prompt): init_state(spec, 3)).context_cache
        out.append((cache.k.shape, cache.k.size * cache.k.dtype.itemsize * 2))
    return out


def test_the_context_cache_stays_flat_and_bad_windows_are_refused():
    """With a window the context cache is a ring whose bytes are the same for 64- and 4096-token
    prompts (with a page pool too); without one it grows (per slot) or is the pool's."""
    (short, short_bytes), (long, long_bytes) = _context_bytes(draft_window=4)
    assert short == long == (2, 3, 32, 2 * 8) and short_bytes == long_bytes  # 4 + a 16-token chunk: 2 pages
    (_, pooled_bytes), (pooled_long, pooled_long_bytes) = _context_bytes(draft_window=4, kv_pages=300)
    assert pooled_bytes == pooled_long_bytes == short_bytes and pooled_long == long
    (_, full_short), (_, full_long) = _context_bytes()
    assert full_long > 30 * full_short
    with pytest.raises(InputError, match=r"^--draft-window must be >= 1, got 0$"):
        EngineOptions(draft_window=0)
    target, tparams, drafter, dparams = setup("qwen3-v8")
    with pytest.raises(DFlashError, match=r"^--draft-window must be >= 1, got -3$"):
        BatchEngine(target, tparams, drafter, dparams, draft_window=-3, batch_size=1, speculation="fixed")


# --------------------------------------------------------------------------- lossless (-m heavy)


NAME = "qwen3-v8"
SAMPLINGS = [Sampling(1.0, top_k=4, per_row=True) if i % 3 == 1 else Sampling(per_row=True)
             for i in range(len(prompts(NAME)))]  # every third row sampled (seeded), the others greedy


def run_rows(window=None, block_size=8, **kw):
    """The setup's prompts, greedy and sampled rows mixed, through an engine with a draft window."""
    target, tparams, drafter, dparams = setup(NAME)
    gen = BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                      block_size=block_size, batch_size=3, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
                      page_size=PAGE, prefill_chunk=CHUNK, sampling=Sampling(per_row=True), draft_window=window, speculation="fixed", **kw)
    return gen, by_index(gen.generate(list(prompts(NAME)), seed=7, sampling=SAMPLINGS))


@functools.cache
def plain_rows():
    return run_rows(block_size=1)[1]


@pytest.mark.heavy
@pytest.mark.parametrize("window,pool,tree", [(1, 40, 0), (5, None, 0), (5, None, 6)])  # 64 (mask only): by hand
def test_windowed_decoding_equals_plain_decoding(window, pool, tree):
    """N = 1 on a pool (the target paged, the context a ring), 5 per slot (the ring of 32 wraps:
    rows reach 32 + 24 positions), 64 (longer than any row: no ring, the mask alone, on the pool)
    and a draft tree under a window: greedy rows equal plain greedy, seeded sampled rows plain
    sampling with the same seed."""
    gen, got = run_rows(window, kv_pages=pool, tree_budget=tree)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain_rows()]
    assert any(SAMPLINGS[i].temperature > 0 and max(r.acceptance_lengths) > 1 for i, r in enumerate(got))
    assert max(max(r.acceptance_lengths) for r in got) > 1  # drafts were accepted
    cache = gen.new_state().context_cache
    assert cache.ring == (window < 64) and (cache.pages is None) == (cache.ring or pool is None)

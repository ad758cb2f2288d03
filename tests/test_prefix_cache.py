"""Prefix caching over the page pool (`dflash_jax.kv.prefix.PrefixPool`, `BatchEngine(prefix_cache=...)`).

- The host's index (everyday, pure): a page's key names its tokens and every token before them; a
  lookup finds the cached pages a prompt starts with and always leaves its last token to run;
  pages are reference-counted, idle cached pages count as available and are evicted least recently
  used first, a page a row holds never is; a hit's pages are not counted twice at admission; the
  pool is whole again once every row is done.
- Where it cannot work (everyday): without a pool, a hybrid target's recurrent state, a target's
  sliding ring: off by default, and `on` asked for is a one-line error naming why.
- The engine, everyday on the smallest engine (a Qwen3 pair of 8 tokens, one prompt bucket, pages of
  4): prompts on shared prefixes decode the tokens and acceptance lengths they decode without the
  cache, and later rows hit the pages earlier rows left.
- The engine (heavy): prompts sharing a prefix of several pages with different suffixes decode the
  tokens they decode without the cache, greedy and seeded sampled (a per-row engine), rows admitted
  after the first finished hit its pages, a small pool evicts (the pool whole at the end), the
  serving engine (pieces after the hit; nothing compiles after warm-up) and a 2-device mesh
  (data=1, model=2, in a subprocess) likewise.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dflash_jax.engine import BatchEngine, Sampling  # noqa: E402
from dflash_jax.engine.options import EngineOptions  # noqa: E402
from dflash_jax.engine.slots import SlotLedger  # noqa: E402
from dflash_jax.errors import DFlashError, InputError  # noqa: E402
from dflash_jax.kv import PrefixPool, page_keys  # noqa: E402

P = 8  # positions per page in these tests


# --------------------------------------------------------------------------- the host's index (everyday)


def test_the_prefix_index_shares_counts_and_evicts():
    a, b = list(range(100, 120)), list(range(200, 220))
    # A key names a page's tokens and all before them.
    assert page_keys(a, 2, P)[0] == page_keys(a[:8] + b, 1, P)[0]
    assert page_keys(a, 2, P)[1] != page_keys(b[:8] + a[8:], 2, P)[1]
    pool = PrefixPool(8, P)
    assert pool.lookup(a) == []
    row = pool.take(3)  # 20 tokens: pages 0, 1 full, page 2 partial
    pool.register(a, row)
    assert set(pool.key_of) == set(row[:2])  # only full prompt pages are cached
    assert pool.lookup(a) == row[:2] and pool.lookup(a[:17]) == row[:2]
    assert pool.lookup(a[:16]) == row[:1]  # a hit always leaves a token to run
    assert pool.lookup(a[:8] + b) == row[:1] and pool.lookup(b) == []
    # A second row shares the two pages: refs 2, not counted twice.
    hits = pool.lookup(a)
    assert pool.cost(2, hits) == 2  # held by a row: no idle page leaves `available`
    other = pool.take(2, hits)
    assert other[:2] == row[:2] and pool.refs[row[0]] == 2 and pool.available == 3
    pool.give(row)  # the first row ends: its shared pages stay held, its private page is free
    assert pool.refs[row[0]] == 1 and not pool.idle and pool.available == 4
    pool.give(other)
    assert list(pool.idle) == [row[1], row[0]] and pool.available == 8  # deeper page first: evicted first
    assert pool.cost(1, pool.lookup(a)) == 3  # two idle pages held again, one new
    # A third prompt needing every free page and one more evicts the least recently used idle page.
    third = pool.take(7)
    assert pool.evicted == 1 and row[1] not in pool.key_of and row[1] in third and row[0] not in third
    assert pool.lookup(a) == row[:1]
    held = pool.take(0, pool.lookup(a))  # page 0 held again ...
    with pytest.raises(KeyError):  # ... so nothing is left to evict (the ledger never asks for more)
        pool.take(1)
    pool.give(third)
    pool.give(held)
    assert pool.whole() and not any(pool.refs)
    assert len(pool.free) + len(pool.idle) == 8

    # The ledger: a row whose prompt pages are cached is admitted with fewer new pages than it needs
    # in all, and starts after its hit.
    prompts = {0: a, 1: a[:16] + b[:4]}
    ledger = SlotLedger(2, 4, frozenset(), lambda i: 3, prompts.get, PrefixPool(4, P))
    ledger.waiting.extend([0, 1])
    slots, rows = ledger.admit_waiting()
    assert rows == [0] and ledger.starts(slots) == [0]  # 3 of 4 pages: the second waits
    ledger.register(slots)
    ledger.finish(slots[0])
    slots, rows = ledger.admit_waiting()
    assert rows == [1] and ledger.starts(slots) == [16]  # its 16 shared tokens: the first row's two pages
    assert ledger.pages[slots[0]][:2] == ledger.pool.lookup(a) and len(ledger.pages[slots[0]]) == 3
    assert ledger.cached_tokens == 16 and ledger.prompt_tokens == 40
    ledger.finish(slots[0])
    assert ledger.pool.whole()


def test_where_prefix_caching_cannot_work_it_is_off_or_refused():
    from fixtures import model_config

    dense, hybrid = model_config("qwen3", 8, 2), model_config("qwen3_5", 8, 3)
    ring = model_config("gemma4", 8, 3)
    kw = dict(block_size=1, batch_size=2, max_new_tokens=8, max_prompt_len=32, page_size=P, prefill_chunk=16)
    assert BatchEngine(dense, None, kv_pages=16, **kw).prefix_cache
    assert not BatchEngine(dense, None, **kw).prefix_cache  # no pool: off
    assert not BatchEngine(dense, None, kv_pages=16, prefix_cache=False, **kw).prefix_cache
    for config, why in ((hybrid, "recurrent"), (ring, "ring per row")):
        assert not BatchEngine(config, None, kv_pages=16, **kw).prefix_cache
        with pytest.raises(DFlashError, match=f"--prefix-cache on: .*{why}"):
            BatchEngine(config, None, kv_pages=16, prefix_cache=True, **kw)
    with pytest.raises(InputError, match=r"--prefix-cache on needs a page pool \(--kv-pages\)"):
        EngineOptions(prefix_cache="on")
    with pytest.raises(InputError, match="--prefix-cache must be on or off"):
        EngineOptions(prefix_cache="yes", kv_pages=4)


def test_the_servers_default_pool_holds_what_per_row_caches_hold_with_prefix_caching_where_it_works():
    """`python -m infer.serve`'s default KV cache (`infer.serve.model.default_pool`): a pool of batch x
    the pages of a row's whole cache, the memory per-row caches take, so the longest row of every slot
    fits at once; prefix caching on for a dense target, off (and the log says why) for a hybrid's
    states and Gemma 4's rings, whose pool still runs."""
    from argparse import Namespace

    from dflash_jax.engine.scheduler import per_row_pages, row_cache_len
    from infer.serve.model import default_pool, kv_cache_note
    from fixtures import model_config

    assert row_cache_len(100, 128, 16) == 128 + 128 + 32 and row_cache_len(64, 8, 4, tree_budget=32) == 64 + 8 + 33
    assert per_row_pages(8, 100, 128, 16, page_size=16) == 8 * 18 and per_row_pages(3, 64, 8, 4, 32, 8) == 3 * 14
    options = default_pool(EngineOptions(batch_size=3, page_size=P, block_size=4), Namespace(prefix_cache=None), 30, 8)
    assert options.kv_pages == 3 * -(-(32 + 8 + 8) // P) and options.prefix_cache is None
    kw = dict(block_size=1, batch_size=3, max_new_tokens=8, max_prompt_len=30, page_size=P, prefill_chunk=16)
    per_row = BatchEngine(model_config("qwen3", 8, 2), None, **kw)
    assert per_row_pages(3, 30, 8, 1, page_size=P) * P >= 3 * per_row.spec.cache_len > (per_row_pages(
        3, 30, 8, 1, page_size=P) - 3) * P  # the same memory, in whole pages
    pages = per_row_pages(3, 30, 8, 1, page_size=P)
    for family, caching in (("qwen3", "prefix caching on"),
                            ("qwen3_5", "prefix caching off: the target's recurrent (delta-net) layers"),
                            ("gemma4", "prefix caching off: the target's sliding layers keep a ring per row")):
        gen = BatchEngine(model_config(family, 8, 3), None, kv_pages=pages, **kw)
        assert gen.check_prompt([1] * 30) is None  # the longest prompt and max_new_tokens: no wait for pages
        assert gen.pages_needed(30, 8) * 3 <= pages
        note = kv_cache_note(gen, default=True)
        assert note.startswith(f"a page pool of {pages} pages of {P} positions (the default: the memory of 3 per-row "
                               f"caches of {gen.spec.cache_len} positions), ") and caching in note, note
    assert kv_cache_note(per_row, default=False) == (f"per-row caches of {per_row.spec.cache_len} positions x 3 "
                                                     f"slots (--kv-pages 0); no prefix caching")
    refused = kv_cache_note(per_row, default=True, refused="a mesh whose data axis is 1")
    assert "the default page pool was refused: a mesh whose data axis is 1" in refused


def test_shared_prefixes_decode_as_without_the_cache_on_a_small_engine():
    """Everyday: a page pool with and without the cache gives every row the same tokens and
    acceptance lengths (greedy, drafts of a block of 4), later rows' prompts start from pages the
    earlier rows cached, and the pool is whole at the end."""
    from fixtures import setup

    rs = np.random.RandomState(1)
    first, second = rs.randint(0, 8, 12).tolist(), rs.randint(0, 8, 8).tolist()  # 3 and 2 pages of 4
    prompts = [(first if i % 3 else second) + rs.randint(0, 8, n).tolist() for i, n in enumerate((3, 1, 4, 2, 0, 3))]
    prompts[4] = first[:9]
    limits = [8, 3, 6, 8, 2, 5]
    kw = dict(block_size=4, batch_size=2, speculation="fixed", max_new_tokens=8, max_prompt_len=16, page_size=4,
              prefill_chunk=16, kv_pages=16)

    def decode(gen):
        got = {r.index: r for r in gen.generate(prompts, max_new_tokens=limits)}
        return [(got[i].output_ids, got[i].acceptance_lengths) for i in range(len(prompts))]

    without = BatchEngine(*setup("qwen3-v8"), prefix_cache=False, **kw)
    cached = BatchEngine(*setup("qwen3-v8"), prefix_cache=True, **kw)
    want = decode(without)
    assert decode(cached) == want and without.ledger.cached_tokens == 0
    assert max(a for _, acc in want for a in acc) > 1  # drafts were accepted
    assert cached.ledger.cached_tokens >= 12 and cached.prefix_pool.whole()  # a later row hit 3 pages at least
    assert (np.asarray(cached.idle_state.target_cache.pages) >= 16).all()  # no row holds a page on the device


# --------------------------------------------------------------------------- the engine (heavy)

NAME = "qwen3-v128"
LIMITS = (20, 5, 12, 20, 3, 9, 14, 20)
POOL = 16  # pages of 8 positions: a row needs up to 6, so two rows run beside a few idle pages and later rows evict
GREEDY = Sampling(per_row=True)  # a per-row engine (the server's kind): greedy and sampled rows share its programs
SAMPLED = [Sampling(0.9, top_k=20, per_row=True) if i % 2 else GREEDY for i in range(len(LIMITS))]
KW = dict(block_size=4, batch_size=2, speculation="fixed", max_new_tokens=20, max_prompt_len=64, page_size=P, prefill_chunk=16,
          kv_pages=POOL, sampling=GREEDY)


def shared_prompts(vocab: int = 128, seed: int = 0) -> list[list[int]]:
    """Prompts on two prefixes of 40 and 24 tokens (5 and 3 pages), with suffixes of 0 to 20
    tokens; one is a prefix's first 33 tokens alone."""
    rs = np.random.RandomState(seed)
    first, second = rs.randint(0, vocab, 40).tolist(), rs.randint(0, vocab, 24).tolist()
    out = [(first if i % 3 else second) + rs.randint(0, vocab, n).tolist()
           for i, n in enumerate((3, 9, 1, 20, 7, 12, 0, 5))]
    out[6] = first[:33]
    return out


@functools.cache
def engine(prefix_cache: bool, mesh=None) -> BatchEngine:
    from fixtures import setup

    return BatchEngine(*setup(NAME), prefix_cache=prefix_cache, mesh=mesh, **KW)


def decode(gen, samplings, prompts=None, limits=LIMITS):
    """Each prompt's (tokens, acceptance lengths), in order (seed 0, row ids 0..n-1)."""
    prompts = prompts or shared_prompts()
    got = {r.index: r for r in gen.generate(prompts, max_new_tokens=list(limits), sampling=samplings)}
    return [(got[i].output_ids, got[i].acceptance_lengths) for i in range(len(prompts))]


@functools.cache
def reference(sampled: bool):
    """What the engine without the cache gives."""
    return decode(engine(False), SAMPLED if sampled else [GREEDY] * len(LIMITS))


@pytest.mark.heavy
def test_shared_prefixes_decode_as_without_the_cache_and_a_small_pool_evicts():
    """Greedy on a small pool: every row's tokens and acceptance lengths are those of the same
    pool without the cache, most prompt tokens come from the cache, pages are evicted, and the
    pool is whole at the end; the next call starts from what this one cached."""
    gen = engine(True)
    assert decode(gen, [GREEDY] * len(LIMITS)) == reference(False)
    pool, ledger = gen.prefix_pool, gen.ledger
    assert ledger.cached_tokens >= 5 * 24 and pool.evicted > 0
    assert pool.whole() and not any(pool.refs) and len(pool.free) + len(pool.idle) == POOL
    assert (np.asarray(gen.idle_state.target_cache.pages) >= POOL).all()  # no row holds a page on the device
    prompts = shared_prompts()
    i = next(i for i, p in enumerate(prompts) if pool.lookup(p))
    hit = len(pool.lookup(prompts[i])) * P
    assert decode(gen, [GREEDY], [prompts[i]], [LIMITS[i]]) == [reference(False)[i]]
    assert gen.ledger.cached_tokens == hit and gen.prefix_pool is pool and pool.whole()


@pytest.mark.heavy
def test_seeded_sampled_rows_decode_as_without_the_cache():
    gen = engine(True)
    got = decode(gen, SAMPLED)
    assert got == reference(True) and gen.ledger.cached_tokens > 0 and gen.prefix_pool.whole()
    assert any(g != w for g, w in zip(got, reference(False)))  # the sampled rows did sample


@pytest.mark.heavy
def test_the_serving_engine_shares_prefixes_and_compiles_nothing_new():
    """Requests arriving one after another (prompts over 16 tokens go in pieces, from the end of
    their hit), greedy and sampled, stream the tokens generate gives without the cache; the hit
    rate is reported."""
    from dflash_jax.compiling import compiles
    from dflash_jax.engine.step import prefill, prefill_part, run_cycles
    from dflash_jax.engine.streaming import StreamingEngine, StreamRequest
    from fixtures import setup

    want = reference(True)
    gen = BatchEngine(*setup(NAME), **dict(KW, sync_every=1))
    assert gen.prefix_cache
    engine = StreamingEngine(gen, max_waiting=16)
    engine.warmup()
    programs = lambda: (compiles(prefill), compiles(prefill_part), compiles(run_cycles))  # noqa: E731
    warm, got, done = programs(), {}, threading.Event()
    prompts = shared_prompts()

    def emitter(i):
        def emit(tokens, result):
            if result is not None:
                got[i] = result.output_ids
                if len(got) == len(prompts):
                    done.set()
        return emit

    engine.start()
    try:
        for i, p in enumerate(prompts):
            engine.submit(StreamRequest(p, LIMITS[i], emitter(i), SAMPLED[i], row_id=i))
            time.sleep(0.01)
        assert done.wait(300)
        assert [got[i] for i in range(len(prompts))] == [tokens for tokens, _ in want]
        m = engine.metrics
        assert m.prompt_tokens == sum(map(len, prompts)) and m.cached_prompt_tokens >= 4 * 24
        assert m.prefix_hit_rate == m.cached_prompt_tokens / m.prompt_tokens
        assert programs() == warm
    finally:
        assert engine.close(timeout=60)


def mesh_worker(want):
    """(In a subprocess of 2 CPU devices.) Whether the pool with the cache on a data=1, model=2
    mesh gives the tokens `want`, as JSON."""
    from dflash_jax.sharding import make_mesh

    gen = engine(True, make_mesh("data=1,model=2"))
    got = decode(gen, [GREEDY] * len(LIMITS))
    print(json.dumps(dict(equal=[list(map(list, g)) for g in got] == want, cached=gen.ledger.cached_tokens,
                          whole=gen.prefix_pool.whole())))


@pytest.mark.heavy
def test_a_pool_on_a_two_device_mesh_shares_prefixes_as_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    repo = Path(__file__).resolve().parents[1]
    want = json.dumps([list(map(list, r)) for r in reference(False)])
    proc = subprocess.run([sys.executable, __file__, "mesh", want], capture_output=True, text=True, env=env,
                          cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == dict(equal=True, cached=out["cached"], whole=True) and out["cached"] > 0


if __name__ == "__main__" and sys.argv[1:2] == ["mesh"]:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    mesh_worker(json.loads(sys.argv[2]))

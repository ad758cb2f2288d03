"""The TPU attention kernel (dflash_jax.attention.pallas_tpu), run here in Pallas's TPU interpret mode,
held to the portable walk's exactness tests, and compiled through Mosaic for a TPU chip.

- It equals the walk (and dense float64 attention) for every mask kind the engine uses: the
  target's causal decode (1 query) and verify (a block at each row's own offset), the drafter's
  context plus its non-causal block of uncached keys, an arbitrary in-block mask (a tree), sliding
  windows, attention sinks, the scale override, prefill into chosen rows with a padding row; over
  GQA ratios 1/4/8 and head dims 64/128/256; with several query tiles and a query count that
  does not fill the last. (Everyday: GQA 4 at head dim 128 for verify, tree, sinks and rows; the
  other kinds and ratios are -m heavy.)
- It is ragged: each row reads only its own key blocks. Blocks past a row's last visible key (or
  before its window) hold NaN, which a read would spread into the output.
- The engine with the kernel selected decodes the walk's tokens and acceptance lengths (heavy:
  interpret mode takes half a minute).
- Compiled for a v5e chip (libtpu), the kernel is a Mosaic custom call whose cost estimate
  charges the blocks a row holds (the `expected_live` override), not the cache's size.
"""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import attention
from dflash_jax.attention import AttentionMetadata, LayerKV, override, pallas_tpu, walk
from test_attention import call, dense_reference, metadata, small_engine_tokens, stored

LAYERS, PAGE = 2, 8
# everyday: verify, a tree's mask over the drafter's block, sinks, admission rows (windows: the
# ragged-read test); the rest of the matrix is -m heavy
HEAVY_KINDS = ("decode", "window", "drafter", "scale")


def buffers(rs, batch, length, kv, d):
    return (jnp.asarray(rs.randn(LAYERS, batch, length, kv, d), jnp.float32) for _ in range(2))


def both(q, q_pos, k, v, layer, kv_limit, **kw):
    walked = call(walk, q, q_pos, k, v, layer, kv_limit, page_size=PAGE, **kw)
    kernel = call(pallas_tpu, q, q_pos, k, v, layer, kv_limit, page_size=PAGE, **kw)
    return np.asarray(walked), np.asarray(kernel)


def entry(q, pos, k, v, lim, **layout):
    """`attention.attend` on layer 1 of k, v (nothing written), as the engine calls it."""
    return attention.attend(q, None, None, LayerKV(stored(k), stored(v), 1), AttentionMetadata(q_pos=pos, kv_limit=lim, **layout))[0]


@pytest.fixture
def small_blocks(monkeypatch):
    """Key blocks of two pages and query tiles of 16 rows, so small caches span several blocks
    and several tiles."""
    monkeypatch.setattr(pallas_tpu, "BLOCK", 2 * PAGE)
    monkeypatch.setattr(pallas_tpu, "Q_ROWS", 16)


@pytest.mark.parametrize("kv,groups,d", [pytest.param(2, 1, 64, marks=pytest.mark.heavy), (2, 4, 128),
                                          pytest.param(1, 8, 256, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.heavy) if k in HEAVY_KINDS else k
                                  for k in ("decode", "verify", "window", "drafter", "tree", "sinks", "scale", "rows")])
def test_kernel_equals_the_walk(small_blocks, kv, groups, d, kind):
    rs = np.random.RandomState(kv * 100 + groups * 10 + d + len(kind))
    n, length = 3, 8 * PAGE
    t = 1 if kind == "decode" else 5
    offsets = np.array([0, 37, 21])  # ragged rows; one verifies from position 0
    q_pos = offsets[:, None] + np.arange(t)[None, :]
    batch = 4 if kind == "rows" else n
    k, v = buffers(rs, batch, length, kv, d)
    q = jnp.asarray(rs.randn(n, t, kv, groups, d), jnp.float32)
    kv_limit, kw = q_pos + 1, {}
    if kind == "window":
        kw["window"] = 6
    elif kind in ("drafter", "tree"):  # the context below each row's length, and its block's own keys
        kv_limit = np.broadcast_to(offsets[:, None], (n, t))
        mask = np.ones((n, t, t), bool) if kind == "drafter" else rs.rand(n, t, t) < 0.5
        mask[:, :, 0] = True  # every query sees at least one key (row 0 has no context)
        kw["chunk"] = (jnp.asarray(rs.randn(n, t, kv, d), jnp.float32), jnp.asarray(rs.randn(n, t, kv, d), jnp.float32),
                       jnp.asarray(mask))
    elif kind == "sinks":
        kw["sinks"] = jnp.asarray(rs.randn(kv, groups) * 2, jnp.float32)
    elif kind == "scale":
        kw["scale"] = 0.3
    elif kind == "rows":  # prefill into rows 3 and 0; the last query row is padding (row == batch)
        kw["rows"] = jnp.asarray([3, 0, batch])
    walked, kernel = both(q, jnp.asarray(q_pos), k, v, 1, jnp.asarray(kv_limit), **kw)
    rows = slice(0, 2) if kind == "rows" else slice(None)
    assert np.isfinite(kernel[rows]).all()
    np.testing.assert_allclose(kernel[rows], walked[rows], atol=2e-5, rtol=1e-5)
    if kind == "verify":  # and both are attention: dense float64 over the causal mask
        mask = np.arange(length)[None, None, :] <= q_pos[:, :, None]
        np.testing.assert_allclose(kernel, dense_reference(q, np.asarray(k[1]), np.asarray(v[1]), mask), atol=2e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_each_row_reads_only_its_own_blocks(small_blocks, window):
    """NaN in every block past a row's last visible key, and (window) before its first: the walk
    bounds pages over the whole batch, the kernel per row, so the kernel's output stays finite
    where the walk's would not, and equals dense attention over the live keys."""
    rs = np.random.RandomState(11)
    n, t, kv, groups, d, length = 3, 4, 2, 2, 64, 12 * PAGE
    block = 2 * PAGE
    offsets = np.array([3, 70, 30])
    q_pos = offsets[:, None] + np.arange(t)[None, :]
    k, v = (np.array(x) for x in buffers(rs, n, length, kv, d))
    for b in range(n):
        end = -(-(q_pos[b].max() + 1) // block) * block
        k[:, b, end:] = np.nan
        v[:, b, end:] = np.nan
        if window is not None:
            start = max(0, (q_pos[b].min() - window + 1) // block * block)
            k[:, b, :start] = np.nan
            v[:, b, :start] = np.nan
    q = jnp.asarray(rs.randn(n, t, kv, groups, d), jnp.float32)
    out = np.asarray(call(pallas_tpu, q, jnp.asarray(q_pos), jnp.asarray(k), jnp.asarray(v), 0,
                          jnp.asarray(q_pos + 1), window=window, page_size=PAGE))
    assert np.isfinite(out).all()
    key_pos = np.arange(length)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
    expected = dense_reference(q, np.nan_to_num(k[0]), np.nan_to_num(v[0]), mask)
    np.testing.assert_allclose(out, expected, atol=2e-5)


def test_many_query_tiles_with_a_ragged_last_one(small_blocks):
    """A prefill-sized query count: 13 queries x 4 heads per K/V head is four tiles of 16 rows
    (four queries), the last holding one query and padding."""
    rs = np.random.RandomState(5)
    n, t, kv, groups, d = 2, 13, 2, 4, 64
    q_pos = np.array([0, 9])[:, None] + np.arange(t)[None, :]
    k, v = buffers(rs, n, 4 * PAGE, kv, d)
    q = jnp.asarray(rs.randn(n, t, kv, groups, d), jnp.float32)
    walked, kernel = both(q, jnp.asarray(q_pos), k, v, 0, jnp.asarray(q_pos + 1), window=9)
    np.testing.assert_allclose(kernel, walked, atol=2e-5, rtol=1e-5)


@pytest.mark.heavy
def test_engine_on_the_kernel_decodes_as_on_the_walk(monkeypatch):
    """The engine with the kernel selected (interpret mode): prefill, the target's decode and
    verify and the drafter all attend through it, and the tokens and acceptance lengths are the
    walk's."""
    walked = small_engine_tokens()
    calls = []
    attend_ = pallas_tpu.attend

    def kernel(q, cache, meta, **options):
        calls.append("chunk" if meta.has_block else "rows" if meta.rows is not None else "target")
        return attend_(q, cache, meta, **options)

    monkeypatch.setattr(pallas_tpu, "attend", kernel)
    jax.clear_caches()
    with override("pallas"):
        assert small_engine_tokens() == walked
    assert {"chunk", "rows", "target"} <= set(calls), set(calls)


def test_the_kernel_is_the_tpus():
    from dflash_jax.platform import compiling_for

    from dflash_jax.platform import target_platform

    q = jnp.zeros((2, 1, 2, 2, 8))
    cache = LayerKV(jnp.zeros((1, 2, 16, 2 * 8)), jnp.zeros((1, 2, 16, 2 * 8)))
    meta = metadata(jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), jnp.int32))
    assert attention.IMPLEMENTATIONS["pallas"] == pallas_tpu.__name__
    with compiling_for("tpu"):
        assert attention.select(meta, q, cache, target_platform())[0] == "pallas"
    assert attention.select(meta, q, cache, "cpu")[0] == "walk"


@pytest.fixture
def no_compile_cache():
    """A TPU executable has no place in the CPU tests' persistent compilation cache."""
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed: pip install -e '.[tpu]' to compile for TPUs")
def test_compiled_for_a_tpu_its_cost_is_the_blocks_a_row_holds(no_compile_cache):
    """Through Mosaic for one v5e chip: one custom call, and its declared bytes are the K/V of the
    blocks `expected_live` positions fill (+ queries and output), whatever the cache's length."""
    from dflash_jax.aot import topology
    from dflash_jax.platform import compiling_for
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(topology("v5e:1x1").devices).reshape(1), ("x",))
    n, t, kv, groups, d = 4, 16, 2, 4, 128

    def declared(cache_len, live):
        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

        args = (sds((n, t, kv, groups, d), jnp.bfloat16), sds((n, t), jnp.int32),
                sds((2, n, cache_len, kv * d), jnp.bfloat16), sds((2, n, cache_len, kv * d), jnp.bfloat16),
                sds((n, t), jnp.int32))
        with compiling_for("tpu"), override("pallas", expected_live=live):
            hlo = jax.jit(lambda *a: entry(*a)).trace(*args).lower().compile().as_text()
        calls = re.findall(r'custom_call_target="tpu_custom_call"', hlo)
        assert len(calls) == 1, len(calls)
        return int(re.search(r'"bytes_accessed":"(\d+)"', hlo).group(1))

    kv_bytes = lambda keys: 2 * n * keys * kv * d * 2  # noqa: E731  K and V, bfloat16
    rest = n * t * kv * groups * d * (2 + 2)  # queries in, output out (bfloat16, as the queries)
    assert declared(1024, 512) == kv_bytes(512) + rest
    assert declared(8192, 512) == kv_bytes(512) + rest  # the cache's size is not charged
    assert declared(8192, 1000) == kv_bytes(1024) + rest  # whole blocks


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed: pip install -e '.[tpu]' to compile for TPUs")
def test_wide_heads_fit_the_scoped_vmem(no_compile_cache):
    """Gemma 4's global layers (4 K/V heads of 512, 8 queries each) verifying 16 tokens over an
    8192-position cache compile for a v5e chip: blocks and query tiles are sized to the 16 MiB of
    scoped VMEM (a block's positions are the cache's rows of 4 x 512 values)."""
    from dflash_jax.aot import topology
    from dflash_jax.platform import compiling_for
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(topology("v5e:1x1").devices).reshape(1), ("x",))
    n, t, kv, groups, d, cache_len = 8, 16, 4, 8, 512, 8192

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    args = (sds((n, t, kv, groups, d), jnp.bfloat16), sds((n, t), jnp.int32),
            sds((2, n, cache_len, kv * d), jnp.bfloat16), sds((2, n, cache_len, kv * d), jnp.bfloat16),
            sds((n, t), jnp.int32))
    with compiling_for("tpu"):
        hlo = jax.jit(lambda *a: entry(*a)).trace(*args).lower().compile().as_text()
    assert 'custom_call_target="tpu_custom_call"' in hlo


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed: pip install -e '.[tpu]' to compile for TPUs")
@pytest.mark.parametrize("layout", ["pool", "ring"])
def test_a_pool_and_a_ring_compile_for_a_tpu(no_compile_cache, layout):
    """Through Mosaic for one v5e chip: the kernel over a page pool (the page found through the
    row's table in the index map) and over a sliding window's ring (the block taken modulo the
    ring); with rows of 8192 positions declared, a pool's bytes are the row's pages and a ring's at
    most the ring (its window of 512 in blocks of 512), not the row."""
    from dflash_jax.aot import topology
    from dflash_jax.platform import compiling_for
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(topology("v5e:1x1").devices).reshape(1), ("x",))
    n, t, kv, groups, d, page = 4, 16, 2, 4, 128, 128

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    q = (sds((n, t, kv, groups, d), jnp.bfloat16), sds((n, t), jnp.int32))
    if layout == "pool":
        cache = (sds((2, 40, page, kv * d), jnp.bfloat16),) * 2
        run = lambda q, pos, k, v, lim, pages: entry(q, pos, k, v, lim, pages=pages)  # noqa: E731
        extra = (sds((n, 16), jnp.int32),)
    else:
        cache = (sds((2, n, 1024, kv * d), jnp.bfloat16),) * 2
        run = lambda q, pos, k, v, lim: entry(q, pos, k, v, lim, window=512, ring=True)  # noqa: E731
        extra = ()
    with compiling_for("tpu"), override("pallas", expected_live=8192):
        hlo = jax.jit(run).trace(*q, *cache, sds((n, t), jnp.int32), *extra).lower().compile().as_text()
    assert len(re.findall(r'custom_call_target="tpu_custom_call"', hlo)) == 1
    declared = int(re.search(r'"bytes_accessed":"(\d+)"', hlo).group(1))
    keys = 16 * page if layout == "pool" else 1024  # the pool: a row's 16 pages; the ring: all of it
    assert declared == 2 * n * keys * kv * d * 2 + n * t * kv * groups * d * 4  # + queries in, output out


MESH_CHECK = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dflash_jax.attention import AttentionMetadata, LayerKV, override, selection, walk
from jax.sharding import AxisType
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)  # as the engine's mesh
rs = np.random.RandomState(0)
n, t, kv, g, d, length = 4, 3, 4, 2, 64, 64
q_pos = np.array([0, 17, 40, 9])[:, None] + np.arange(t)[None, :]
k, v = (rs.randn(2, n, length, kv * d).astype(np.float32) for _ in range(2))  # a position's heads one row
q = rs.randn(n, t, kv, g, d).astype(np.float32)
chunk = (rs.randn(n, t, kv, d).astype(np.float32), rs.randn(n, t, kv, d).astype(np.float32), rs.rand(n, t, t) < 0.6)
sinks = rs.randn(kv, g).astype(np.float32)
put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
args = (put(q, P("data", None, "model")), put(q_pos, P("data")), put(k, P(None, "data", None, "model")),
        put(v, P(None, "data", None, "model")), put(q_pos + 1, P("data")))
for kw in (dict(), dict(window=5, sinks=jnp.asarray(sinks)), dict(chunk=tuple(jnp.asarray(c) for c in chunk)),
           dict(rows=jnp.asarray([1, 0, 3, 2]))):
    def meta(pos, lim, kw=kw):
        kw = dict(kw)
        if "chunk" in kw:
            ck, cv, cm = kw.pop("chunk")
            kw.update(block_k=ck, block_v=cv, block_mask=cm, mask="block")
        return AttentionMetadata(q_pos=pos, kv_limit=lim, page_size=8, **kw)
    @jax.jit
    def run(*a):  # as the engine traces: the TPU's selection (admission rows over `data`: the walk)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), override("pallas"):
            return selection.run(a[0], LayerKV(a[2], a[3], 1), meta(a[1], a[4]), "tpu")
    got = np.asarray(run(*args))
    want = np.asarray(walk.attend(jnp.asarray(q), LayerKV(jnp.asarray(k), jnp.asarray(v), 1),
                                  meta(jnp.asarray(q_pos), jnp.asarray(q_pos + 1))))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    print("ok", sorted(kw))
# A latent cache (MLA: two parts, no head axis, one K/V head): whole on each device, the 8 query heads split
lat_k, lat_v = rs.randn(2, n, length, 48).astype(np.float32), rs.randn(2, n, length, 16).astype(np.float32)
q1 = rs.randn(n, t, 1, 8, d).astype(np.float32)
lat_meta = lambda pos, lim: AttentionMetadata(q_pos=pos, kv_limit=lim, page_size=8, latent=True)
@jax.jit
def run_latent(q1, pos, lk, lv, lim):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), override("pallas"):
        return selection.run(q1, LayerKV(lk, lv, 1), lat_meta(pos, lim), "tpu")
got = np.asarray(run_latent(put(q1, P("data")), put(q_pos, P("data")), put(lat_k, P(None, "data")),
                            put(lat_v, P(None, "data")), put(q_pos + 1, P("data"))))
want = np.asarray(walk.attend(jnp.asarray(q1), LayerKV(jnp.asarray(lat_k), jnp.asarray(lat_v), 1),
                              lat_meta(jnp.asarray(q_pos), jnp.asarray(q_pos + 1))))
np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
print("ok latent")
"""


@pytest.mark.heavy
def test_on_a_mesh_the_kernel_runs_per_device():
    """On 8 CPU devices (data=2, model=4), traced under the mesh as the engine traces: the kernel
    in a shard_map (heads over model, rows over data) equals the walk on one device, for the
    target's verify, a window with sinks, the drafter's block, and admission rows (the walk); and
    over a latent cache, its query heads split over model."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", MESH_CHECK], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count("ok") == 5, p.stdout


@pytest.mark.parametrize("kind", ["verify", "tree"])
def test_a_latent_cache_kernel_equals_the_walk_and_dense_attention(small_blocks, kind):
    """A latent cache (MLA): one K/V head whose keys are 40 dimensions stored as two parts without a
    head axis, 32 in k (the values too) and 8 in v; 8 query heads. The kernel and the walk read the
    values out of the keys, and both equal dense attention over the joined keys and their first 32
    dimensions (with a tree's block keys for "tree")."""
    rs = np.random.RandomState(len(kind))
    n, t, groups, d, dv, length = 3, 5, 8, 40, 32, 8 * PAGE
    offsets = np.array([0, 37, 21])
    q_pos = offsets[:, None] + np.arange(t)[None, :]
    latent = rs.randn(LAYERS, n, length, d).astype(np.float32)
    k, v = jnp.asarray(latent[..., :dv]), jnp.asarray(latent[..., dv:])
    q = jnp.asarray(rs.randn(n, t, 1, groups, d), jnp.float32)
    kw, kv_limit = dict(latent=True, scale=0.2), q_pos + 1
    if kind == "tree":
        kv_limit = np.broadcast_to(offsets[:, None], (n, t))
        mask = rs.rand(n, t, t) < 0.5
        mask[:, :, 0] = True
        ck = jnp.asarray(rs.randn(n, t, 1, d), jnp.float32)
        kw["chunk"] = (ck, ck[..., :dv], jnp.asarray(mask))  # as `attend` sets a latent's block keys
    walked, kernel = both(q, jnp.asarray(q_pos), k, v, 1, jnp.asarray(kv_limit), **kw)
    assert kernel.shape == (n, t, groups * dv) and np.isfinite(kernel).all()
    np.testing.assert_allclose(kernel, walked, atol=2e-5, rtol=1e-5)
    keys, visible = latent[1][:, :, None], np.arange(length)[None, None, :] < np.asarray(kv_limit)[:, :, None]
    if kind == "tree":
        keys, visible = np.concatenate([keys, np.asarray(ck)], 1), np.concatenate([visible, mask], -1)
    want = dense_reference(np.asarray(q) * 0.2 * np.sqrt(d), keys, keys[..., :dv], visible)
    np.testing.assert_allclose(kernel, want, atol=2e-5)

"""The KV cache type and its init: the target's (`init_cache`: K/V per attention layer, Gemma 4's
global group, a hybrid's recurrent states) and the drafter's context cache (`init_context_cache`:
the K/V of the target's tap features, which serve every block drafted after them).

Rollback is a length update: entries at or past a row's length are stale, and the causal limit
(key position <= query position, with every position below the query written in this or an
earlier call) guarantees they are never read. Layouts: `dflash_jax.kv.layout`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.config import ModelConfig, jnp_dtype
from dflash_jax.kv.layout import NO_PAGE, PAGE_SIZE, Kind, cache_layout, ring_length, window_ring_length
from dflash_jax.kv.writes import read_kv, write_kv

if TYPE_CHECKING:
    from dflash_jax.drafter import DrafterConfig

# Logical axes (`dflash_jax.sharding`'s names) of a K/V buffer but its last, a position's row: a dense
# one's K/V heads (split by whole heads: `KVCache.logical_axes`), a latent's one latent (not split).
CACHE_AXES = ("layers", "batch", "length")  # each row its own positions (or ring)
POOL_AXES = ("layers", None, None)  # a page pool: rows share pages, so neither splits


def _kv(group: str, kind: Kind | None = None, **kw):
    """A K/V buffer field, positions written and read through the layout of its group ("main" or
    "global", `KVCache.layout`); kind None: the cache's (`KVCache.kind`)."""
    return struct.field(metadata={"group": group, "kind": kind}, **kw)


def _per_row(*axes: str | None, **kw):
    """A field of arrays (or a tuple of them, each) with these logical axes."""
    return struct.field(metadata={"axes": axes}, **kw)


@struct.dataclass
class KVCache:
    """Static-shape paged KV cache with a length per row.

    k, v:    [attention layers, batch, max_len, heads * head_dim], max_len a whole number of pages,
             a position's K/V heads one row (`dflash_jax.kv.layout`: why no head axis).
             A latent cache (multi-head latent attention, `ModelConfig.mla`): each position's latent in
             two parts, k [layers, batch, max_len, kv_lora_rank] (the values too) and v [..,
             qk_rope_head_dim] (the rotated keys), `AttentionMetadata.latent`, read as one K/V head; two
             parts, so the wide one is a whole number of 128 lanes and keeps one layout everywhere (576
             lanes would not: the compiler stores such a buffer positions-minor between programs and
             relays it out around every call)
    k_global, v_global: the same for the full-attention layers with their own head_dim and KV
             heads (Gemma 4's global layers), None when there are none. A layer that shares
             another's K/V has no slot of its own.
    lengths: [batch] int32, number of valid (committed) positions of each row.
    state:   per linear layer [batch, v_heads, k_dim, v_dim] float32, the gated delta-net
             layers' recurrent states (None when the decoder has none). Separate arrays, not one
             stacked buffer: a step rewrites each whole, and an update of one slice of a stacked
             buffer that reads the same slice is copied whole by XLA.
    tail:    per linear layer [batch, conv_kernel - 1, conv_dim], their convolutions' last inputs.
    index_k: DeepSeek sparse attention (GLM-5): the indexer's key of each position, per indexer layer,
             laid out as a latent k [indexer layers, batch or pages, positions, indexer head_dim]; None without.
    pages:   None (each row owns max_len positions of the buffers), or a page pool's table
             [batch, pages per row] int32: k, v (and k_global, v_global) are then
             [layers, num_pages, page_size, heads * head_dim], one pool of pages shared by
             every row, and row b's page j is page pages[b, j] (an entry past the pool, as
             NO_PAGE: none; see `dflash_jax.kv.layout`).
    ring:    (static) with a pool, k and v (the main group) are rings of the last k.shape[2]
             positions of each row, [layers, batch, ring, heads * head_dim], position p at p % ring:
             the group's layers all slide (`ModelConfig.local_window`), so the pages behind the
             window are written over instead of held (see `dflash_jax.kv.layout`).
    page_size: positions per page (static), the unit attention walks in.
    window:  (static) the drafter's context cache under a draft window (`--draft-window N`): a block
             sees only the last N positions before its anchor, and k, v are a ring of those (plus a
             write's worth) per row, not paged, where that is shorter than the row
             (`init_context_cache`). None: every committed position.
    kind:    (static) "dense" or "latent" (k, v a latent's two parts, `ModelConfig.mla`), as
             `init_cache` makes it. index_k is always latent, k_global and v_global always dense.
    heads, global_heads: (static) K/V heads in a dense row of the main and the global group (so
             that a row splits over devices by whole heads); 1 where unknown (never split).

    Each array field declares itself: a K/V buffer its group and kind (`_kv`), any other its
    logical axes (`_per_row`). From that alone the cache gives each field's logical axes
    (`logical_axes`: its sharding, and which axis is the rows), maps a function over its arrays
    (`map_arrays`), and tells `write_kv` / `read_kv` how to reach a buffer (`kv_args`); a new field
    is declared here and nowhere else.
    """

    k: jax.Array = _kv("main")
    v: jax.Array = _kv("main")
    lengths: jax.Array = _per_row("batch")
    k_global: jax.Array | None = _kv("global", "dense", default=None)
    v_global: jax.Array | None = _kv("global", "dense", default=None)
    state: tuple[jax.Array, ...] | None = _per_row("batch", "heads", "head_dim", "head_dim", default=None)
    tail: tuple[jax.Array, ...] | None = _per_row("batch", "length", None, default=None)
    index_k: jax.Array | None = _kv("main", "latent", default=None)
    pages: jax.Array | None = _per_row("batch", None, default=None)
    ring: bool = struct.field(pytree_node=False, default=False)
    page_size: int = struct.field(pytree_node=False, default=PAGE_SIZE)
    window: int | None = struct.field(pytree_node=False, default=None)
    kind: Kind = struct.field(pytree_node=False, default="dense")
    heads: int = struct.field(pytree_node=False, default=1)
    global_heads: int = struct.field(pytree_node=False, default=1)

    @property
    def max_len(self) -> int:
        """Positions a row can hold."""
        return self.k.shape[2] if self.pages is None else self.pages.shape[1] * self.page_size

    def layout(self, global_group: bool) -> tuple[jax.Array | None, bool]:
        """(page table or None, ring) of a K/V group: the main one or Gemma 4's global one."""
        if global_group:
            return self.pages, False
        return (None, True) if self.ring else (self.pages, False)

    def kv_names(self) -> tuple[str, ...]:
        """The K/V buffers present (every field that positions are written into)."""
        return tuple(f.name for f in _FIELDS if "group" in f.metadata and getattr(self, f.name) is not None)

    def kind_of(self, name: str) -> Kind:
        """The kind of K/V buffer `name`."""
        return _FIELD[name].metadata["kind"] or self.kind

    def kv_args(self, name: str) -> dict[str, Any]:
        """How `write_kv` / `read_kv` reach K/V buffer `name`: its group's page table and ring."""
        pages, ring = self.layout(_FIELD[name].metadata["group"] == "global")
        return dict(pages=pages, ring=ring)

    def heads_of(self, name: str) -> int:
        """K/V heads in a row of buffer `name` (a latent's: 1)."""
        if self.kind_of(name) == "latent":
            return 1
        return self.global_heads if _FIELD[name].metadata["group"] == "global" else self.heads

    def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Each array field present -> the logical axes of its dimensions (`dflash_jax.sharding`'s
        names; a tuple field: of each of its arrays). A K/V buffer's follow its group's layout: per
        row (a ring too) `CACHE_AXES`, a pool's pages `POOL_AXES`, then its row: a dense one's
        ("kv_heads", its heads), split by whole heads; a latent's not at all."""
        out = {}
        for f in _FIELDS:
            if getattr(self, f.name) is None:
                continue
            if "group" in f.metadata:
                pages, _ = self.layout(f.metadata["group"] == "global")
                axes = CACHE_AXES if pages is None else POOL_AXES
                row = None if self.kind_of(f.name) == "latent" else ("kv_heads", self.heads_of(f.name))
                out[f.name] = (*axes, row)
            else:
                out[f.name] = f.metadata["axes"]
        return out

    def map_arrays(self, f: Callable[[Any, tuple[str | None, ...]], Any]) -> "KVCache":
        """f(array, logical axes) over every array of the cache (each of a tuple field's), as `logical_axes` gives them."""
        out = {}
        for name, axes in self.logical_axes().items():
            value = getattr(self, name)
            out[name] = tuple(f(a, axes) for a in value) if isinstance(value, tuple) else f(value, axes)
        return self.replace(**out)

    def assign_pages(self, rows, table) -> "KVCache":
        """Rows `rows` [n] (out of range: ignored) take the page table rows `table` [n, pages
        per row] (a pool only)."""
        return self.replace(pages=self.pages.at[rows].set(table, mode="drop"))

    def release_pages(self, rows_done) -> "KVCache":
        """Rows where rows_done [batch] lose their pages (their writes are dropped from now on:
        the host hands the pages to other rows). A no-op without a pool."""
        if self.pages is None:
            return self
        return self.replace(pages=jnp.where(rows_done[:, None], NO_PAGE, self.pages))

    def compact(self, starts, nodes) -> "KVCache":
        """Move each row's accepted tree path into place: the K/V at positions starts + nodes[:, j]
        (nodes [batch, J], a tree verify's node numbers, written from starts [batch]) go to
        starts + j, in every layer of both groups, through the page table or the ring. Positions
        past the accepted path get whatever the padding nodes point at (past the row's length:
        never read). Lengths are the caller's."""
        src = starts[:, None] + nodes
        out = {}
        for name in self.kv_names():
            buf, args = getattr(self, name), self.kv_args(name)
            out[name] = write_kv(buf, None, read_kv(buf, None, src, **args), starts, **args)  # rows as stored
        return self.replace(**out)

    def reset_rows(self, rows) -> "KVCache":
        """Rows `rows` [n] (out of range: ignored) emptied for a new sequence: length 0 and,
        in a hybrid decoder, zero recurrent state and tail."""
        out = self.replace(lengths=self.lengths.at[rows].set(0, mode="drop"))
        if self.state is not None:
            zero = lambda arrays: tuple(a.at[rows].set(0, mode="drop") for a in arrays)
            out = out.replace(state=zero(self.state), tail=zero(self.tail))
        return out


def _array_fields() -> tuple[dataclasses.Field, ...]:
    """KVCache's array fields, each declared with `_kv` or `_per_row` (checked at import)."""
    fields = tuple(f for f in dataclasses.fields(KVCache) if f.metadata.get("pytree_node", True))
    for f in fields:
        if "group" not in f.metadata and "axes" not in f.metadata:
            raise TypeError(f"KVCache.{f.name} declares neither a K/V group (_kv) nor logical axes (_per_row)")
    return fields


_FIELDS = _array_fields()
_FIELD = {f.name: f for f in _FIELDS}


def row_lengths(cache: KVCache, rows):
    """lengths of cache rows `rows` [n]; 0 for padding rows (out of range)."""
    return jnp.where(rows < cache.lengths.shape[0], jnp.take(cache.lengths, rows, mode="clip"), 0)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None, page_size: int = PAGE_SIZE,
               num_pages: int | None = None, ring_chunk: int | None = None) -> KVCache:
    """An empty cache for at least max_len positions per row (rounded up to whole pages); with
    num_pages, a pool of that many pages shared by the rows, every row without a page yet, and
    (ring_chunk: the most positions a call writes) the main group a ring of its window per row
    where its layers all slide."""
    dtype = dtype or jnp_dtype(config.dtype)
    dims, pages = cache_layout(batch, max_len, page_size, num_pages)
    ring = ring_length(config, max_len, page_size, ring_chunk) if num_pages is not None else None
    heads, head_dim = config.cache_shape()
    shape = (config.num_kv_slots(False), *((batch, ring) if ring else dims), heads * head_dim)
    k_global = v_global = None
    global_heads = 1
    if config.num_kv_slots(True):
        global_heads, global_dim = config.cache_shape(True)
        global_shape = (config.num_kv_slots(True), *dims, global_heads * global_dim)
        k_global, v_global = jnp.zeros(global_shape, dtype), jnp.zeros(global_shape, dtype)
    state = tail = None
    if config.num_linear_layers:
        lin, n = config.linear_attention, config.num_linear_layers
        state = tuple(jnp.zeros((batch, lin.v_heads, lin.k_dim, lin.v_dim), jnp.float32) for _ in range(n))
        tail = tuple(jnp.zeros((batch, lin.conv_kernel - 1, lin.conv_dim), dtype) for _ in range(n))
    k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if config.mla is not None:  # a latent in two parts, no head axis
        m = config.mla
        k, v = (jnp.zeros((*shape[:3], width), dtype) for width in (m.kv_lora_rank, m.qk_rope_head_dim))
    index_k = None
    if config.mla is not None and config.mla.indexer is not None:
        ix = config.mla.indexer
        index_k = jnp.zeros((ix.num_slots(config.num_hidden_layers), *shape[1:3], ix.head_dim), dtype)
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32),
                   k_global=k_global, v_global=v_global, state=state, tail=tail, index_k=index_k, pages=pages,
                   ring=ring is not None, page_size=page_size, kind="dense" if config.mla is None else "latent",
                   heads=heads, global_heads=global_heads)


def init_context_cache(config: "DrafterConfig", batch: int, max_len: int, dtype=None,
                       page_size: int = PAGE_SIZE, num_pages: int | None = None, window: int | None = None,
                       ring_chunk: int | None = None) -> KVCache:
    """An empty context cache for at least max_len positions per row (whole pages); with
    num_pages, a pool of pages (the target's page table serves it: position p of a row sits in
    the same page of both pools). With a draft window (window: N, the positions a block sees;
    ring_chunk: the most positions a call writes), a ring of N + ring_chunk positions (whole pages)
    per row instead, pool or not, where that is shorter than the row: its memory stops growing with
    the context."""
    c = config.model
    dtype = dtype or jnp_dtype(c.dtype)
    dims, pages = cache_layout(batch, max_len, page_size, num_pages)
    keep = window
    if window is not None and c.sliding_windows and all(c.sliding_windows):  # every layer's own window is
        keep = min(window, max(c.sliding_windows) - 1)  # narrower still: a query at p sees keys > p - w
    ring = window_ring_length(keep, max_len, page_size, ring_chunk)
    if ring is not None:
        dims, pages = (batch, ring), None
    shape = (c.num_hidden_layers, *dims, c.num_key_value_heads * c.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32),
                   pages=pages, page_size=page_size, ring=ring is not None, window=window,
                   heads=c.num_key_value_heads)

"""The layout of a KV cache: pages, the page table's "no page", allocated lengths, rings.

A cache buffer is `[layers, batch, max_len, kv_heads * head_dim]`, one buffer for every layer,
with a length per row kept beside it: a position's K/V heads are one row (`merge_heads`;
`split_heads` gives the heads back). Not a head axis of its own: a TPU tiles an array's last two
axes by (8 or 16, 128), so [kv_heads, head_dim] tiles pad fewer than 8 heads to 8 (16 in bfloat16)
and a head_dim below 128 to 128, and where they would, the compiler stores the buffer
positions-minor between programs and copies it into the attention kernel's layout around every
call (gpt-oss-120b's 8 heads of 64: its pool copied in and out of every program). A row of
whole heads is a multiple of 128 lanes for every target in `dflash_jax.shapes`, and the kernel slices its heads
from it statically. `max_len` is a whole number of pages of `PAGE_SIZE`
positions (a cache shorter than one page is one page). A row's positions are contiguous, so page
j of row b is `buf[layer, b, j*P:(j+1)*P]`.

Page pool. With a page table (`pages` [batch, pages per row] int32) the buffers are one pool of
pages shared by every row, `[layers, num_pages, page_size, kv_heads * head_dim]`, and page j of
row b is `buf[layer, pages[b, j]]`: rows of different lengths hold only the pages they were given
(`dflash_jax.kv.pool` hands them out and takes them back). An entry of `num_pages` or more
(`NO_PAGE`) is no page: writes to it are dropped and reads of it are masked (they are past the
row's length).

Rings. A group whose layers all slide (Gemma 4's sliding layers, with a page pool) can keep, per
row, only the last `ring` positions: position p lives at `p % ring`, so the pages behind the
window are written over by new ones and the group's memory is its window's, not the row's length.
A ring holds at least the window plus the longest chunk written at once, so no key a query can see
is overwritten before the query reads it. The drafter's context cache is such a ring under a draft
window (`--draft-window N`: a block sees only its row's last N committed positions), paged pool or
not, since no page of it outlives the window.

Kinds. A buffer is "dense" (the layout above: `KVCache.heads` K/V heads a row) or "latent"
(multi-head latent attention's: one latent a position, `[layers, batch or pages, positions, dim]`,
read as a single K/V head). A cache says which (`KVCache.kind`); its sharding follows (a dense row
splits over `model` by whole heads, a latent one not at all).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

from dflash_jax.config import ModelConfig

PAGE_SIZE = 128
NO_PAGE = 1 << 30  # a page table's entry for no page (any entry past the pool is none)

Kind = Literal["dense", "latent"]  # a row of K/V heads, or a latent (one K/V head)


def merge_heads(x):
    """[..., kv_heads, head_dim] -> [..., kv_heads * head_dim]: positions as a cache buffer stores them."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def split_heads(x, kv_heads: int):
    """[..., kv_heads * head_dim] -> [..., kv_heads, head_dim] (`merge_heads` undone)."""
    return x.reshape(*x.shape[:-1], kv_heads, x.shape[-1] // kv_heads)


def cache_length(max_len: int, page_size: int = PAGE_SIZE) -> int:
    """The allocated length for at least `max_len` positions: whole pages (or one short page)."""
    if max_len <= page_size:
        return max(1, max_len)
    return -(-max_len // page_size) * page_size


def page_size_of(max_len: int, page_size: int = PAGE_SIZE) -> int:
    return min(page_size, max_len)



def cache_layout(batch: int, max_len: int, page_size: int, num_pages: int | None):
    """(the [batch-or-pages, positions] dims of a cache buffer, its page table or None)."""
    if num_pages is None:
        return (batch, cache_length(max_len, page_size)), None
    per_row = -(-max_len // page_size)
    return (num_pages, page_size), jnp.full((batch, per_row), NO_PAGE, jnp.int32)


def ring_length(config: ModelConfig, max_len: int, page_size: int, chunk: int | None) -> int | None:
    """Positions of a ring for the main K/V group (whole pages holding its window plus `chunk`, the
    most positions written at once), or None where its layers do not all slide or a ring would be
    no shorter than the row."""
    return window_ring_length(config.local_window(), max_len, page_size, chunk)


def window_ring_length(window: int | None, max_len: int, page_size: int, chunk: int | None) -> int | None:
    """Positions of a ring that keeps a row's last `window` positions while `chunk` more are written
    at once (whole pages), or None without a window or chunk, or where it would be no shorter than
    the row. The drafter's context under `--draft-window` too (`init_context_cache`)."""
    if window is None or chunk is None:
        return None
    ring = -(-(window + chunk) // page_size) * page_size
    return ring if ring < -(-max_len // page_size) * page_size else None

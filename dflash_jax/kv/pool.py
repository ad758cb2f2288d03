"""The host's side of a page pool: which pages are free (`PagePool`), how many pages a row holds
(`pages_needed`), and the page-table rows that hand a row's pages to the device (`page_table`).

The device's side is the table in `KVCache.pages` (`dflash_jax.kv.layout` says how it is read);
the host hands pages out at admission, a row holds what it can ever need, and gives them back when
it finishes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dflash_jax.kv.layout import NO_PAGE


class PagePool:
    """The host's ledger of a page pool: which pages are free."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first

    @property
    def available(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[len(self.free) - n:][::-1], self.free[:len(self.free) - n]
        return taken

    def give(self, pages: Sequence[int]):
        self.free.extend(reversed(pages))


def pages_needed(prompt_len: int, max_new: int, *, drafts: int, cache_len: int, page_size: int) -> int:
    """Pages a row holds in the pool: every position it can write. Its cache holds prompt_len +
    num_generated - 1 positions, and its last cycle starts at num_generated <= max_new and writes
    the `drafts` + 1 verified tokens from there: positions below prompt_len + max_new + drafts (the
    drafter's context, never longer, writes no further), and never past the row's cache_len."""
    return -(-min(cache_len, prompt_len + max_new + drafts) // page_size)


def page_table(pages: Sequence[Sequence[int] | None], rows: int, per_row: int) -> np.ndarray:
    """The page table [rows, per_row] int32 of rows about to be written: row j holds pages[j]
    (its first pages in order), every other entry (rows past len(pages), a None) NO_PAGE."""
    table = np.full((rows, per_row), NO_PAGE, np.int32)
    for j, row in enumerate(pages):
        if row is not None:
            table[j, :len(row)] = row
    return table

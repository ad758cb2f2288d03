"""Prefix caching over a page pool: the full pages of prompts kept and shared by later prompts that
start with the same tokens (`PrefixPool`, the host's ledger).

A page holding positions [j*P, (j+1)*P) of a prompt is keyed by a hash chain: page j's key is
hash(key of page j-1, the page's P tokens), so a key names the page's tokens and every token before
them. Once a row's whole prompt is in, its full prompt pages are registered under their keys; they
never change afterwards (a row writes only at positions >= its prompt's length). A later prompt
looks its pages up in order and holds the hits instead of prefilling them: the target's K/V and the
drafter's context K/V of a position depend only on the tokens up to it, and both caches share the
page table. A hit always leaves at least one prompt token to run (its logits give the first token).

Pages are reference-counted: each row holding a page (+1). A cached page no row holds stays cached
(idle, evictable) until the pool runs short of free pages; then the least recently used idle pages
are evicted (forgotten, free). `available` counts free and idle pages. A row's pages go back last
page first, so a prompt's deeper pages are evicted before the pages they extend.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from dflash_jax.kv.pool import PagePool


def page_keys(tokens: Sequence[int], pages: int, page_size: int) -> list[bytes]:
    """The hash-chain keys of the first `pages` full pages of tokens."""
    keys, key = [], b""
    for j in range(pages):
        chunk = np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int64).tobytes()
        key = hashlib.blake2b(key + chunk, digest_size=16).digest()
        keys.append(key)
    return keys


class PrefixPool(PagePool):
    """A `PagePool` that keeps registered prompt pages for later prompts (see the module's doc).

    refs[p]: rows holding page p. index: key -> cached page; key_of: cached page -> its key.
    idle: cached pages no row holds, least recently used first. evicted: how many were evicted."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages)
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self.index: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evicted = 0  # pages evicted so far

    @property
    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The cached pages that start this prompt, in order, leaving at least its last token out."""
        hits = []
        for key in page_keys(tokens, (len(tokens) - 1) // self.page_size, self.page_size):
            page = self.index.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def cost(self, n: int, hits: Sequence[int]) -> int:
        """Of `available`, what a row needing n new pages besides hits uses up: the n, and the
        hits no row holds now (idle pages that leave `available` once held)."""
        return n + sum(p in self.idle for p in hits)

    def take(self, n: int, hits: Sequence[int] = ()) -> list[int]:
        """A row's pages: the hits (held once more) then n new ones (free, or idle evicted, least
        recently used first)."""
        for p in hits:
            self.idle.pop(p, None)
            self.refs[p] += 1
        while len(self.free) < n:
            page, _ = self.idle.popitem(last=False)
            del self.index[self.key_of.pop(page)]
            self.free.append(page)
            self.evicted += 1
        fresh = super().take(n)
        for p in fresh:
            self.refs[p] = 1
        return list(hits) + fresh

    def give(self, pages: Sequence[int]):
        """A row's pages back (last first): a page no row holds any more goes idle if cached, else free."""
        freed = []
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p]:
                continue
            if p in self.key_of:
                self.idle[p] = None
            else:
                freed.append(p)
        super().give(freed[::-1])

    def register(self, tokens: Sequence[int], pages: Sequence[int]):
        """A row's prompt is in: its full prompt pages (its first pages, in order) are cached under
        their keys. A key cached already (the same prefix in another row admitted beside this one)
        keeps its page; this row's copy stays its own."""
        for key, page in zip(page_keys(tokens, len(tokens) // self.page_size, self.page_size), pages):
            if key not in self.index and page not in self.key_of:
                self.index[key], self.key_of[page] = page, key

    def whole(self) -> bool:
        """No row holds a page: every page is free or idle."""
        return not any(self.refs) and len(self.free) + len(self.idle) == self.num_pages

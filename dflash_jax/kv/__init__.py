"""The KV cache's one home.

- `layout`: pages (`PAGE_SIZE`), the page table's `NO_PAGE`, allocated lengths, rings, a buffer's
  kind (dense, or a latent), a position's K/V heads stored as one row (`merge_heads`, `split_heads`);
- `cache`: the `KVCache` type and its init, for the target (`init_cache`) and the drafter's
  context (`init_context_cache`). The type describes itself: each array field declares its K/V
  group and kind or its logical axes, so the cache gives every array's axes (`logical_axes`: the
  sharding and the rows' axis), maps a function over its arrays (`map_arrays`) and says how a
  buffer is reached (`kv_args`); a new field is declared there alone;
- `writes`: `write_kv`, new keys/values into per-row slots, a page pool or a ring, in place, and
  `read_kv`, the gather of chosen positions from any of them;
- `pool`: the host's side of a page pool: free pages (`PagePool`), a row's pages (`pages_needed`)
  and the page-table rows handed to the device (`page_table`);
- `prefix`: prefix caching over the pool (`PrefixPool`: prompt pages kept under a hash chain of
  their tokens, shared by later prompts, reference-counted, least recently used evicted).
"""

from dflash_jax.kv.layout import (NO_PAGE, PAGE_SIZE, cache_layout, cache_length, merge_heads, page_size_of,
                                  ring_length, split_heads)
from dflash_jax.kv.cache import KVCache, init_cache, init_context_cache, row_lengths
from dflash_jax.kv.writes import read_kv, write_kv
from dflash_jax.kv.pool import PagePool, page_table, pages_needed
from dflash_jax.kv.prefix import PrefixPool, page_keys

__all__ = [
    "NO_PAGE", "PAGE_SIZE", "cache_layout", "cache_length", "merge_heads", "page_size_of", "ring_length", "split_heads",
    "KVCache", "init_cache", "init_context_cache", "row_lengths", "read_kv", "write_kv",
    "PagePool", "page_table", "pages_needed", "PrefixPool", "page_keys",
]

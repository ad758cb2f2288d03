"""Attention over a paged KV cache: the one interface the target and the drafter both attend
through, and the drafter's training attention.

- `metadata`: `AttentionMetadata` (query positions, live lengths, page table, rows, window, ring,
  sinks, the mask kind and the block's mask) and `LayerKV` (one layer's view of the buffers);
- `dispatch`: `attend(q, k_new, v_new, cache, meta) -> (out, cache)`, the one entry;
- `selection`: `select(meta, q, cache, platform) -> (implementation, reason)`, every fallback rule
  in one list, and `override(...)`, the documented way for benchmarks and tests to choose;
- `walk`: the portable page walk, the reference and the CPU path;
- `cudnn`: the GPU path, one fused cuDNN attention over the layer's cache;
- `pallas_tpu`: the TPU path, a Pallas kernel ragged per row (imported when selected);
- `softmax`: the scores and online-softmax step the implementations share;
- `training`: `dense_attention` and `block_attention`, the drafter's training attention.

The cache's layout and writes live in `dflash_jax.kv`.
"""

from dflash_jax.attention.metadata import AttentionMetadata, LayerKV
from dflash_jax.attention.selection import IMPLEMENTATIONS, override, select
from dflash_jax.attention.dispatch import attend
from dflash_jax.attention.training import block_attention, dense_attention

__all__ = ["AttentionMetadata", "IMPLEMENTATIONS", "LayerKV", "attend", "block_attention", "dense_attention",
           "override", "select"]

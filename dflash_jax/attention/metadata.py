"""What an attention call needs to know besides its queries: `AttentionMetadata` (which keys each
query sees, and where they live) and `LayerKV` (one layer's view of a cache's K/V buffers).

Both are pytrees (flax.struct): the arrays are traced, the layout (window, ring, page size,
scale, mask kind, layer) is static, so a jit specialises on it.

Mask kinds (`AttentionMetadata.mask`):
- "causal": the target. The call's new keys/values are written into the cache at the queries'
  positions, and a query sees the cached keys below its own `kv_limit` (q_pos + 1).
- "block": the drafter. The call's new keys/values are not cached: they are the block's keys,
  seen through `block_mask` [n, T, T] (non-causal for DFlash) beside the cached context below
  `kv_limit` (the row's context length).
- "tree": the target's verify of a draft tree (`dflash_jax.engine.tree`). The call's new
  keys/values are written into the cache at consecutive positions from the root's, `kv_limit`
  (node i at kv_limit + i), while node i's query sits at q_pos = kv_limit + its depth. A query
  sees the committed prefix (cached keys below `kv_limit`) and the tree's keys through
  `block_mask` [n, T, T] (its ancestors and itself): the block's keys are the call's new ones,
  not read back from the cache (a layer that shares another's K/V reads them from the cache).
A new kind adds a value here, a branch in `dispatch.attend`, and the rules in `select` that say
which implementations serve it.

The cache kind is orthogonal to the mask: `latent` means a latent cache (multi-head latent attention,
`dflash_jax.model.mla`): one K/V "head" whose key is a position's latent [k ; v] (the buffers hold its
two parts: `kv_lora_rank` values in k, the rotated `qk_rope_head_dim` in v; no head axis) and whose
value is k, so every implementation reads the values out of the keys it loads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.kv import PAGE_SIZE

MASKS = ("causal", "block", "tree")


@struct.dataclass
class AttentionMetadata:
    """Which keys each query sees, and where the cache keeps them.

    q_pos:      [n, T] int, the queries' positions.
    kv_limit:   [n, T] int, a query sees cached keys at positions < kv_limit.
    rows:       optional [n], the cache rows the queries belong to (default 0..n-1; a row out of
                range is padding).
    pages:      optional [batch, pages per row] page table: the cache is then a page pool
                [layers, num_pages, page_size, kv_heads * head_dim] (`dflash_jax.kv.layout`).
    sinks:      optional [kv_heads, groups] attention-sink logits (gpt-oss): one more term in each
                softmax's denominator, with no value.
    block_mask: "block" and "tree" kinds: [n, T, C] bool, which of the block's keys each query sees.
    block_k, block_v: the block's keys/values [n, C, kv_heads, head_dim], set by `attend` from its
                new keys/values (the implementations read them here).
    window:     (static) sliding window: keys at positions > q_pos - window only.
    ring:       (static) the buffers are rings of each row's last positions (needs a window).
    page_size:  (static) the cache's page, the unit the walk reads.
    scale:      (static) the scores' scale (default head_dim ** -0.5; Gemma 4: 1).
    mask:       (static) "causal", "block" or "tree" (see the module's docstring).
    latent:     (static) a latent cache: the keys are [k ; v] (the buffers' two parts of each latent),
                the values k; the new keys/values and the block's likewise. False: keys in k, values in v.
    selected:   optional [n, T, max_len] bool, the cached positions each query may see besides the
                limits above (DeepSeek sparse attention: its indexer's top-k, `dflash_jax.model.mla`).
    """

    q_pos: jax.Array
    kv_limit: jax.Array
    rows: jax.Array | None = None
    pages: jax.Array | None = None
    sinks: jax.Array | None = None
    block_mask: jax.Array | None = None
    block_k: jax.Array | None = None
    block_v: jax.Array | None = None
    selected: jax.Array | None = None
    window: int | None = struct.field(pytree_node=False, default=None)
    ring: bool = struct.field(pytree_node=False, default=False)
    page_size: int = struct.field(pytree_node=False, default=PAGE_SIZE)
    scale: float | None = struct.field(pytree_node=False, default=None)
    mask: str = struct.field(pytree_node=False, default="causal")
    latent: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self):
        assert self.mask in MASKS, self.mask
        if self.ring:
            assert self.window is not None and self.pages is None, "a ring serves sliding-window layers of per-row caches"

    @classmethod
    def causal(cls, q_pos, **layout) -> "AttentionMetadata":
        """The target's call: each query sees the cache up to and including its own position."""
        return cls(q_pos=q_pos, kv_limit=q_pos + 1, mask="causal", **layout)

    @classmethod
    def block(cls, q_pos, context_lengths, block_mask=None, **layout) -> "AttentionMetadata":
        """The drafter's call: each query sees its row's cached context (positions <
        context_lengths [n]) and the block's own keys through block_mask [n, T, T] (default: all of
        them, DFlash's non-causal block)."""
        n, t = q_pos.shape
        if block_mask is None:
            block_mask = jnp.ones((n, t, t), bool)
        kv_limit = jnp.broadcast_to(context_lengths[:, None], (n, t))
        return cls(q_pos=q_pos, kv_limit=kv_limit, block_mask=block_mask, mask="block", **layout)

    @classmethod
    def tree(cls, q_pos, tree_mask, **layout) -> "AttentionMetadata":
        """The target's verify of a draft tree: q_pos [n, T] = the root's position + each node's
        depth (node 0 is the root, at depth 0), tree_mask [n, T, T] the ancestor relation (with
        itself). With a sliding window, ancestors further back than the window are masked too."""
        start = q_pos[:, :1]
        if layout.get("window") is not None:
            tree_mask = tree_mask & (q_pos[:, :, None] - q_pos[:, None, :] < layout["window"])
        return cls(q_pos=q_pos, kv_limit=jnp.broadcast_to(start, q_pos.shape), block_mask=tree_mask, mask="tree",
                   **layout)

    @property
    def block_start(self):
        """"tree" kind: [n], the cache position of the root, where the nodes' K/V are written."""
        return self.kv_limit[:, 0]

    @property
    def has_block(self) -> bool:
        """Whether uncached block keys join the softmax."""
        return self.block_k is not None


@struct.dataclass
class LayerKV:
    """One layer of a cache's K/V: k, v [layers, batch or pages, positions, kv_heads * head_dim], a
    position's heads one row (`dflash_jax.kv.layout`; the whole buffers, so a write updates them in
    place) and the layer to read and write. A latent cache's are [layers, batch or pages, positions,
    dim] (`AttentionMetadata.latent`)."""

    k: jax.Array
    v: jax.Array
    layer: int = struct.field(pytree_node=False, default=0)

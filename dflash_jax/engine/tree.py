"""Tree verification (DDTree, arXiv 2604.12989): more tokens per cycle from the same draft pass.

The drafter denoises a block of B positions in one pass; the chain verifies its argmax at each
of them. A tree of `budget` nodes verifies several candidates per position instead:

- `build_tree`: from each block position's top-k tokens and their log-probabilities under the
  drafter, grow a tree best-first, as DDTree does: pop the best frontier node (by the sum of
  log-probabilities along its path), then push its next-ranked sibling and its best child. The
  budget fixes the node count, so every shape is static, and it runs on the device (a loop of
  `budget` pops over a frontier of budget + 1 entries; no host round trip per cycle).
- the target verifies the whole tree in one pass: node i sits at position P + depth(i) and sees
  the committed prefix and its own ancestors (`ancestor mask`, the attention metadata's "tree"
  kind); its K/V are written at P + i, and the accepted path is compacted into place afterwards
  (`dflash_jax.kv.KVCache.compact`).
- `follow`: acceptance by sample-and-match. At each node the target's token is drawn as plain
  decoding draws it at that position (the same key for every node of one depth), and the walk
  descends to the child holding that token. So greedy output, and seeded sampled output, equal
  plain decoding token for token: the tree only decides how many of the target's own tokens one
  pass confirms. (Multi-draft rejection rules assume drafts sampled from the drafter; this tree
  is built deterministically, so they do not apply.)

Node 0 is the root: the anchor, at depth 0. Nodes are numbered in the order they were popped,
so a node's parent has a smaller number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -jnp.inf


@struct.dataclass
class Tree:
    """A batch of draft trees, each of budget + 1 nodes (node 0 the root).

    tokens: [batch, N] int32, each node's token (the root's is the anchor).
    parent: [batch, N] int32, the parent's node number (the root: 0).
    depth:  [batch, N] int32, the node's depth (its position is the anchor's + depth).
    valid:  [batch, N] bool, false for padding nodes (when fewer candidates exist than the budget).
    mask:   [batch, N, N] bool, mask[i, j]: node j is node i or one of its ancestors.
    """

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array
    valid: jax.Array
    mask: jax.Array


def top_candidates(logits, budget: int):
    """The candidates a tree of `budget` nodes can use: at each block position the top
    min(budget, vocab) tokens with their log-probabilities (descending). logits [batch, D,
    vocab] -> (log_probs, tokens), each [batch, D, k]."""
    k = min(budget, logits.shape[-1])
    logits = logits.astype(jnp.float32)
    values, tokens = jax.lax.top_k(logits, k)  # the order of the log-probabilities: only k of them are formed
    return values - jax.nn.logsumexp(logits, axis=-1, keepdims=True), tokens.astype(jnp.int32)


def build_tree(anchor, log_probs, tokens, budget: int) -> Tree:
    """Best-first expansion under the budget, per row (see the module's docstring).

    anchor [batch]; log_probs, tokens [batch, D, k]: depth d + 1's candidates, best first.
    The frontier holds at most budget + 1 entries (each pop adds at most one more), each a
    (parent node, depth, rank) with its path score; a pop takes the highest score (the first on
    ties), puts its node in the tree, replaces itself by its next sibling and adds its first child.
    """
    return jax.vmap(lambda a, lp, tk: _build_row(a, lp, tk, budget))(anchor, log_probs, tokens)


def _build_row(anchor, log_probs, tokens, budget: int) -> Tree:
    depths, k = log_probs.shape
    n = budget + 1
    f_score = jnp.full((n,), NEG_INF, jnp.float32).at[0].set(log_probs[0, 0])
    f_base = jnp.zeros((n,), jnp.float32)  # the parent's path score
    f_parent = jnp.zeros((n,), jnp.int32)
    f_depth = jnp.ones((n,), jnp.int32)
    f_rank = jnp.zeros((n,), jnp.int32)
    node_tokens = jnp.zeros((n,), jnp.int32).at[0].set(anchor)
    node_parent = jnp.zeros((n,), jnp.int32)
    node_depth = jnp.zeros((n,), jnp.int32)
    node_valid = jnp.zeros((n,), bool).at[0].set(True)
    mask = jnp.zeros((n, n), bool).at[0, 0].set(True)

    def pop(i, carry):
        f_score, f_base, f_parent, f_depth, f_rank, node_tokens, node_parent, node_depth, node_valid, mask = carry
        j = jnp.argmax(f_score)
        score, base, parent, depth, rank = f_score[j], f_base[j], f_parent[j], f_depth[j], f_rank[j]
        ok = score > NEG_INF
        node_tokens = node_tokens.at[i].set(jnp.where(ok, tokens[depth - 1, rank], 0))
        node_parent = node_parent.at[i].set(jnp.where(ok, parent, 0))
        node_depth = node_depth.at[i].set(jnp.where(ok, depth, 1))
        node_valid = node_valid.at[i].set(ok)
        mask = mask.at[i].set(jnp.where(ok, mask[parent], False).at[i].set(True))
        # the popped entry becomes its next sibling; its first child takes the free entry i
        sibling = jnp.where(ok & (rank + 1 < k), base + log_probs[depth - 1, jnp.minimum(rank + 1, k - 1)], NEG_INF)
        child = jnp.where(ok & (depth < depths), score + log_probs[jnp.minimum(depth, depths - 1), 0], NEG_INF)
        f_score = f_score.at[j].set(sibling).at[i].set(child)
        f_rank = f_rank.at[j].set(rank + 1).at[i].set(0)
        f_base = f_base.at[i].set(score)
        f_parent = f_parent.at[i].set(i)
        f_depth = f_depth.at[i].set(depth + 1)
        return f_score, f_base, f_parent, f_depth, f_rank, node_tokens, node_parent, node_depth, node_valid, mask

    carry = (f_score, f_base, f_parent, f_depth, f_rank, node_tokens, node_parent, node_depth, node_valid, mask)
    *_, node_tokens, node_parent, node_depth, node_valid, mask = jax.lax.fori_loop(1, n, pop, carry)
    return Tree(tokens=node_tokens, parent=node_parent, depth=node_depth, valid=node_valid, mask=mask)


def follow(tree: Tree, target_tokens, max_depth: int):
    """Sample-and-match down each row's tree: from the root, while the target's token at the
    current node (target_tokens [batch, N], drawn as plain decoding draws it at that node's
    position + 1) is a valid child's token, descend to that child.

    Returns (path [batch, max_depth + 1] node numbers from the root (past the accepted depth the
    last accepted node repeats), num_accepted [batch])."""
    def row(tokens, parent, valid, target):
        def step(carry, _):
            node, alive, count = carry
            hit = valid & (parent == node) & (tokens == target[node]) & (jnp.arange(tokens.shape[0]) > 0)
            found = alive & hit.any()
            node = jnp.where(found, jnp.argmax(hit).astype(jnp.int32), node)
            return (node, found, count + found.astype(jnp.int32)), node

        (_, _, count), path = jax.lax.scan(step, (jnp.int32(0), jnp.bool_(True), jnp.int32(0)), None,
                                          length=max_depth)
        return jnp.concatenate([jnp.zeros((1,), jnp.int32), path]), count

    return jax.vmap(row)(tree.tokens, tree.parent, tree.valid, target_tokens)

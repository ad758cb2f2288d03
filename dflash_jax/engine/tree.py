"""Tree verification (DDTree, arXiv 2604.12989): more tokens per cycle from the same draft pass.

The drafter denoises a block of B positions in one pass; the chain verifies its argmax at each
of them. A tree of `budget` nodes verifies several candidates per position instead:

- `build_tree`: from each block position's top-k tokens and their log-probabilities under the
  drafter, the tree DDTree grows best-first (pop the best frontier node by the sum of
  log-probabilities along its path, push its next-ranked sibling and its best child), found on the
  device depth by depth (see its docstring). The budget fixes the node count, so every shape is
  static; no host round trip per cycle.
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

Node 0 is the root: the anchor, at depth 0. Nodes are numbered by depth, so a node's parent has a
smaller number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflash_jax.engine import constraints

NEG_INF = -jnp.inf


def max_tree_budget(target, block_size: int) -> int:
    """The most nodes a draft tree can have for this target (a `ModelConfig`) and block: its N + 1
    nodes are verified as one block of N + 1 positions, as a prompt of N + 1 tokens would be
    prefilled (its K/V reserved past every row's last token), which the target's context bounds;
    and a tree below the root holds at most the distinct token paths of the block's B - 1 depths
    (vocab + vocab**2 + ...): more nodes would all be padding."""
    context = target.max_position_embeddings - 1
    paths, width = 0, 1
    for _ in range(block_size - 1):
        width *= target.vocab_size
        paths += width
        if paths >= context:
            break
    return min(context, paths)


@struct.dataclass
class Tree:
    """A batch of draft trees, each of budget + 1 nodes (node 0 the root).

    tokens: [batch, N] int32, each node's token (the root's is the anchor).
    parent: [batch, N] int32, the parent's node number (the root: 0).
    depth:  [batch, N] int32, the node's depth (its position is the anchor's + depth).
    valid:  [batch, N] bool, false for padding nodes (when fewer candidates exist than the budget).
    mask:   [batch, N, N] bool, mask[i, j]: node j is node i or one of its ancestors.
    states: [batch, N] int32, the row's constraint automaton state after the node's token (the
            root's: the row's own; `dflash_jax.engine.constraints`), which masks the target's
            token after the node; None where the tree was built without the rows' states.
    """

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array
    valid: jax.Array
    mask: jax.Array
    states: jax.Array | None = None


# The share of the true top-k a TPU's approximate top-k keeps (`jax.lax.approx_max_k`).
CANDIDATE_RECALL = 0.99


def top_logits(logits, k: int):
    """The k largest logits of each row and their tokens (descending): logits [..., vocab] ->
    (values float32, tokens int32), each [..., k].

    `jax.lax.approx_max_k`: exact off a TPU (a sort); on a TPU the chip's partial reduction, which
    keeps each true candidate with probability CANDIDATE_RECALL, where an exact top-k over a
    150k vocabulary is a full sort of every position (the largest piece of a tree's draft by the
    TPU compiler's estimate). A candidate missed changes the drafts, never the output."""
    values, tokens = jax.lax.approx_max_k(logits.astype(jnp.float32), k, recall_target=CANDIDATE_RECALL)
    return values, tokens.astype(jnp.int32)


def top_candidates(logits, budget: int):
    """The candidates a tree of `budget` nodes can use: at each block position the top
    min(budget, vocab) tokens with their log-probabilities (descending). logits [batch, D,
    vocab] -> (log_probs, tokens), each [batch, D, k] (`top_logits`)."""
    values, tokens = top_logits(logits, min(budget, logits.shape[-1]))
    # the order of the log-probabilities: only k of them are formed
    return values - jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1, keepdims=True), tokens


def build_tree(anchor, log_probs, tokens, budget: int, fsm=None, pool=None) -> Tree:
    """The tree DDTree's best-first expansion builds under the budget, per row.

    anchor [batch]; log_probs, tokens [batch, D, k]: depth d + 1's candidates, best first.
    fsm [batch], pool: the rows' constraint automata (`dflash_jax.engine.constraints`; None: none):
    a candidate its parent's state does not allow is no child of it (its path scores -inf, so a
    better allowed one takes its place), and each node carries the state its path reaches
    (`Tree.states`). Filtering only changes which drafts are verified, never the output: the
    verify masks the target's tokens by the nodes' states.

    Best-first (pop the best frontier node, push its next-ranked sibling and its first child, by
    the sum of log-probabilities along the path) pops nodes in the order of their path scores: a
    child never scores above its parent (log-probabilities are <= 0) nor a sibling above a
    better-ranked one. So its tree of `budget` nodes is the `budget` best-scoring paths, which this
    finds depth by depth instead of pop by pop: a beam of the `budget` best paths at each depth
    (each extends one of the depth before, so no path of the answer is cut), then the `budget`
    best of all depths' beams. D steps of a top-k instead of `budget` dependent pops: fewer
    sequential steps on an accelerator. Ties go to the earlier depth, then to the better parent
    and rank, so a parent is always taken before its children. Nodes are numbered by depth (a
    parent before its children); paths that do not exist (fewer candidates than the budget) are
    padding nodes, not valid, numbered last.
    """
    if fsm is None:
        fsm = jnp.full(anchor.shape, constraints.NONE, jnp.int32)
    return jax.vmap(lambda a, lp, tk, f: _build_row(a, lp, tk, budget, f, pool))(anchor, log_probs, tokens, fsm)


def _build_row(anchor, log_probs, tokens, budget: int, fsm, pool) -> Tree:
    depths, k = log_probs.shape
    beam, n = budget, budget + 1
    # The children worth scoring: the child of rank r of the beam's j-th best is beaten by the
    # (j + 1)(r + 1) - 1 children of better parents and ranks, so only (j + 1)(r + 1) <= beam can
    # make the next beam: about beam * ln(beam) pairs (690 of 16384 for a budget of 128), listed
    # parent-major, the order ties go by.
    pairs = np.array([(j, r) for j in range(beam) for r in range(min(k, beam // (j + 1)))], np.int32)
    pair_parent, pair_rank = jnp.asarray(pairs[:, 0]), jnp.asarray(pairs[:, 1])

    def extend(carry, d):
        """The beam of depth d + 1: the best `beam` children of depth d's beam (those their
        parent's automaton state allows), and the states they reach."""
        prev_scores, prev_path, prev_states = carry
        pair_scores = prev_scores[pair_parent] + log_probs[d][pair_rank]
        if pool is not None:
            allowed = constraints.permits(pool, prev_states[pair_parent], tokens[d][pair_rank])
            pair_scores = jnp.where(allowed, pair_scores, NEG_INF)
        scores, pick = jax.lax.top_k(pair_scores, beam)
        parent, rank = pair_parent[pick], pair_rank[pick]
        path = prev_path[parent].at[:, d].set(d * beam + jnp.arange(beam))  # beam ids of the ancestors and itself
        states = constraints.advance(pool, prev_states[parent], tokens[d, rank])
        return (scores, path, states), (scores, parent, tokens[d, rank], path, states)

    root = (jnp.full((beam,), NEG_INF, jnp.float32).at[0].set(0.0), jnp.full((beam, depths), -1, jnp.int32),
            jnp.full((beam,), fsm, jnp.int32))
    _, (scores, parent, cand_tokens, paths, cand_states) = jax.lax.scan(extend, root, jnp.arange(depths))
    scores = scores.reshape(-1)
    chosen = jax.lax.top_k(scores, budget)[1]
    # Depth-major (parents first), padding last.
    chosen = chosen[jnp.argsort(jnp.where(scores[chosen] > NEG_INF, chosen, chosen + depths * beam))]
    node_of = jnp.zeros((depths * beam,), jnp.int32).at[chosen].set(jnp.arange(1, n, dtype=jnp.int32))
    depth = chosen // beam + 1
    valid = scores[chosen] > NEG_INF
    parent_id = jnp.maximum(depth - 2, 0) * beam + parent.reshape(-1)[chosen]
    node_parent = jnp.where(depth > 1, node_of[parent_id], 0)
    ancestors = paths.reshape(-1, depths)[chosen]  # [budget, D] beam ids, -1 below the node's depth
    ancestors = jnp.where(ancestors >= 0, node_of[jnp.maximum(ancestors, 0)], 0)  # node numbers (and the root)
    rows = jnp.zeros((budget, n), bool).at[jnp.arange(budget)[:, None], ancestors].set(True).at[:, 0].set(True)
    rows = jnp.where(valid[:, None], rows, jnp.eye(budget, n, 1, dtype=bool))  # padding: sees itself
    first = lambda x, rest: jnp.concatenate([jnp.asarray(x, rest.dtype)[None], rest])  # noqa: E731
    return Tree(tokens=first(anchor, jnp.where(valid, cand_tokens.reshape(-1)[chosen], 0)),
                parent=first(0, jnp.where(valid, node_parent, 0)),
                depth=first(0, jnp.where(valid, depth, 1)),
                valid=first(True, valid),
                mask=jnp.concatenate([jnp.zeros((1, n), bool).at[0, 0].set(True), rows]),
                states=first(fsm, jnp.where(valid, cand_states.reshape(-1)[chosen], constraints.NONE)))


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

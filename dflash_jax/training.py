"""Drafter training (the recipe of DFlash, arXiv 2602.06036): random anchors, all blocks of a sequence in one pass,
decay-weighted cross-entropy, AdamW. Pure functions; the loop lives in `train/`.

For a sequence of S tokens with loss mask m, up to N anchors are drawn uniformly without
replacement among positions i with m[i] and m[i+1]. Block j is `[x_a, MASK x (B-1)]` at
positions a..a+B-1; its slot k (1..B-1) predicts x_{a+k} with weight exp(-(k-1)/gamma),
zero past the end or outside the mask. The frozen target computes the tap features of the
whole sequence inside the step; a query of block j sees context positions < a_j and every
slot of block j, nothing else.

A DFlash2 drafter (`dflash_jax.dflash2`) adds its candidate selector's loss: at each slot the
top-K of the target head's raw logits (the gold token injected where missing), the edge scores
from the gold predecessor (teacher forced), and a K-way cross-entropy at the gold candidate,
weighted as the vocabulary cross-entropy is (`selector_cross_entropy`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from dflash_jax.config import ModelConfig
from dflash_jax.dflash2 import DFlash2Config, unary_scores
from dflash_jax.drafter import DFlashDrafter, DrafterConfig
from dflash_jax.kv import init_cache
from dflash_jax.model import CausalLM, forward
from dflash_jax.sharding import constrain, param_shardings, split_over_data, tracing_on

LOSS_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's decay per block size


def default_gamma(block_size: int) -> float:
    return LOSS_GAMMA.get(block_size, max(1.0, block_size * 7.0 / 16.0))


# --------------------------------------------------------------------------- anchors and layout


def sample_anchors(key, loss_mask, num_anchors: int, weights=None):
    """Anchors [batch, N] (ascending) and their validity [batch, N].

    Without replacement among positions i with loss_mask[i] and loss_mask[i+1]: uniformly,
    or with probability proportional to weights [batch, S] (> 0) when given (Efraimidis-Spirakis:
    the top N of log(u) / w). A sequence with fewer eligible positions than N gets invalid
    (masked) extra anchors.
    """
    b, s = loss_mask.shape
    mask = loss_mask.astype(bool)
    eligible = mask & jnp.concatenate([mask[:, 1:], jnp.zeros((b, 1), bool)], axis=1)
    if weights is None:
        scores = jnp.where(eligible, jax.random.uniform(key, (b, s)), -1.0)
        values, idx = jax.lax.top_k(scores, num_anchors)
        valid = values >= 0
    else:
        idx, valid = weighted_pick(key, eligible, weights, num_anchors)
    idx, valid = ascending(idx, valid, s)
    return idx.astype(jnp.int32), valid


def weighted_pick(key, eligible, weights, num: int):
    """Efraimidis-Spirakis: `num` indices into the last axis of `eligible` [batch, M], drawn without
    replacement with probability proportional to weights [batch, M] (> 0): the top of log(u) / w.
    Returns (indices, valid); a row with fewer eligible entries than num gets invalid extras."""
    u = jax.random.uniform(key, eligible.shape, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    values, idx = jax.lax.top_k(jnp.where(eligible, jnp.log(u) / weights.astype(jnp.float32), -jnp.inf), num)
    return idx, values > -jnp.inf


def ascending(positions, valid, bound: int):
    """Sort positions [batch, N] ascending, invalid ones last (blocks stay in sequence order)."""
    order = jnp.argsort(jnp.where(valid, positions, bound + positions), axis=1)
    return jnp.take_along_axis(positions, order, 1), jnp.take_along_axis(valid, order, 1)


@struct.dataclass
class BlockLayout:
    """Static-shape description of N blocks of B slots for a batch of sequences of S tokens."""

    tokens: jax.Array  # [batch, N*B] drafter input: [x_a, MASK, ...] per block
    positions: jax.Array  # [batch, N*B] a..a+B-1 per block
    ctx_mask: jax.Array  # [batch, N*B, S] context position < anchor
    targets: jax.Array  # [batch, N, B] x_{a+k} (slot 0 unused)
    weights: jax.Array  # [batch, N, B] decay weight, 0 where no loss


def block_layout(tokens, loss_mask, anchors, anchor_valid, *, block_size: int, mask_token_id: int,
                 gamma: float) -> BlockLayout:
    b, s = tokens.shape
    n = anchors.shape[1]
    k = jnp.arange(block_size)
    pos = anchors[:, :, None] + k[None, None, :]  # [b, N, B]
    in_range = pos < s
    safe = jnp.minimum(pos, s - 1)
    targets = jnp.take_along_axis(tokens, safe.reshape(b, -1), 1).reshape(b, n, block_size)
    covered = jnp.take_along_axis(loss_mask.astype(bool), safe.reshape(b, -1), 1).reshape(b, n, block_size)
    decay = jnp.where(k >= 1, jnp.exp(-(k - 1) / gamma), 0.0)
    weights = decay[None, None, :] * (in_range & covered & anchor_valid[:, :, None])
    block_tokens = jnp.where(k[None, None, :] == 0, targets[:, :, :1], mask_token_id)
    ctx_mask = jnp.arange(s)[None, None, :] < jnp.repeat(anchors, block_size, axis=1)[:, :, None]
    return BlockLayout(
        tokens=block_tokens.reshape(b, n * block_size).astype(jnp.int32),
        positions=pos.reshape(b, n * block_size).astype(jnp.int32),
        ctx_mask=ctx_mask,
        targets=targets.astype(jnp.int32),
        weights=weights.astype(jnp.float32),
    )


# --------------------------------------------------------------------------- loss


def chunked_cross_entropy(hidden, head_fn, targets, chunk: int):
    """Cross-entropy and correctness of rows of hidden [M, D] under head_fn (-> logits),
    `chunk` rows at a time with rematerialisation, so [M, vocab] logits never exist at once.
    Returns (ce [M], correct [M] bool)."""
    def one(h_c, t_c):
        logits = head_fn(h_c).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t_c[:, None], 1)[:, 0]
        return lse - picked, jnp.argmax(logits, -1) == t_c

    return _over_chunks(one, hidden, targets, chunk)


def _over_chunks(fn, hidden, targets, chunk: int):
    """fn(hidden rows [chunk, D], targets [chunk]) -> per-row outputs, over rows of hidden [M, D]
    `chunk` at a time (padded to a whole number of chunks, each rematerialised in the backward);
    returns fn's outputs for the M rows."""
    m = hidden.shape[0]
    pad = -m % chunk
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[1])
    t = jnp.pad(targets, (0, pad)).reshape(-1, chunk)
    outs = jax.lax.map(lambda xs: jax.checkpoint(fn)(*xs), (h, t))
    return tuple(x.reshape((-1,) + x.shape[2:])[:m] for x in outs)


def chunked_cross_entropy_top_k(hidden, raw_head_fn, targets, chunk: int, top_k: int, softcap: float | None = None):
    """`chunked_cross_entropy` that also keeps each row's top-K of the raw logits, in the same
    chunked pass (a DFlash2 drafter's selector candidates; [M, vocab] never exists at once).

    raw_head_fn: hidden -> the head's raw logits (no soft cap); the cross-entropy is over the
    soft-capped ones (cap * tanh(raw / cap) with `softcap`), as `CausalLM.logits` gives them.
    Returns (ce [M], correct [M] bool, values [M, K] float32, candidates [M, K] int32, the
    target's raw logit [M]): the candidates as the engine picks them (`top_logits`, descending),
    their values gathered from the raw logits, so gradients flow to the hidden state through them."""
    from dflash_jax.engine.tree import top_logits

    def one(h_c, t_c):
        raw = raw_head_fn(h_c).astype(jnp.float32)
        logits = raw if softcap is None else softcap * jnp.tanh(raw / softcap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t_c[:, None], 1)[:, 0]
        _, cand = top_logits(jax.lax.stop_gradient(raw), top_k)
        # One single-index gather per candidate: their gradients fuse into the dense backward as
        # `picked`'s does. One [chunk, K] gather's gradient is a scatter that the TPU compiler (v5p)
        # runs as an async call it has no time for (no estimate for the whole step), with 3x the
        # bytes accessed of the chunk's backward.
        values = jnp.concatenate([jnp.take_along_axis(raw, cand[:, i:i + 1], 1) for i in range(top_k)], 1)
        gold = jnp.take_along_axis(raw, t_c[:, None], 1)[:, 0]
        return lse - picked, jnp.argmax(logits, -1) == t_c, values, cand, gold

    return _over_chunks(one, hidden, targets, chunk)


def inject_gold(candidates, values, gold, gold_value):
    """The selector's training candidates: candidates, values [..., K] (a slot's top-K of the
    head's raw logits), the gold token gold [...] and its raw logit gold_value [...]. Where the gold
    token is not a candidate it replaces the lowest one (the lowest index among equal lowest
    values), with its own raw logit as the value.

    Returns (candidates, values, gold_index [...] int32: where the gold token now is,
    gold_in_top_k [...] bool: whether it was a candidate already)."""
    k = candidates.shape[-1]
    hit = candidates == gold[..., None]
    in_top = hit.any(-1)
    lowest = jnp.argmin(values, -1)
    index = jnp.where(in_top, jnp.argmax(hit, -1), lowest).astype(jnp.int32)
    replace = (~in_top)[..., None] & (jnp.arange(k) == lowest[..., None])
    candidates = jnp.where(replace, gold[..., None].astype(candidates.dtype), candidates)
    values = jnp.where(replace, gold_value[..., None].astype(values.dtype), values)
    return candidates, values, index, in_top


def selector_cross_entropy(drafter: DFlashDrafter, params, hidden, anchors, gold, candidates, values, gold_value,
                           d2: DFlash2Config):
    """A DFlash2 drafter's selector loss, teacher forced. hidden [R, D, width] (the drafter's
    final hidden states at the D drafted slots of R blocks), anchors [R] (each block's token 0),
    gold [R, D] (the tokens the slots should draft), candidates, values [R, D, K] (the top-K of the
    head's raw logits) and gold_value [R, D] (the gold tokens' raw logits).

    Slot d's row of edge scores is the one from its gold predecessor (the anchor at the first
    slot, the gold token of slot d-1 after), over its candidates with the gold one injected
    (`inject_gold`); the loss is the K-way cross-entropy at the gold candidate.
    Returns (ce [R, D], correct [R, D]: the row's argmax is the gold candidate, gold_in_top_k [R, D])."""
    candidates, values, index, in_top = inject_gold(candidates, values, gold, gold_value)
    preds = jnp.concatenate([anchors[:, None], gold[:, :-1]], axis=1).astype(candidates.dtype)[..., None]
    rows = drafter.apply({"params": params}, hidden, candidates, unary_scores(values, d2), preds,
                         method=DFlashDrafter.edge_scores)[:, :, 0]  # [R, D, K]
    picked = jnp.take_along_axis(rows, index[..., None], -1)[..., 0]
    return jax.nn.logsumexp(rows, -1) - picked, jnp.argmax(rows, -1) == index, in_top


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Static parts of the loss (hashable: a jit static argument)."""

    target: ModelConfig
    drafter: DrafterConfig  # its model dtype is the compute dtype
    num_anchors: int
    gamma: float
    ce_chunk: int = 1024
    # 0: anchors uniform (the paper's recipe). h > 0: anchor a drawn with weight
    # 1 + h * (1 - p_target(x_a | x_<a)), favouring the positions where decoding cycles start
    # (right after a token the drafter failed to predict).
    anchor_hardness: float = 0.0
    # 0: off. m > 0: of 4N candidate anchors (drawn as above), keep N with weight
    # 1 + m * (1 - p_drafter(x_{a+1} | block at a)), favouring those where the drafter itself misses
    # its first slot (one extra drafter pass over 4N two-slot blocks, no gradient).
    anchor_miss: float = 0.0
    mesh: Mesh | None = None  # batch over `data`, parameters by dflash_jax.sharding rules
    fsdp: bool = False  # the drafter's parameters split over `data` too (state_shardings)
    remat: str = "attention"  # what the drafter's layers recompute in the backward: drafter.REMAT_POLICIES
    # The loss: ce_weight x the vocabulary cross-entropy + (a DFlash2 drafter's) selector_weight x
    # its selector's cross-entropy; a plain DFlash drafter has no selector and ignores its weight.
    ce_weight: float = 1.0
    selector_weight: float = 1.0


def target_features(tparams, target: ModelConfig, tokens, taps):
    """Tap features [batch, S, n*hidden] of the frozen target over whole sequences."""
    b, s = tokens.shape
    out = forward(tparams, target, tokens, init_cache(target, b, s), taps=taps, return_logits=False)
    return jax.lax.stop_gradient(out.tap_features)


def position_difficulty(final_hidden, head_fn, tokens, chunk: int):
    """[batch, S]: 1 - p_target(x_a | x_<a) at each position a (0 at a = 0), from the target's
    final hidden states [batch, S, hidden] and its head, `chunk` rows at a time."""
    b, s, width = final_hidden.shape
    ce, _ = chunked_cross_entropy(final_hidden[:, :-1].reshape(b * (s - 1), width), head_fn,
                                  tokens[:, 1:].reshape(-1), chunk)
    return jnp.pad(1.0 - jnp.exp(-ce.reshape(b, s - 1)), ((0, 0), (1, 0)))


def drafter_miss(dparams, drafter: DrafterConfig, embed_fn, head_fn, features, tokens, anchors, chunk: int):
    """[batch, N]: 1 - p_drafter(x_{a+1} | [x_a, MASK] at a, context before a) at anchors a [batch, N]
    (0 where a + 1 is past the end): the drafter's first-slot miss, one pass over N two-slot blocks."""
    b, n = anchors.shape
    lay = block_layout(tokens, jnp.ones(tokens.shape, bool), anchors, jnp.ones((b, n), bool), block_size=2,
                       mask_token_id=drafter.mask_token_id, gamma=1.0)
    hidden = DFlashDrafter(dataclasses.replace(drafter, block_size=2)).apply(
        {"params": jax.lax.stop_gradient(dparams)}, embed_fn(lay.tokens), lay.positions, features, lay.ctx_mask,
        method=DFlashDrafter.train_hidden)
    first = hidden.reshape(b, n, 2, -1)[:, :, 1]
    ce, _ = chunked_cross_entropy(first.reshape(b * n, -1), head_fn, lay.targets[:, :, 1].reshape(-1), chunk)
    return jnp.where(lay.weights[:, :, 1] > 0, 1.0 - jnp.exp(-ce.reshape(b, n)), 0.0)


def miss_tilted_anchors(key, loss_mask, num_anchors: int, weights, miss_fn, tilt: float):
    """Anchors drawn in two stages: 4N candidates by `weights` (None: uniform), then the N of them
    with the top log(u) / (1 + tilt * miss), where miss_fn(candidates) is the drafter's first-slot miss."""
    k_cand, k_pick = jax.random.split(key)
    num_cand = min(4 * num_anchors, loss_mask.shape[1])
    cand, cand_valid = sample_anchors(k_cand, loss_mask, num_cand, weights)
    pick, valid = weighted_pick(k_pick, cand_valid, 1.0 + tilt * miss_fn(cand), num_anchors)
    return ascending(jnp.take_along_axis(cand, pick, 1), valid, loss_mask.shape[1])


def drafter_loss(dparams, tparams, spec: LossSpec, tokens, loss_mask, key):
    """Weighted cross-entropy of all blocks of a batch. tokens, loss_mask [batch, S].
    Returns (loss, metrics) with per-slot accuracy and the tau estimate.

    The loss is ce_weight x that cross-entropy (metric ce_loss); a DFlash2 drafter's adds
    selector_weight x its selector's (`selector_cross_entropy`, weighted alike) and its metrics selector_loss,
    selector_accuracy (the gold predecessor's row picks the gold candidate) and gold_in_top_k
    (the gold token among the head's top-K), the last two over the slots with a loss."""
    d = spec.drafter
    bsz = d.block_size
    target_model = CausalLM(spec.target)
    head = lambda h: target_model.apply({"params": tparams}, h.astype(jnp.dtype(spec.target.dtype)),
                                        method=CausalLM.logits)
    embed = lambda ids: jax.lax.stop_gradient(target_model.apply({"params": tparams}, ids, method=CausalLM.embed))
    edtype = jax.eval_shape(embed, tokens[:, :1]).dtype
    compute = jax.tree.map(lambda p: p.astype(edtype) if d.model.dtype == "bfloat16" else p, dparams)
    anchor_weights = None
    if spec.anchor_hardness > 0:
        # The last layer's tap is the target's final (normed) hidden state: its next-token
        # probabilities give each position's difficulty.
        last = spec.target.num_hidden_layers - 1
        features = target_features(tparams, spec.target, tokens, tuple(d.target_layer_ids) + (last,))
        width = spec.target.hidden_size
        features, final = features[..., :-width], features[..., -width:]
        anchor_weights = 1.0 + spec.anchor_hardness * position_difficulty(final, head, tokens, spec.ce_chunk)
    else:
        features = target_features(tparams, spec.target, tokens, d.target_layer_ids)
    if spec.anchor_miss > 0:
        miss_fn = lambda cand: drafter_miss(compute, d, embed, head, features, tokens, cand, spec.ce_chunk)
        anchors, valid = miss_tilted_anchors(key, loss_mask, spec.num_anchors, anchor_weights, miss_fn,
                                             spec.anchor_miss)
    else:
        anchors, valid = sample_anchors(key, loss_mask, spec.num_anchors, anchor_weights)
    lay = block_layout(tokens, loss_mask, anchors, valid, block_size=bsz, mask_token_id=d.mask_token_id,
                       gamma=spec.gamma)
    # Rows stay split over `data` (with parameters split over it too, the partitioner would
    # otherwise rather split the hidden width and hold every row).
    rows = lambda x: constrain(x, spec.mesh, ("batch",))  # noqa: E731
    hidden = DFlashDrafter(d, remat=spec.remat).apply(
        {"params": compute}, rows(embed(lay.tokens)), lay.positions, rows(features), lay.ctx_mask,
        method=DFlashDrafter.train_hidden)
    hidden = rows(hidden)
    b, n = anchors.shape
    hidden = hidden.reshape(b, n, bsz, -1)[:, :, 1:]  # slot 0 carries no loss
    weights = lay.weights[:, :, 1:]
    gold = lay.targets[:, :, 1:]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    d2 = d.dflash2
    if d2 is None:
        ce, correct = chunked_cross_entropy(flat_hidden, head, gold.reshape(-1), spec.ce_chunk)
    else:
        raw_head = lambda h: target_model.apply({"params": tparams}, h.astype(jnp.dtype(spec.target.dtype)),  # noqa: E731
                                                method=CausalLM.head_logits)
        ce, correct, values, cand, gold_value = chunked_cross_entropy_top_k(
            flat_hidden, raw_head, gold.reshape(-1), spec.ce_chunk, d2.selector_top_k, spec.target.final_logit_softcap)
    ce, correct = ce.reshape(weights.shape), correct.reshape(weights.shape)
    total = weights.sum()
    weighted = lambda x: (x * weights).sum() / jnp.maximum(total, 1e-9)  # noqa: E731
    ce_loss = weighted(ce)
    loss = spec.ce_weight * ce_loss

    has_loss = weights > 0
    slots = jnp.maximum(has_loss.sum(), 1)
    extra = dict(ce_loss=ce_loss)
    if d2 is not None:
        k = d2.selector_top_k
        sel_ce, sel_correct, in_top = selector_cross_entropy(
            DFlashDrafter(d), compute, hidden.reshape(b * n, bsz - 1, -1), lay.targets[:, :, 0].reshape(-1),
            gold.reshape(b * n, -1), cand.reshape(b * n, bsz - 1, k), values.reshape(b * n, bsz - 1, k),
            gold_value.reshape(b * n, -1), d2)
        selector_loss = weighted(sel_ce.reshape(weights.shape))
        loss = loss + spec.selector_weight * selector_loss
        extra.update(selector_loss=selector_loss,
                     selector_accuracy=(sel_correct.reshape(weights.shape) & has_loss).sum() / slots,
                     gold_in_top_k=(in_top.reshape(weights.shape) & has_loss).sum() / slots)
    slot_acc = (correct & has_loss).sum((0, 1)) / jnp.maximum(has_loss.sum((0, 1)), 1)
    # Teacher-forced acceptance: the accepted prefix of each block, as in a decoding cycle.
    accepted = jnp.cumprod(correct & has_loss, axis=-1).sum(-1)
    blocks = valid.sum()
    tau = 1.0 + (accepted * valid).sum() / jnp.maximum(blocks, 1)
    metrics = dict(loss=loss, tau_estimate=tau, slot_accuracy=slot_acc, anchors=blocks,
                   weight_sum=total, **extra)
    return loss, metrics


def upgrade_to_dflash2(config: DrafterConfig, params, dflash2: DFlash2Config, rng=None):
    """A plain DFlash drafter (config, params) as a DFlash2 drafter: every parameter it has kept, the
    new ones at their init (`init_drafter_params`): each layer's convolutions the identity, the
    selector's projection and codebooks small random. Returns (DrafterConfig, params)."""
    import dataclasses

    from dflash_jax.drafter import init_drafter_params

    if config.dflash2 is not None:
        raise ValueError("the drafter is a DFlash2 drafter already")
    new = dataclasses.replace(config, dflash2=dflash2)
    fresh = init_drafter_params(new.with_dtype("float32"), rng)

    def keep(old, init, where):
        if not isinstance(init, dict):
            if old.shape != init.shape:
                raise ValueError(f"{where}: shape {old.shape} != {init.shape}")
            return old.astype(init.dtype)
        missing = set(old) - set(init)
        if missing:
            raise ValueError(f"{where}/{sorted(missing)[0]}: not a parameter of the DFlash2 drafter")
        return {k: keep(old[k], v, f"{where}/{k}") if k in old else v for k, v in init.items()}

    return new, keep(params, fresh, "")


# --------------------------------------------------------------------------- optimiser and step


def make_optimizer(lr: float, total_steps: int, warmup_ratio: float = 0.04, clip: float = 1.0,
                   weight_decay: float = 0.01, b1: float = 0.9, b2: float = 0.95):
    """AdamW with linear warmup + cosine decay and global-norm clipping (the paper's recipe)."""
    warmup = max(1, int(round(warmup_ratio * total_steps)))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), end_value=0.0)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)), schedule


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict  # drafter parameters, float32
    opt_state: optax.OptState


def init_train_state(params, tx) -> TrainState:
    # A copy: train_step donates the state, which must not delete the caller's arrays.
    params = jax.tree.map(lambda p: jnp.array(p, dtype=jnp.float32, copy=True), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


@functools.partial(jax.jit, static_argnames=("spec", "tx"), donate_argnames=("state",))
def train_step(state: TrainState, tparams, tokens, loss_mask, seed_key, *, spec: LossSpec, tx):
    """One optimiser step. Anchors are keyed by (seed, step): redrawn every time a
    sequence is seen again, and identical when a resumed run replays a step."""
    key = jax.random.fold_in(seed_key, state.step)
    with tracing_on(spec.mesh):  # as the engine traces: its shard_maps see the mesh
        (loss, metrics), grads = jax.value_and_grad(drafter_loss, has_aux=True)(
            state.params, tparams, spec, tokens, loss_mask, key)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    if spec.mesh is not None:  # keep the state's layout fixed from step to step
        new = jax.lax.with_sharding_constraint(new, state_shardings(new, spec.mesh, fsdp=spec.fsdp))
    return new, metrics


def state_shardings(state, mesh: Mesh, *, fsdp: bool = False):
    """Shardings of a TrainState: parameters by the parameter rules, scalars replicated, and the
    optimizer's moments by the same rules (their paths end in the parameter's names) and split
    over `data` as well (ZeRO-1): each data-parallel replica keeps and updates its share of the
    Adam state (two float32 copies of the drafter), and the updated parameters are gathered.
    fsdp: the parameters are split over `data` too, and gathered where they are used."""
    shardings = param_shardings(state, mesh)
    moments = jax.tree.map(lambda s, leaf: split_over_data(s, leaf.shape), shardings.opt_state, state.opt_state)
    params = param_shardings(state.params, mesh, over_data=fsdp)
    return shardings.replace(params=params, opt_state=moments)

"""The sparse mixture-of-experts MLP block (Qwen3-MoE, gpt-oss, Gemma 4, Qwen3.5, DeepSeek-V3).

A router scores every token against every expert and keeps the top k (`route`). The experts
then run one of three ways, by the call's static number of tokens (`touched_path`, `tiled_path`):

- touched (decode, the verify of small batches: tokens x k < experts): the distinct experts routed
  to are picked from the stacks in their stored format, one product each over every token of the
  call, weighted by the routing (`touched_mlp`): a step reads only the experts it touches;
- grouped (prefill): the k (token, expert) assignments are sorted by expert, so each expert's
  tokens are one contiguous group, and every projection is one grouped matmul
  (`jax.lax.ragged_dot`) over those groups; the outputs go back to token order and are summed
  with the routing weights;
- tiled (the verify of a batch over MXFP4 stacks, whose products cost two dots a row): the
  assignments sorted by expert are cut into tiles of `TILE_ROWS` rows, one expert's each, and each
  tile is one product with its expert picked in its stored format (`tiled_mlp`): each expert runs
  over its own routed rows, not every token.

All agree to float32 rounding; the switch is where the TPU compiler's estimates put it.

On TPU and GPU, XLA runs `ragged_dot` as a grouped matmul. XLA's CPU backend expands it into a
dense dot masked per group (every expert's weights against every routed row): correct, and
the reason the CPU is no place to time MoE models.

Parameters (Flax names; the family tables map the HF names onto them):
  router/kernel [hidden, experts] (+ router/bias [experts])
  experts/gate_proj, experts/up_proj [experts, hidden, inter], experts/down_proj [experts, inter, hidden]
  or, with `fused_gate_up` (gpt-oss), experts/gate_up_proj [experts, hidden, 2 * inter],
  gate and up interleaved, and with `expert_bias`, experts/gate_up_proj_bias, down_proj_bias;
  with a shared expert, shared_expert/{gate,up,down}_proj and shared_expert_gate/kernel [hidden, 1].
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.config import ModelConfig, MoeConfig
from dflash_jax.config import jnp_dtype
from dflash_jax.model.layers import MLP, RMSNorm
from dflash_jax.model.weights import Batched, Grouped, Projection, Weight, declare, project


def route(logits, moe: MoeConfig, correction=None):
    """Router logits [N, experts] -> (weights [N, k] float32, expert ids [N, k] int32).
    correction: "sigmoid_grouped"'s score correction bias [experts] (`e_score_correction_bias`)."""
    if moe.router == "sigmoid_grouped":
        return _grouped_sigmoid(logits.astype(jnp.float32), moe, correction)
    if moe.router == "softmax_topk":
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, moe.top_k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        weights = weights.astype(logits.dtype)  # as transformers, which casts them back
    elif moe.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, moe.top_k)
        weights = jax.nn.softmax(top, axis=-1)
    else:
        raise ValueError(f"unknown router {moe.router!r}")
    return weights.astype(jnp.float32), experts.astype(jnp.int32)


def _grouped_sigmoid(logits, moe: MoeConfig, correction):
    """DeepSeek-V3's routing (noaux_tc): sigmoid scores; the choice adds the correction bias, and with
    n_group > 1 keeps only the `topk_group` groups whose two best corrected scores sum highest; the
    chosen experts weigh by their uncorrected scores, renormalised (`norm_topk_prob`) and times
    `routed_scaling_factor`."""
    scores = jax.nn.sigmoid(logits)
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    if moe.n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, moe.n_group, e // moe.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, groups]
        _, best = jax.lax.top_k(group_scores, moe.topk_group)
        keep = jnp.zeros((n, moe.n_group), bool).at[jnp.arange(n)[:, None], best].set(True)
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)
    _, experts = jax.lax.top_k(choice, moe.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts.astype(jnp.int32)


def dispatch(experts, num_experts: int):
    """The grouping of k assignments per token, [N, k] expert ids, by expert.

    Returns (order [N*k]: assignment indices sorted by expert, stable; group_sizes [experts]
    int32: how many assignments each expert got; inverse [N*k]: where each assignment went)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    ends = jnp.searchsorted(jnp.take(flat, order), jnp.arange(num_experts, dtype=flat.dtype), side="right",
                            method="sort")
    group_sizes = jnp.diff(ends, prepend=0).astype(jnp.int32)
    inverse = jnp.argsort(order)  # no scatter: the TPU compiler gives no estimate for a program with one
    return order, group_sizes, inverse


def activate(gate, up, moe: MoeConfig):
    if moe.activation == "silu":
        return jax.nn.silu(gate) * up
    if moe.activation == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    if moe.activation == "clamped_swiglu":
        gate = jnp.minimum(gate, moe.swiglu_limit)
        up = jnp.clip(up, -moe.swiglu_limit, moe.swiglu_limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * moe.swiglu_alpha))
    raise ValueError(f"unknown activation {moe.activation!r}")


def _grouped_mlp(xs, group_sizes, expert_of, params: dict, moe: MoeConfig, dtype):
    """The experts' MLP on rows grouped by expert: xs [M, hidden] (group_sizes [experts]; rows
    past their sum are zero), expert_of [M] each row's expert (for the biases). params: the
    kernels (`Weight`s [experts, in, out]) and biases ([experts, out]) by name. Returns [M, hidden]."""
    def grouped(x, name):
        y = project(x, params[name], Grouped(group_sizes, dtype))
        if moe.expert_bias:
            y = y + jnp.take(params[f"{name}_bias"], expert_of, axis=0, mode="clip")
        return y

    return _mlp(xs, grouped, moe)


def _mlp(x, projection, moe: MoeConfig):
    """gate, up, activation, down: projection(x, name) one of the experts' projections."""
    i = moe.intermediate_size
    if moe.fused_gate_up:
        gate_up = projection(x, "gate_up_proj")
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    elif moe.gate_up_halves:
        gate_up = projection(x, "gate_up_proj")
        gate, up = gate_up[..., :i], gate_up[..., i:]
    else:
        gate, up = projection(x, "gate_proj"), projection(x, "up_proj")
    return projection(activate(gate, up, moe), "down_proj")


_forced = contextvars.ContextVar("moe_path", default=None)


# Stacks kept quantized: the touched path (every expert, nothing picked) up to this many tokens a call.
QUANTIZED_TOUCHED_TOKENS = 256


def touched_path(tokens: int, moe: MoeConfig, quantized: bool = False) -> bool:
    """Whether a call with `tokens` tokens (static) runs the touched-experts path (`touched_mlp`)
    rather than the grouped one: when its tokens x top_k assignments cannot touch every expert
    (inside `override`: as it says).

    By the TPU compiler's estimates for one layer on v5p (docs/benchmarks.md, "Touched experts":
    DeepSeek-V3 and gpt-oss-120b at 1 to 64 tokens), the touched path reads the experts it picks
    and little else (1.03x its ideal at 8 tokens), while `ragged_dot` is charged the whole stack
    at any token count; once tokens x top_k reaches the experts, the touched path reads the whole
    stack too, with more flops (each expert over every token), and the grouped path is as fast or
    faster. So decode steps and the verify of small batches take the touched path, prefill the
    grouped one.

    `quantized`: the stacks are kept in a quantized format (`dflash_jax.model.formats`), whose
    `ragged_dot` must take a dequantized copy of the whole stack each call (nothing fuses into its
    kernel): DeepSeek-V3's FP8 layer, grouped, 103 ms at 128 tokens and 42 GiB of temporaries,
    against 8.2 ms for every expert over every token in its stored format (`Batched`), and 31 ms
    against 104 at 512 (docs/benchmarks.md, "Touched experts"). Such stacks take the touched path up
    to `QUANTIZED_TOUCHED_TOKENS` tokens a call too (a DFlash verify of batch 16 x block 16), where
    its [experts, tokens, hidden] broadcast of the rows stays small."""
    forced = _forced.get()
    if forced is not None:
        return forced == "touched"
    return tokens * moe.top_k < moe.num_experts or (quantized and tokens <= QUANTIZED_TOUCHED_TOKENS)


TILE_ROWS = 32  # rows a tile of `tiled_mlp` holds
# The tiled path's reads of experts (its static tiles) at most this many times the touched path's.
TILED_READS = 1.25


def tiled_path(tokens: int, moe: MoeConfig, row_cost: int = 1, local: int | None = None) -> bool:
    """Whether a call with `tokens` tokens (static) runs `tiled_mlp` rather than `touched_mlp` (inside
    `override`: as it says): where the touched path would run every one of the `local` experts
    (default: all) over every token, its products cost more than a plain dot per row (`row_cost` > 1:
    MXFP4), and the tiles read at most `TILED_READS` times the experts the touched path reads.

    By the TPU compiler (v5p, one MoE layer at 128 tokens, a DFlash verify of batch 8 x block 16;
    docs/benchmarks.md, "Touched experts"): gpt-oss-120b in MXFP4 (128 experts, top 4: 144 tiles of 32
    rows against 128 experts) 5.439 ms touched, 3.707 ms tiled (tiles of 8 rows: 192 tiles, 4.164 ms):
    its touched products, two copies of 128 tokens each, are compute-bound. MiniMax-M2 in FP8 (256
    experts, top 8: 288 tiles) 2.650 touched against 2.963 tiled: one copy of the tokens, and the
    tiles read 12% more experts."""
    forced = _forced.get()
    if forced is not None:
        return forced == "tiled"
    local = moe.num_experts if local is None else local
    assigned = tokens * moe.top_k
    if row_cost <= 1 or assigned < local:
        return False
    return -(-assigned // TILE_ROWS) + local <= TILED_READS * local


@contextlib.contextmanager
def override(path: str):
    """Inside the block, MoE blocks traced take `path` ("touched", "grouped" or "tiled") at every token
    count. For benchmarks and tests; the choice is made when a call is traced (a function traced
    before keeps its path from jax's cache)."""
    if path not in ("touched", "grouped", "tiled"):
        raise ValueError(f"unknown MoE path {path!r} (touched, grouped, tiled)")
    token = _forced.set(path)
    try:
        yield
    finally:
        _forced.reset(token)


def touched(experts, first, local: int):
    """The distinct experts among ids [N, k] in [first, first + local) (a device's own, expert
    parallel; first may be traced), as local ids [U] ascending, U = min(local, N * k) static, the
    slots past the distinct ones `local` (padding: no token routes there). Two sorts, no scatter
    (the TPU compiler gives no estimate for a program with a scatter)."""
    flat = jnp.sort(experts.reshape(-1) - first)
    flat = jnp.where((flat >= 0) & (flat < local), flat, local)
    new = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]])
    return jnp.sort(jnp.where(new, flat, local))[:min(local, flat.shape[0])]


def _pick(params: dict, ids) -> dict:
    """The experts `ids` [K] of every stack: kernels in their stored format (`Weight.take`), biases too."""
    return {name: p.take(ids) if name.endswith("_proj") else jnp.take(p, ids, axis=0, mode="clip")
            for name, p in params.items()}


def _experts_mlp(x, params: dict, moe: MoeConfig, dtype):
    """x [K, M, hidden] through K experts' MLPs (params: their kernels [K, in, out] and biases
    [K, out]), one product per expert (`Batched`) -> [K, M, hidden]."""
    def batched(x, name):
        y = project(x, params[name], Batched(dtype))
        if moe.expert_bias:
            y = y + params[f"{name}_bias"][:, None, :]
        return y

    return _mlp(x, batched, moe)


def touched_mlp(tokens, weights, experts, params: dict, moe: MoeConfig, dtype, first=0, local=None):
    """The routed experts' outputs combined, reading only the experts the step touches: tokens
    [N, hidden], weights [N, k] float32, experts [N, k]; params as `_grouped_mlp`'s, holding experts
    first .. first + local - 1 (all of them by default; a device's own, expert parallel).

    Each distinct expert routed to (`touched`: U slots) is picked from each stack in its stored
    format (`Weight.take`) and runs over every token of the step (`Batched`), its output weighted
    by each token's routing weight to it (zero where not routed, and for a padding slot). One
    product per slot, each reading its own expert: the TPU compiler fuses a one-expert pick into
    its dot, where a pick of all U at once is written out first (a copy of the touched experts:
    4.5x the bytes; docs/benchmarks.md, "Touched experts"). Every expert touchable (N * k >=
    local): one product over the whole stack, nothing picked. Returns [N, hidden] float32."""
    local = moe.num_experts if local is None else local
    n = tokens.shape[0]
    if min(local, n * moe.top_k) == local:
        slots = [(jnp.arange(local), params)]
    else:
        ids = touched(experts, first, local)  # [U]
        slots = [(ids[u:u + 1], _pick(params, ids[u:u + 1])) for u in range(ids.shape[0])]
    out = jnp.zeros(tokens.shape, jnp.float32)
    for ids, picked in slots:  # ids [K], picked: their kernels [K, in, out] (and biases [K, out])
        ys = _experts_mlp(jnp.broadcast_to(tokens, (ids.shape[0], *tokens.shape)), picked, moe, dtype)  # [K, N, hidden]
        mine = (experts[None] - first == ids[:, None, None]) & (ids < local)[:, None, None]  # padding: no one's
        routed = jnp.where(mine, weights[None], 0.0).sum(-1)  # [K, N]
        out = out + jnp.einsum("kn,knh->nh", routed, ys.astype(jnp.float32))
    return out


def tiled_mlp(tokens, weights, experts, params: dict, moe: MoeConfig, dtype, first=0, local=None,
              rows: int = None):
    """The routed experts' outputs combined, each expert over its own routed rows only: tokens
    [N, hidden], weights [N, k] float32, experts [N, k], params as `touched_mlp`'s.

    The N x k assignments (those to experts first .. first + local - 1) are sorted by expert and
    cut into tiles of `rows` rows, each tile one expert's (an expert's last tile padded with zero
    rows): at most ceil(N k / rows) + min(local, N k) tiles, a static count. Each tile is one
    product with its expert picked in its stored format (`Weight.take`), as `touched_mlp` picks one
    expert a product; an unused tile repeats the last expert's pick over zero rows. Where
    `touched_mlp` runs every touched expert over every token (N x U rows), this runs N x k rows
    (plus the tiles' padding) and reads an expert once per tile: the verify of a batch, whose
    tokens touch most experts, is compute-bound the first way (docs/benchmarks.md, "Touched
    experts"). Gathers and sorts only, no scatter. Returns [N, hidden] float32."""
    local = moe.num_experts if local is None else local
    rows = TILE_ROWS if rows is None else rows
    n, k = experts.shape
    a = n * k
    ids = experts.reshape(-1) - first
    key = jnp.where((ids >= 0) & (ids < local), ids, local)  # another device's experts: group `local`, last
    order, sizes, position = dispatch(key, local + 1)  # the assignments by expert; each one's sorted place
    sizes = sizes[:local]  # [local] assignments per expert
    tiles = (sizes + rows - 1) // rows
    tile_end = jnp.cumsum(tiles)
    tile_start, group_start = tile_end - tiles, jnp.cumsum(sizes) - sizes
    count = -(-a // rows) + min(local, a)
    expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(count), side="right"), local - 1)  # [T]
    rank = (jnp.arange(count) - tile_start[expert])[:, None] * rows + jnp.arange(rows)  # [T, rows]
    valid = (rank < sizes[expert][:, None]) & (rank >= 0)
    src = jnp.take(order, jnp.clip(group_start[expert][:, None] + rank, 0, a - 1))  # [T, rows] assignment
    x = jnp.where(valid[..., None], jnp.take(tokens, src // k, axis=0), jnp.zeros((), tokens.dtype))
    ys = [_experts_mlp(x[t:t + 1], _pick(params, expert[t:t + 1]), moe, dtype)[0] for t in range(count)]
    ys = jnp.concatenate(ys).astype(jnp.float32)  # [T rows, hidden]
    clipped = jnp.minimum(key, local - 1)
    within = position - group_start[clipped]
    slot = (tile_start[clipped] + within // rows) * rows + within % rows
    y = jnp.take(ys, slot, axis=0).reshape(n, k, -1)
    w = jnp.where((key < local).reshape(n, k), weights, 0.0)
    return jnp.einsum("nk,nkh->nh", w, y)


def _grouped_local(xs, group_sizes, expert_of, params: dict, moe: MoeConfig, dtype, first, local: int):
    """`_grouped_mlp` on the rows routed to experts first .. first + local - 1 (a device's own):
    a contiguous run of the grouped rows, rolled to the front, the rest zero."""
    e = moe.num_experts
    start = jnp.sum(jnp.where(jnp.arange(e) < first, group_sizes, 0))
    mine = jax.lax.dynamic_slice_in_dim(group_sizes, first, local)
    valid = jnp.arange(xs.shape[0]) < mine.sum()
    x = jnp.roll(xs, -start, axis=0)
    y = _grouped_mlp(x, mine, jnp.roll(expert_of, -start) - first, params, moe, dtype)
    y = jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))
    return jnp.roll(y, start, axis=0)


def expert_parallel(local_fn, args, params: dict, moe: MoeConfig, mesh):
    """local_fn(*args, params, first, local) with the experts split over the mesh's `model` axis
    (each device holds experts/n of them, as the sharding rules store them: first .. first +
    local - 1), in a shard_map, args replicated; one psum adds the devices' results. XLA's SPMD
    partitioner does not split `ragged_dot` over its groups: left to it, every step all-gathered
    every layer's experts."""
    from jax.sharding import PartitionSpec as P

    local = moe.num_experts // mesh.shape["model"]

    def run(args, params):
        first = jax.lax.axis_index("model") * local
        return jax.lax.psum(local_fn(*args, params, first, local), "model")

    specs = jax.tree.map(lambda v: P("model", *(None,) * (v.ndim - 1)), params)  # a weight's arrays too
    return jax.shard_map(run, mesh=mesh, in_specs=(P(), specs), out_specs=P(), axis_names={"model"},
                         check_vma=False)(args, params)


def _model_axis_mesh():
    """The mesh being traced under (`jax.sharding.use_abstract_mesh`, as the engine does), when
    it splits `model`; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or "model" not in mesh.axis_names or mesh.shape["model"] == 1:
        return None
    return mesh


class Experts(nn.Module):
    """The experts: their projections, and the routed tokens through them, combined."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, weights, experts):
        """tokens [N, hidden], routed (`route`) with weights [N, k] float32 to experts [N, k] ->
        sum_k weights * expert(token), [N, hidden] float32. N static: with `tiled_path`, each
        expert over its own rows in tiles (`tiled_mlp`: an MXFP4 verify); with `touched_path`, the
        touched experts alone (`touched_mlp`: decode and verify); else the grouped matmuls over
        the whole stack (`dispatch`, `_grouped_mlp`: prefill). Under a mesh that splits `model`
        (and divides the experts), each device runs its own experts (`expert_parallel`)."""
        c, moe = self.config, self.config.moe
        dtype = jnp_dtype(c.dtype)
        e, h, i = moe.num_experts, c.hidden_size, moe.intermediate_size
        init = nn.initializers.normal(0.02)
        if moe.fused_gate_up or moe.gate_up_halves:
            shapes = {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}
        else:
            shapes = {"gate_proj": (e, h, i), "up_proj": (e, h, i), "down_proj": (e, i, h)}
        params = {}
        for name, shape in shapes.items():  # in the order they were always created (their init keys)
            params[name] = declare(self, name, shape, dtype, init, c.weight_format)
            if moe.expert_bias:
                params[f"{name}_bias"] = self.param(f"{name}_bias", nn.initializers.zeros, (e, shape[-1]), dtype)
        mesh = _model_axis_mesh()
        split = mesh is not None and e % mesh.shape["model"] == 0
        quantized = any(isinstance(p, Weight) and p.format.name != "dense" for p in params.values())
        row_cost = max(p.format.row_cost for p in params.values() if isinstance(p, Weight))
        local = e // mesh.shape["model"] if split else e
        if tiled_path(tokens.shape[0], moe, row_cost, local):
            fn = functools.partial(tiled_mlp, moe=moe, dtype=dtype)
            if split:
                return expert_parallel(lambda *a: fn(*a[:3], a[3], first=a[4], local=a[5]),
                                       (tokens, weights, experts), params, moe, mesh)
            return fn(tokens, weights, experts, params)
        if touched_path(tokens.shape[0], moe, quantized):
            fn = functools.partial(touched_mlp, moe=moe, dtype=dtype)
            if split:
                return expert_parallel(lambda *a: fn(*a[:3], a[3], first=a[4], local=a[5]),
                                       (tokens, weights, experts), params, moe, mesh)
            return fn(tokens, weights, experts, params)
        order, group_sizes, inverse = dispatch(experts, e)
        xs = jnp.take(tokens, order // moe.top_k, axis=0)
        expert_of = jnp.take(experts.reshape(-1), order)
        if split:
            fn = functools.partial(_grouped_local, moe=moe, dtype=dtype)
            ys = expert_parallel(lambda *a: fn(*a[:4], first=a[4], local=a[5]), (xs, group_sizes, expert_of),
                                 params, moe, mesh)
        else:
            ys = _grouped_mlp(xs, group_sizes, expert_of, params, moe, dtype)
        ys = jnp.take(ys, inverse, axis=0).reshape(*weights.shape, h)  # back to [N, k, hidden]
        return (ys.astype(jnp.float32) * weights[..., None]).sum(1)


class MoE(nn.Module):
    """x [n, T, hidden] -> [n, T, hidden]: route, dispatch, grouped experts, combine; plus,
    with `shared_expert_size`, a dense MLP every token takes, gated by
    sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, router_x=None):
        """router_x: what the router scores, when not x (Gemma 4 routes the layer's input and
        sends the experts its own normed copy)."""
        c, moe = self.config, self.config.moe
        dtype = jnp_dtype(c.dtype)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scored = tokens if router_x is None else router_x.reshape(-1, shape[-1])
        if moe.router_input_norm:
            scale = self.param("router_scale", nn.initializers.ones, (shape[-1],), dtype)
            scored = RMSNorm(c.rms_norm_eps, dtype, with_weight=False)(scored) * scale * shape[-1] ** -0.5
        correction = None
        if moe.router == "sigmoid_grouped":
            correction = self.param("e_score_correction_bias", nn.initializers.zeros, (moe.num_experts,), jnp.float32)
        logits = Projection(moe.num_experts, moe.router_bias, jnp.float32 if moe.router_float32 else dtype, dtype,
                            name="router")(scored)  # a router stays dense (quantized checkpoints keep it)
        weights, experts = route(logits, moe, correction)
        if moe.per_expert_scale:
            per_expert = self.param("per_expert_scale", nn.initializers.ones, (moe.num_experts,), dtype)
            weights = weights * jnp.take(per_expert, experts).astype(jnp.float32)
        out = Experts(c, name="experts")(tokens, weights, experts).astype(dtype)
        if moe.shared_expert_size:
            shared = MLP(c, moe.shared_expert_size, name="shared_expert")(tokens)
            if moe.shared_expert_gated:
                gate = Projection(1, False, dtype, dtype, name="shared_expert_gate")(tokens)
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype) * shared
            out = out + shared
        return out.reshape(shape)

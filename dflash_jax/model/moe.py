"""The sparse mixture-of-experts MLP block (Qwen3-MoE, gpt-oss, Gemma 4, Qwen3.5, DeepSeek-V3).

A router scores every token against every expert and keeps the top k (`route`). Tokens are
then dispatched by sorting their k (token, expert) assignments by expert, so each expert's
tokens are one contiguous group, and every projection is one grouped matmul
(`jax.lax.ragged_dot`) over those groups: the work follows the tokens routed, k per token,
not every expert on every token. The outputs go back to token order and are summed with the
routing weights.

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

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.config import ModelConfig, MoeConfig
from dflash_jax.config import jnp_dtype
from dflash_jax.model.layers import MLP, RMSNorm
from dflash_jax.model.weights import Grouped, Projection, declare, project


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
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
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

    i = moe.intermediate_size
    if moe.fused_gate_up:
        gate_up = grouped(xs, "gate_up_proj")
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    elif moe.gate_up_halves:
        gate_up = grouped(xs, "gate_up_proj")
        gate, up = gate_up[:, :i], gate_up[:, i:]
    else:
        gate, up = grouped(xs, "gate_proj"), grouped(xs, "up_proj")
    return grouped(activate(gate, up, moe), "down_proj")


def expert_parallel(xs, group_sizes, expert_of, params: dict, moe: MoeConfig, dtype, mesh):
    """`_grouped_mlp` with the experts split over the mesh's `model` axis (each device holds
    experts/n of them, as the sharding rules store them), in a shard_map: each device runs the
    rows routed to its own experts, a contiguous run of the grouped rows (rolled to the front,
    the rest zero), and one psum adds the devices' rows. XLA's SPMD partitioner does not split
    `ragged_dot` over its groups: left to it, every step all-gathered every layer's experts."""
    from jax.sharding import PartitionSpec as P

    n, e = mesh.shape["model"], moe.num_experts
    local = e // n

    def run(xs, group_sizes, expert_of, params):
        first = jax.lax.axis_index("model") * local
        start = jnp.sum(jnp.where(jnp.arange(e) < first, group_sizes, 0))
        mine = jax.lax.dynamic_slice_in_dim(group_sizes, first, local)
        rows = jnp.arange(xs.shape[0])
        valid = rows < mine.sum()
        x = jnp.roll(xs, -start, axis=0)
        y = _grouped_mlp(x, mine, jnp.roll(expert_of, -start) - first, params, moe, dtype)
        y = jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))
        return jax.lax.psum(jnp.roll(y, start, axis=0), "model")

    specs = jax.tree.map(lambda v: P("model", *(None,) * (v.ndim - 1)), params)  # a weight's arrays too
    return jax.shard_map(run, mesh=mesh, in_specs=(P(), P(), P(), specs), out_specs=P(), axis_names={"model"},
                         check_vma=False)(xs, group_sizes, expert_of, params)


def _model_axis_mesh():
    """The mesh being traced under (`jax.sharding.use_abstract_mesh`, as the engine does), when
    it splits `model`; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or "model" not in mesh.axis_names or mesh.shape["model"] == 1:
        return None
    return mesh


class Experts(nn.Module):
    """The experts' projections applied to assignments already grouped by expert."""

    config: ModelConfig

    @nn.compact
    def __call__(self, xs, group_sizes, expert_of):
        """xs [M, hidden] grouped by expert (group_sizes [experts]); expert_of [M] the expert
        of each row (for the biases). Returns [M, hidden]. Under a mesh that splits `model`
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
        if mesh is not None and e % mesh.shape["model"] == 0:
            return expert_parallel(xs, group_sizes, expert_of, params, moe, dtype, mesh)
        return _grouped_mlp(xs, group_sizes, expert_of, params, moe, dtype)


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
        order, group_sizes, inverse = dispatch(experts, moe.num_experts)
        xs = jnp.take(tokens, order // moe.top_k, axis=0)
        ys = Experts(c, name="experts")(xs, group_sizes, jnp.take(experts.reshape(-1), order))
        ys = jnp.take(ys, inverse, axis=0).reshape(*weights.shape, shape[-1])  # back to [N, k, hidden]
        out = (ys.astype(jnp.float32) * weights[..., None]).sum(1).astype(dtype)
        if moe.shared_expert_size:
            shared = MLP(c, moe.shared_expert_size, name="shared_expert")(tokens)
            if moe.shared_expert_gated:
                gate = Projection(1, False, dtype, dtype, name="shared_expert_gate")(tokens)
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype) * shared
            out = out + shared
        return out.reshape(shape)

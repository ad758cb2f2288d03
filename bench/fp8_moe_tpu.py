"""One DeepSeek-V3 MoE layer at decode, bfloat16 weights against FP8 weights, as the TPU compiler sees it.

    pip install -e '.[tpu]'                          # libtpu: compiles for a TPU topology here
    python bench/fp8_moe_tpu.py [--topology v5p:1x1x1] [--tokens 8,64] [--hlo DIR]

The layer: hidden 7168, a router over 256 experts (softmax, top 8), each expert a SwiGLU MLP of
width 2048, plus one shared expert of width 2048 every token takes. Weights are Flax-layout kernels
[experts, in, out]; FP8 ones are float8_e4m3fn with a float32 scale per [128, 128] block
([experts, in / 128, out / 128]), as DeepSeek-V3's checkpoint stores them. Compiled ahead of time
for one chip (nothing runs), in these forms:

- `bf16 grouped`: the engine's MoE at prefill (`dflash_jax.model.moe`; its decode path is `touched`,
  `bench/moe_tpu.py` compiles it): assignments sorted by expert,
  one `ragged_dot` (grouped matmul) per projection over the whole expert stack. On a TPU that is a
  kernel (a custom call), whose bytes are what it declares: the whole stack.
- `fp8 dequant+grouped`: FP8 in HBM, the stack dequantized to bfloat16, then the same `ragged_dot`.
  Nothing is fused into a kernel, so the bfloat16 stack is written out and read back every step.
- `bf16 touched` / `fp8 touched`: each expert the step's tokens x 8 assignments touch, once (every
  expert when that is 256 or more), on every token of the step, its output weighted by each token's
  routing weight (zero if not routed): plain XLA dots over kernels sliced from the stack. FP8:
  `block_dot`, one partial dot per 128 kernel rows with the float8 -> bfloat16 convert inside the
  dot's operand, each partial scaled after the dot (a scale multiplied into the kernel is not fused:
  the compiler writes the scaled kernel out first).

The shared expert is a dense MLP (FP8: `block_dot`). Prints the
compiler's estimate (`optimal_seconds`), flops, bytes accessed (less the extra counts of prefetched
buffers, `dflash_jax.aot.prefetched_bytes`), HBM (arguments + temporaries) and custom calls. A
custom call's bytes are what its kernel declares, not what it reads. Asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

HIDDEN, EXPERTS, TOP_K, WIDTH, SHARED, BLOCK = 7168, 256, 8, 2048, 2048, 128


def dequantize(w8, scale):
    """[..., in, out] float8 and [..., in / 128, out / 128] float32 -> bfloat16, block by block."""
    *lead, n_in, n_out = w8.shape
    blocks = w8.astype(jnp.bfloat16).reshape(*lead, n_in // BLOCK, BLOCK, n_out // BLOCK, BLOCK)
    return (blocks * scale.astype(jnp.bfloat16)[..., :, None, :, None]).reshape(w8.shape)


def kernel(params, name, fp8):
    return dequantize(params[name], params[f"{name}_scale"]) if fp8 else params[name]


def block_dot(x, w8, scale):
    """x [tokens, in] @ dequantize(w8, scale) for one kernel, w8 [in / 128, 128, out] (or [in, out]):
    one partial dot per 128 rows of the kernel (the convert inside the dot's operand), each scaled
    after it. [tokens, out] float32."""
    n, n_in = x.shape
    partial = jnp.einsum("nkb,kbo->nko", x.reshape(n, n_in // BLOCK, BLOCK),
                         w8.astype(jnp.bfloat16).reshape(n_in // BLOCK, BLOCK, -1), preferred_element_type=jnp.float32)
    return (partial * jnp.repeat(scale, BLOCK, axis=-1)).sum(1)


def route(x, router):
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, TOP_K)
    return weights / weights.sum(-1, keepdims=True), ids


def grouped(x, weights, ids, experts, fp8):
    """The engine's form: sort the assignments by expert, a ragged_dot per projection."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = (flat[:, None] == jnp.arange(EXPERTS)).sum(0, dtype=jnp.int32)  # no scatter (see slot_experts)
    inverse = jnp.argmax(order[None, :] == jnp.arange(flat.shape[0])[:, None], axis=1)
    xs = jnp.take(x, order // TOP_K, axis=0)
    dot = lambda h, name: jax.lax.ragged_dot(h, kernel(experts, name, fp8), sizes,
                                             preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    ys = dot(jax.nn.silu(dot(xs, "gate_proj")) * dot(xs, "up_proj"), "down_proj")
    ys = jnp.take(ys, inverse, axis=0).reshape(*ids.shape, HIDDEN)
    return (ys.astype(jnp.float32) * weights[..., None]).sum(1)


def slot_experts(ids, tokens: int):
    """(the experts a step can touch, one slot each; how many slots hold one): every expert when
    tokens x 8 >= 256, else the distinct ids of the step in tokens x 8 slots, the rest padding
    (found without a scatter: the compiler gives no estimate for a program with one)."""
    slots = min(EXPERTS, tokens * TOP_K)
    if slots == EXPERTS:
        return jnp.arange(EXPERTS), EXPERTS
    present = (ids.reshape(-1, 1) == jnp.arange(EXPERTS)).any(0)
    rank = jnp.cumsum(present)  # slot j holds the expert whose rank is j + 1
    hit = (rank[None, :] == jnp.arange(1, slots + 1)[:, None]) & present[None, :]
    return jnp.argmax(hit, axis=1), present.sum()


def touched(x, weights, ids, experts, fp8):
    """Each touched expert once, on every token of the step: its kernels sliced out of the stack
    (inside the dot's operand) and the outputs weighted by each token's routing weight to it
    (zero if not routed, or a padding slot). FP8: `block_dot`, the convert inside the dot, the
    scales after it; the stack is viewed as [experts, in / 128, 128, out] before it is sliced
    (sliced first, the compiler writes the slice out in bfloat16 before the dot)."""
    experts_of, used = slot_experts(ids, x.shape[0])
    out = jnp.zeros((x.shape[0], HIDDEN), jnp.float32)
    stacks = {name: w.reshape(EXPERTS, w.shape[1] // BLOCK, BLOCK, w.shape[2]) if fp8 and w.dtype != jnp.float32 else w
              for name, w in experts.items()}
    for slot in range(experts_of.shape[0]):
        e = experts_of[slot]
        weight = jnp.where(slot < used, jnp.where(ids == e, weights, 0.0).sum(-1), 0.0)  # [tokens]

        def dot(h, name, e=e):
            w = jax.lax.dynamic_index_in_dim(stacks[name], e, keepdims=False)
            if not fp8:
                return jnp.dot(h, w, preferred_element_type=jnp.float32)
            return block_dot(h, w, jax.lax.dynamic_index_in_dim(stacks[f"{name}_scale"], e, keepdims=False))

        h = (jax.nn.silu(dot(x, "gate_proj")) * dot(x, "up_proj")).astype(jnp.bfloat16)
        out = out + dot(h, "down_proj") * weight[:, None]
    return out


FORMS = {
    "bf16 grouped": (grouped, False), "fp8 dequant+grouped": (grouped, True),
    "bf16 touched": (touched, False), "fp8 touched": (touched, True),
}


def layer(x, params, *, form: str):
    fn, fp8 = FORMS[form]
    weights, ids = route(x, params["router"])
    routed = fn(x, weights, ids, params["experts"], fp8)
    shared = params["shared"]

    def dot(h, name):
        if fp8:
            return block_dot(h, shared[name], shared[f"{name}_scale"])
        return jnp.dot(h, shared[name], preferred_element_type=jnp.float32)

    h = (jax.nn.silu(dot(x, "gate_proj")) * dot(x, "up_proj")).astype(jnp.bfloat16)
    return (routed + dot(h, "down_proj")).astype(jnp.bfloat16)


def abstract_params(mesh, fp8: bool):
    """The layer's weights as abstract arrays on one chip (nothing allocated)."""
    from dflash_jax.aot import abstract_replicated

    def mlp(lead: tuple, width: int) -> dict:
        out = {}
        for name, shape in (("gate_proj", (HIDDEN, width)), ("up_proj", (HIDDEN, width)), ("down_proj", (width, HIDDEN))):
            out[name] = abstract_replicated(mesh, lead + shape, jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
            if fp8:
                out[f"{name}_scale"] = abstract_replicated(mesh, lead + (shape[0] // BLOCK, shape[1] // BLOCK),
                                                           jnp.float32)
        return out

    return dict(router=abstract_replicated(mesh, (HIDDEN, EXPERTS), jnp.bfloat16), experts=mlp((EXPERTS,), WIDTH),
                shared=mlp((), SHARED))


def ideal_bytes(tokens: int, fp8: bool) -> float:
    """Weights a decode step must read: the router, the distinct experts tokens x 8 assignments
    can touch (at most every expert) and the shared expert, in the weights' dtype (FP8: one byte a
    value plus a float32 scale per 128 x 128)."""
    per_value = (1 + 4 / BLOCK**2) if fp8 else 2
    expert = 3 * HIDDEN * WIDTH
    return HIDDEN * EXPERTS * 2 + (min(EXPERTS, tokens * TOP_K) * expert + 3 * HIDDEN * SHARED) * per_value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/fp8_moe_tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:1x1x1", help="a one-chip TPU topology (v5p:1x1x1, v6e:1x1, ...)")
    p.add_argument("--tokens", default="8,64", help="tokens in the step (comma-separated)")
    p.add_argument("--forms", default=",".join(FORMS), help="which forms (comma-separated)")
    p.add_argument("--hlo", type=Path, default=None, help="write each compiled HLO here")
    args = p.parse_args(argv)
    from dflash_jax import aot

    try:
        target = aot.topology(args.topology)
    except aot.AotError as e:
        raise SystemExit(f"error: {e}") from None
    mesh = aot.mesh_for(target, "data=1,model=1") if target.num_chips == 1 else None
    if mesh is None:
        raise SystemExit(f"error: {args.topology} has {target.num_chips} chips; give a one-chip topology")
    rate = 2.35e12 if target.chip_name == "v5p" else target.chip.bandwidth  # the compiler's streaming rate (v5p)
    print(f"TPU {args.topology}: one DeepSeek-V3 MoE layer (hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K} of width "
          f"{WIDTH}, a shared expert of {SHARED}); compiler estimates, nothing ran")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for fp8 in (False, True):
            print(f"  tokens {tokens}: ideal ({'fp8' if fp8 else 'bf16'} weights once) "
                  f"{ideal_bytes(tokens, fp8) / 1e9:.2f} GB = {ideal_bytes(tokens, fp8) / rate * 1e3:.2f} ms")
        for form in args.forms.split(","):
            fp8 = FORMS[form][1]
            x = aot.abstract_replicated(mesh, (tokens, HIDDEN), jnp.bfloat16)
            r = aot.compile_for_tpu(jax.jit(functools.partial(layer, form=form)), (x, abstract_params(mesh, fp8)),
                                    args.hlo, f"{form.replace(' ', '_').replace(',', '')}-{tokens}")
            if not r["compiled"]:
                print(f"  tokens {tokens:3d} {form:20s} does not fit: {r['asked'] or r['error']}")
                continue
            hbm_bytes = r["bytes"] - 4 * r["prefetched"]  # a prefetched buffer is counted five times
            est = f"{r['seconds'] * 1e3:7.2f} ms" if r["seconds"] else "   none"
            print(f"  tokens {tokens:3d} {form:20s} estimate {est} ({hbm_bytes / rate * 1e3:6.2f} ms for the bytes "
                  f"read once), {r['flops'] / 1e9:7.1f} GFLOP, "
                  f"{hbm_bytes / 1e9:6.2f} GB accessed ({r['prefetched'] / 1e9:.2f} GB prefetched), HBM "
                  f"{r['memory']['arguments'] / 2**30:5.2f} + {r['memory']['temporaries'] / 2**30:5.2f} GiB; "
                  f"custom calls: {', '.join(r['custom_calls']) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Weights and the products with them: the one seam between a stored weight and `x @ W`.

Every weight matmul of the models (attention and MLP projections, MLA's kv_b_proj folds, the
experts' grouped matmuls, the router, the LM head, tied or not, and the drafter's projections) is
`project(x, weight, spec)`: `weight` a `Weight` (a format and the arrays it stores), `spec` the
contraction, written for the weight's logical (dense) value:

  `Dot`        x [..., in] . W [in, out], as `nn.Dense` (both promoted to its dtype)
  `Transposed` x [..., in] . W [out, in]^T, as `nn.Embed.attend` (a tied LM head)
  `Grouped`    `jax.lax.ragged_dot` of rows grouped by expert with W [experts, in, out]
  `Batched`    x [K, M, in] . W [K, in, out], one product per leading index (touched experts)
  `Einsum`     `jnp.einsum(subscripts, x, view(W))` in float32 (MLA's per-head folds of kv_b_proj)

A weight format (`WeightFormat`, registered by name in `FORMATS`) says what a weight of a given
logical shape stores (`stored`: the parameters, each named the weight's name plus a suffix, with its
shape, dtype and initializer), how a contraction runs on them (`product`: by default, the spec on
`materialize`'s dense value; a format may run its own kernel instead). The loader reads a stored
array from the checkpoint tensor of the weight's HF name plus the same suffix (`X.weight_scale_inv`
for `X/kernel_scale_inv`), laid out as the weight is (transposed, stacked), cast to its declared
dtype (`dflash_jax.checkpoint.load_hf_params`). A quantized format (FP8 with block scales, say) is one
`register(WeightFormat(...))` in a module of its own under `dflash_jax.model.formats`; a model picks
formats with `ModelConfig.weight_format`, which the projections of its linear layers take
(`Projection(format=...)`): one format's name for every such weight, or `FormatRules`, a format per
weight by its parameter path (a quantized checkpoint keeps some modules unquantized: its
`quantization_config`'s ignore list). Routers and embeddings stay "dense", as quantized
checkpoints keep them.

The one format today, "dense", stores the weight itself (`kernel` [in, out] for a projection,
under the same names and shapes as `nn.Dense`) in the parameter dtype, and its products are the
plain contractions, bit for bit what the models computed before the seam.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from flax.linen.dtypes import promote_dtype

from dflash_jax.errors import ConfigError

# --------------------------------------------------------------------------- contractions


@dataclasses.dataclass(frozen=True)
class Dot:
    """x [..., in] . W [in, out] -> [..., out], both promoted to `dtype` (None: their common type),
    as `nn.Dense` computes it."""

    dtype: Any = None

    def __call__(self, x, w):
        x, w = promote_dtype(x, w, dtype=self.dtype)
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


@dataclasses.dataclass(frozen=True)
class Transposed:
    """x [..., in] . W [out, in]^T -> [..., out], as `nn.Embed.attend` (the tied LM head: W the
    embedding table)."""

    dtype: Any = None

    def __call__(self, x, w):
        x, w = promote_dtype(x, w, dtype=self.dtype)
        return jnp.dot(x, w.T)


@dataclasses.dataclass(frozen=True, eq=False)
class Grouped:
    """`ragged_dot`: x [M, in] grouped by expert (group_sizes [experts]) . W [experts, in, out] ->
    [M, out], accumulated in float32 and cast to `dtype`."""

    group_sizes: Any
    dtype: Any

    def __call__(self, x, w):
        y = jax.lax.ragged_dot(x, w, self.group_sizes, preferred_element_type=jnp.float32)
        return y.astype(self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Batched:
    """x [K, M, in] . W [K, in, out] -> [K, M, out], one product per leading index (the experts a
    step touches, each over the step's rows: `Weight.take` picks them from a stack), accumulated in
    float32 and cast to `dtype`."""

    dtype: Any

    def __call__(self, x, w):
        return jnp.einsum("kmi,kio->kmo", x, w, preferred_element_type=jnp.float32).astype(self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Einsum:
    """`jnp.einsum(subscripts, x, view(W))` accumulated in float32 and cast to `dtype`: view picks
    the part of the weight the product uses (MLA: one half of kv_b_proj, per head)."""

    subscripts: str
    dtype: Any
    view: Callable = lambda w: w

    def __call__(self, x, w):
        return jnp.einsum(self.subscripts, x, self.view(w), preferred_element_type=jnp.float32).astype(self.dtype)


# --------------------------------------------------------------------------- formats


Stored = dict[str, tuple[tuple[int, ...], Any, Callable]]  # suffix -> (shape, dtype, initializer)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How a weight is kept on the device.

    stored(shape, dtype, init) -> {suffix: (shape, dtype, initializer)}: the parameters a weight of
        logical shape `shape` ([..., in, out]; `dtype` and `init` the model's) stores, each named the
        weight's name plus `suffix` ("" for the weight's own parameter).
    materialize({suffix: array}, dtype) -> the dense weight [..., in, out] in dtype (dequantized).
    product(spec, x, {suffix: array}, dtype) -> spec's contraction; None: `spec(x, materialize(arrays, dtype))`.
    (dtype: the model's, which the weight was declared with.)
    aside: suffixes of tensors a checkpoint stores beside the weight that the device does not keep
        (compressed-tensors' `weight_shape`): the loader passes each to
    check(suffix, value, {suffix: shape of one matrix's stored array}) -> None, or what is wrong with it.
    take(arrays, index) -> arrays: `Weight.take` (experts picked from a stack) the format's way, where
        the compiler fuses a pick into the product only from a view of its own; None: `jnp.take`.
    row_cost: a product's multiply-adds per row of x and weight, against a plain dot's one (MXFP4's
        products contract two copies of x per chunk of its blocks: 2). The MoE block's choice of path
        reads it (`dflash_jax.model.moe.tiled_path`)."""

    name: str
    stored: Callable[..., Stored]
    materialize: Callable[[dict], jax.Array]
    product: Callable | None = None
    aside: tuple[str, ...] = ()
    check: Callable | None = None
    take: Callable | None = None  # (arrays, index) -> arrays: `Weight.take` in the format's own way
    row_cost: int = 1

    @property
    def names(self) -> tuple[str, ...]:
        """Every stored parameter's suffix ("" for the weight's own name, when the format stores one)."""
        return tuple(self.stored((1, 1), jnp.float32, nn.initializers.zeros))

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The stored parameters' suffixes beyond the weight's own ("")."""
        return tuple(s for s in self.stored((1, 1), jnp.float32, nn.initializers.zeros) if s)


FORMATS: dict[str, WeightFormat] = {}


def register(fmt: WeightFormat) -> WeightFormat:
    if fmt.name in FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def weight_format(name: str) -> WeightFormat:
    """The registered format called `name`; an unknown name is a one-line ConfigError. (The
    quantized formats register as `dflash_jax.model` imports `dflash_jax.model.formats`.)"""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown weight format {name!r} (known: {', '.join(sorted(FORMATS))})") from None


DENSE = register(WeightFormat(
    "dense",
    stored=lambda shape, dtype, init: {"": (tuple(shape), dtype, init)},
    materialize=lambda arrays, dtype: arrays[""],
    product=lambda spec, x, arrays, dtype: spec(x, arrays[""]),
))


# --------------------------------------------------------------------------- rules


# A format per weight: (pattern, format name) pairs tried in order against a weight's parameter path
# (its path in the parameter tree, as the loader and the sharding rules name it:
# "model/layers_3/mlp/experts/gate_proj", "lm_head/kernel"; `fnmatch` patterns, `*` matching across
# "/"); a weight no pattern matches is "dense".
FormatRules = tuple[tuple[str, str], ...]


@functools.lru_cache(maxsize=64)
def _compiled(rules: FormatRules):
    exact = {p: f for p, f in reversed(rules) if not any(ch in p for ch in "*?[")}
    return exact, [(re.compile(fnmatch.translate(p)), f, i) for i, (p, f) in enumerate(rules)
                   if any(ch in p for ch in "*?[")], {p: i for i, (p, _) in reversed(list(enumerate(rules)))}


def format_for(rules: "str | FormatRules", path: str) -> str:
    """The format name a weight at `path` takes under `rules` (a name: that one for every weight)."""
    if isinstance(rules, str):
        return rules
    exact, patterns, first = _compiled(tuple(rules))
    best = (first[path], exact[path]) if path in exact else None
    for regex, name, i in patterns:
        if best is not None and i > best[0]:
            break
        if regex.fullmatch(path):
            return name
    return best[1] if best else "dense"


def formats_in(rules: "str | FormatRules") -> tuple[str, ...]:
    """Every format name `rules` may give (with "dense")."""
    if isinstance(rules, str):
        return (rules,)
    return tuple(dict.fromkeys(("dense",) + tuple(f for _, f in rules)))


# --------------------------------------------------------------------------- weights


@struct.dataclass
class Weight:
    """A weight as its format stores it: `arrays` by suffix (a pytree: it passes through jit and
    shard_map like its arrays), declared for a model of `dtype`."""

    arrays: dict[str, jax.Array]
    format: WeightFormat = struct.field(pytree_node=False, default=DENSE)
    dtype: Any = struct.field(pytree_node=False, default=None)

    @property
    def dense(self) -> jax.Array:
        """The logical (dequantized) weight."""
        return self.format.materialize(self.arrays, self.dtype)

    def take(self, index) -> "Weight":
        """Some of a stack's weights (index [K] into its leading axis: the experts a step touches),
        still in the stored format: every stored array of a stack leads with that axis."""
        if self.format.take is not None:
            return self.replace(arrays=self.format.take(self.arrays, index))
        return self.replace(arrays={s: jnp.take(a, index, axis=0, mode="clip") for s, a in self.arrays.items()})


def declare(module: nn.Module, name: str, shape, dtype, init, format: "str | FormatRules" = "dense") -> Weight:
    """The weight `name` of logical shape `shape` as parameters of `module` (inside its compact
    method or setup), in `format` (a name, or `FormatRules` matched against the weight's path):
    for "dense", one parameter `name` of that shape and dtype."""
    fmt = weight_format(format_for(format, "/".join((*module.scope.path, name))))
    return Weight({suffix: module.param(name + suffix, i, s, d) for suffix, (s, d, i) in
                   fmt.stored(tuple(shape), dtype, init).items()}, fmt, dtype)


def as_weight(array) -> Weight:
    """A dense array (an embedding table, a parameter read elsewhere) as a dense `Weight`."""
    return Weight({"": array}, DENSE, array.dtype)


def project(x, weight: Weight, spec=Dot()):
    """spec's contraction of x with the weight, through its format."""
    fmt = weight.format
    if fmt.product is not None:
        return fmt.product(spec, x, weight.arrays, weight.dtype)
    return spec(x, weight.dense)


class Projection(nn.Module):
    """`nn.Dense` through the seam: `kernel` [in, features] (and `bias` [features]) stored in
    `format`, x [..., in] -> [..., features] computed in `dtype` (as nn.Dense: x, kernel and bias
    promoted to it; None: their common type)."""

    features: int
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    format: "str | FormatRules" = "dense"

    @nn.compact
    def __call__(self, x):
        kernel = declare(self, "kernel", (x.shape[-1], self.features), self.param_dtype, self.kernel_init, self.format)
        y = project(x, kernel, Dot(self.dtype))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
            y += jnp.reshape(bias.astype(y.dtype), (1,) * (y.ndim - 1) + (-1,))
        return y

"""INT4 weights with a scale per group of inputs: compressed-tensors' `pack-quantized` format, kept packed.

Kimi-K2.5 / K2.6 (and W4A16 checkpoints llm-compressor writes) ship Linear weights this way:
config.json's `quantization_config` is `{"quant_method": "compressed-tensors", "format":
"pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4,
"type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}}, "ignore": [...]}`, and
each quantized Linear `X` [out, in] stores:

- `X.weight_packed` int32 [out, in / 8]: eight 4-bit values a word along the input, value j of a
  row in word j // 8 at bits 4 (j % 8) .. 4 (j % 8) + 3 (the lowest first), each stored as the
  unsigned q + 8 of its signed value q in [-8, 7] (compressed-tensors' `pack_to_int32`);
- `X.weight_scale` [out, in / G] (the checkpoint's dtype, bfloat16 for Kimi): one scale per G
  inputs of a row; the weight is q x its group's scale;
- `X.weight_shape` int [2]: the dense [out, in], which the loader checks and does not keep.

On the device a weight of logical shape [..., in, out] (`dflash_jax.model.weights`) keeps, in the
Flax layout the loader gives (transposed, experts stacked): `kernel_packed` int32 [..., in / 8,
out] and `kernel_scale` [..., in / G, out], 0.5 bytes a weight plus a scale per G (for G = 32 in
bfloat16: 0.5625 bytes, against 2 for the dequantized weight). One format per group size and scale
dtype ("int4-g32-bfloat16"), registered as a checkpoint asks for it (`int4_format`).

Products: the words are bitcast to int4 (`nibbles`: each nibble's top bit flipped first, which
turns the stored q + 8 into q). `Dot` (a projection) and `Batched` (the experts a decode step
touches) run `group_dot`: one partial dot per group of G inputs with the int4 -> float convert
inside the dot's operand, each partial times its group's scale after it. On the TPU compiler no
dense weight is written (only the float32 partials [tokens, in / G, out]), where materializing
first writes the whole bfloat16 weight out and reads it back: half the estimate at 8 tokens
(`bench/int4_tpu.py`; docs/benchmarks.md). The other
contractions (`Grouped`, the prefill's `ragged_dot`; `Einsum`; `Transposed`) take `materialize`:
unpacked, times the group's scale in float32 (in bfloat16 when the scales and the model are: the
product is exact there, so the same bits), cast to the model's dtype. The dequantize-at-load path
(`Int4Tensor`) computes that same dense weight in numpy, bit for bit; `group_dot` differs from a
dot with it only in the order of the float32 sums.

`rules(cfg, config)` reads the quantization_config into `FormatRules` (registered under the
"compressed-tensors" `quant_method`, `dflash_jax.model.formats.METHODS`): each Linear weight of the
family's table whose HF module a config group targets and the ignore list does not name gets the
group's format. Anything else compressed-tensors can describe (asymmetric or 8-bit weights,
quantized activations, other formats, activation ordering, sparsity) is a one-line ConfigError.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import CheckpointError, ConfigError
from dflash_jax.model.weights import FORMATS, Batched, Dot, WeightFormat, register

PACK = 8  # 4-bit values per int32 word
OFFSET = 8  # stored unsigned: q + 8
SCALE_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
METHOD = "compressed-tensors"


# --------------------------------------------------------------------------- the format on the device


FLIP = -0x77777778  # 0x88888888 as int32: x ^ 8 of an unsigned nibble x = q + 8 is q's 4-bit two's complement


def nibbles(packed):
    """int32 [..., n, out] -> int4 [..., n, out, 8]: word r's value k (q, the stored value less 8)
    at [..., r, :, k]. A bitcast (the words' bits, lowest nibble first) after flipping each
    nibble's top bit, so no shift or subtraction stands between the stored words and the dot."""
    return jax.lax.bitcast_convert_type(packed ^ jnp.int32(FLIP), jnp.int4)


def unpack(packed):
    """int32 [..., n, out] -> int8 [..., 8 n, out] in [-8, 7]: word r's value k is row 8 r + k."""
    q = jnp.swapaxes(nibbles(packed), -1, -2)  # [..., n, 8, out]
    *lead, n, _, out = q.shape
    return q.reshape(*lead, n * PACK, out).astype(jnp.int8)


def _compute_dtype(scale_dtype, dtype):
    """float32, or bfloat16 where the scales and the model are: q (4 bits) x a bfloat16 scale (8)
    is exact in float32, so rounding it once to bfloat16 is the bfloat16 product."""
    both = jnp.dtype(scale_dtype) == jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    return jnp.bfloat16 if both else jnp.float32


def _groups(packed, scale) -> int:
    """The groups of a weight's inputs, which must split them evenly."""
    n_in, groups = packed.shape[-2] * PACK, scale.shape[-2]
    if n_in % groups or (n_in // groups) % PACK:
        raise ConfigError(f"an INT4 weight of {n_in} inputs in {groups} groups: the inputs must be a multiple of "
                          "group_size, itself a multiple of 8")
    return groups


def materialize(arrays, dtype):
    """The dense weight [..., in, out] in dtype: each unpacked value times its group's scale."""
    packed, scale = arrays["_packed"], arrays["_scale"]
    compute = _compute_dtype(scale.dtype, dtype)
    q = unpack(packed).astype(compute)
    *lead, n_in, out = q.shape
    groups = _groups(packed, scale)
    w = q.reshape(*lead, groups, n_in // groups, out) * scale.astype(compute)[..., :, None, :]
    return w.reshape(*lead, n_in, out).astype(dtype)


def group_dot(x, arrays, dtype, batched: bool = False):
    """x [..., in] @ the weight [in, out] (batched: x [K, M, in] @ a stack's K weights [K, in, out],
    one product per k), in float32: one partial dot per group of G inputs over the int4 values
    converted to `dtype` inside the dot's operand (the 8 values of a word along its own
    contracting axis, so the words are read as they are stored), each partial times its group's
    scale after the dot, summed over the groups."""
    packed, scale = arrays["_packed"], arrays["_scale"]
    q = nibbles(packed)  # [(K,) n, out, 8]
    *lead, n, out, _ = q.shape
    groups = _groups(packed, scale)
    q = q.reshape(*lead, groups, n // groups, out, PACK).astype(dtype)
    xg = x.astype(dtype).reshape(*x.shape[:-1], groups, n // groups, PACK)
    scale = scale.astype(jnp.float32)
    if batched:
        partial = jnp.einsum("kmgab,kgaob->kmgo", xg, q, preferred_element_type=jnp.float32)
        return (partial * scale[:, None]).sum(-2)
    partial = jnp.einsum("...gab,gaob->...go", xg, q, preferred_element_type=jnp.float32)
    return (partial * scale).sum(-2)


def product(spec, x, arrays, dtype):
    """Dot (a projection's 2-D kernel) and Batched (touched experts): `group_dot`; the other
    contractions (`Grouped` for prefill, `Einsum`, `Transposed`) on the materialized weight."""
    if isinstance(spec, Dot) and arrays["_packed"].ndim == 2:
        compute = spec.dtype or jnp.promote_types(x.dtype, dtype)
        return group_dot(x, arrays, compute).astype(compute)
    if isinstance(spec, Batched):
        return group_dot(x, arrays, jnp.promote_types(x.dtype, dtype), batched=True).astype(spec.dtype)
    return spec(x, materialize(arrays, dtype))


def _stored(group: int, scale_dtype):
    def stored(shape, dtype, init):
        *lead, n_in, out = shape  # inputs not a multiple of the group: refused where it is used (`_groups`)
        lead = tuple(lead)
        return {"_packed": (lead + (-(-n_in // PACK), out), jnp.int32, jax.nn.initializers.zeros),
                "_scale": (lead + (-(-n_in // group), out), scale_dtype, jax.nn.initializers.ones)}
    return stored


def format_name(group: int, scale_dtype: str) -> str:
    return f"int4-g{group}-{scale_dtype}"


def int4_format(group: int, scale_dtype: str = "bfloat16") -> WeightFormat:
    """The INT4 format of group size `group` with scales in `scale_dtype` (registered on first use)."""
    if group % PACK:
        raise ConfigError(f"INT4 group_size {group} is not a multiple of {PACK} (a packed word's values)")
    name = format_name(group, scale_dtype)
    if name not in FORMATS:
        register(WeightFormat(name, stored=_stored(group, SCALE_DTYPES[scale_dtype]), materialize=materialize,
                              product=product, aside=("_shape",), check=check_shape))
    return FORMATS[name]


def check_shape(suffix: str, value: np.ndarray, stored: dict) -> str | None:
    """The checkpoint's `weight_shape` of one matrix against the arrays kept for it (stored:
    {suffix: shape} of one matrix, Flax layout): None if it is their dense [out, in]."""
    packed = stored["_packed"]
    want = (packed[-1], packed[-2] * PACK)
    got = tuple(int(v) for v in np.asarray(value).reshape(-1))
    return None if got == want else f"says the dense weight is {list(got)}, its packed values hold {list(want)}"


for _group in (32, 64, 128):  # the common group sizes, so a format name resolves before a checkpoint is read
    for _dtype in SCALE_DTYPES:
        int4_format(_group, _dtype)


# --------------------------------------------------------------------------- quantization_config


@dataclasses.dataclass(frozen=True)
class Group:
    """One config group: the format its weights take and the modules it targets."""

    format: str
    group_size: int
    targets: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Scheme:
    groups: tuple[Group, ...]
    ignore: tuple[str, ...]


def quantization_config(cfg: dict) -> dict:
    """A config.json's quantization_config (a multimodal checkpoint's may sit in its text_config)."""
    return cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}


def scale_dtype_of(cfg: dict, weights: dict) -> str:
    """The dtype the scales are kept in: the config's `scale_dtype`, else the checkpoint's dtype
    (compressed-tensors writes scales in the weights' dtype); float16 as float32 (exact)."""
    name = weights.get("scale_dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or \
        (cfg.get("text_config") or {}).get("torch_dtype") or "bfloat16"
    name = str(name).removeprefix("torch.")
    if name not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"quantization_config ({METHOD}): scale dtype {name!r} is not supported "
                          "(bfloat16, float16 or float32)")
    return "float32" if name == "float16" else name


def unsupported(what: str) -> ConfigError:
    return ConfigError(f"quantization_config ({METHOD}): {what} is not supported (only pack-quantized INT4 weights, "
                       "symmetric, with a scale per group, activations unquantized)")


def parse_scheme(cfg: dict) -> Scheme:
    """The compressed-tensors scheme of a config.json dict; anything but symmetric INT4 groups in
    `pack-quantized` is a one-line ConfigError."""
    q = quantization_config(cfg)
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise unsupported(f"quantization_status {status!r}")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if q.get(key):
            raise unsupported(key)
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"quantization_config ({METHOD}) has no config_groups")
    out = []
    for gname, group in groups.items():
        if not isinstance(group, dict):
            raise ConfigError(f"quantization_config ({METHOD}) config group {gname!r} is not an object")
        fmt = group.get("format") or q.get("format")
        if fmt != "pack-quantized":
            raise unsupported(f"format {fmt!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise unsupported(f"{key} (group {gname!r})")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise ConfigError(f"quantization_config ({METHOD}) config group {gname!r} has no weights")
        for key, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group")):
            if w.get(key) != want:
                raise unsupported(f"weights {key} {w.get(key)!r} (group {gname!r})")
        if w.get("dynamic"):
            raise unsupported(f"weights dynamic {w['dynamic']!r} (group {gname!r})")
        if w.get("actorder") not in (None, "static"):
            raise unsupported(f"weights actorder {w['actorder']!r} (group {gname!r})")
        if w.get("block_structure"):
            raise unsupported(f"weights block_structure {w['block_structure']!r} (group {gname!r})")
        size = w.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % PACK:
            raise unsupported(f"weights group_size {size!r} (group {gname!r}; a positive multiple of {PACK})")
        targets = group.get("targets") or []
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        for t in targets:
            if t != "Linear" and not t.startswith("re:") and not re.fullmatch(r"[\w.]+", t):
                raise unsupported(f"target {t!r}")
            if t != "Linear" and not t.startswith("re:") and t[:1].isupper():
                raise unsupported(f"target {t!r} (module classes other than Linear)")
        out.append(Group(int4_format(size, scale_dtype_of(cfg, w)).name, size, targets))
    ignore = q.get("ignore") or []
    return Scheme(tuple(out), (ignore,) if isinstance(ignore, str) else tuple(ignore))


def _named(name: str, entry: str) -> bool:
    """compressed-tensors' match of a module name: `re:` a regex from its start, else the exact name."""
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name


def module_format(scheme: Scheme, names: tuple[str, ...]) -> str | None:
    """The format of a Linear module known by any of `names` (its checkpoint name, and the text
    model's own without a multimodal prefix), None if it is left dense."""
    if any(_named(n, entry) for n in names for entry in scheme.ignore):
        return None
    for group in scheme.groups:
        if any(t == "Linear" or _named(n, t) for n in names for t in group.targets):
            return group.format
    return None


def rules(cfg: dict, config) -> tuple[tuple[str, str], ...]:
    """FormatRules of a compressed-tensors checkpoint: each Linear weight of the model (the table's
    kernels and expert stacks, layer by layer; routers and embeddings stay dense) whose module is
    quantized, in its group's format. The experts of one stack must share one format."""
    from dflash_jax.families.registry import family

    scheme = parse_scheme(cfg)
    table = family(config.model_type).table
    prefix = _text_prefix(table)
    out = []
    for row in table:
        if not row.transpose or not row.hf.endswith(".weight") or "/router/" in row.flax or row.part or row.piece:
            continue
        for i in (range(config.num_hidden_layers) if "{i}" in row.hf else (None,)):
            if row.stacked and i is not None and not (config.moe and config.sparse_layers[i]):
                continue  # a dense layer has no experts
            path = row.flax.format(i=i) if i is not None else row.flax
            module = row.hf[: -len(".weight")]
            if i is not None:
                module = module.replace("{i}", str(i))
            experts = range(config.moe.num_experts) if row.stacked and config.moe else (None,)
            found = {module_format(scheme, _names(module.replace("{e}", str(e)) if e is not None else module, prefix))
                     for e in experts}
            if len(found) > 1:
                raise ConfigError(f"quantization_config ({METHOD}): the experts of {module.replace('.{e}', '')} are "
                                  "not all quantized alike (a stack keeps one format)")
            fmt = found.pop()
            if fmt is None:
                continue
            if path == "lm_head/kernel":
                raise ConfigError(f"quantization_config ({METHOD}): the lm_head is quantized; the head is kept dense "
                                  "(load with dequantize)")
            out.append((path, fmt))
    return tuple(out)


def _text_prefix(table) -> str:
    """The prefix a multimodal checkpoint puts before its text model's names ("language_model.")."""
    head = next((r.hf for r in table if r.hf.endswith("embed_tokens.weight")), "model.embed_tokens.weight")
    return head[: -len("model.embed_tokens.weight")]


def _names(module: str, prefix: str) -> tuple[str, ...]:
    return (module, module[len(prefix):]) if prefix and module.startswith(prefix) else (module,)


# --------------------------------------------------------------------------- dequantized at load


def dequantize(packed: np.ndarray, scale: np.ndarray, n_in: int, dtype) -> np.ndarray:
    """HF layout, numpy: packed int32 [rows, in / 8] and scale [rows, in / G] -> [rows, n_in] in
    dtype, the same values `materialize` computes (unpacked, less 8, times the group's scale in
    float32, or bfloat16 where both are: exact either way, rounded once)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    q = ((words[..., None] >> shifts) & 0xF).astype(np.int8).reshape(*packed.shape[:-1], -1)[..., :n_in] - OFFSET
    groups = scale.shape[-1]
    w = q.astype(np.float32).reshape(*q.shape[:-1], groups, n_in // groups) * scale.astype(np.float32)[..., None]
    return w.reshape(q.shape).astype(dtype)


class Int4Tensor:
    """A packed weight, its scale and shape, read as the dequantized HF tensor [out, in] (whole or a
    range of rows), with LazyTensor's interface."""

    def __init__(self, name: str, packed, scale, shape, groups: tuple[int, ...], dtype):
        self.name, self.packed, self.scale = name, packed, scale
        self.dtype = np.dtype(dtype)
        if np.dtype(packed.dtype) != np.int32 or len(packed.shape) != 2:
            raise CheckpointError(f"tensor {name}_packed is {np.dtype(packed.dtype).name} {list(packed.shape)}, "
                                  "expected an int32 matrix")
        rows, words = packed.shape
        n_in = words * PACK
        if shape is not None:
            got = tuple(int(v) for v in np.asarray(shape.read()).reshape(-1))
            if len(got) != 2 or got[0] != rows or not n_in - PACK < got[1] <= n_in:
                raise CheckpointError(f"tensor {name}_shape says {list(got)}, its packed values hold [{rows}, {n_in}]")
            n_in = got[1]
        cols = scale.shape[-1] if len(scale.shape) == 2 else 0
        if len(scale.shape) != 2 or scale.shape[0] != rows or not cols or n_in % cols or n_in // cols not in groups:
            raise CheckpointError(f"tensor {name}_scale has shape {list(scale.shape)}, not [{rows}, {n_in} / G] for a "
                                  f"[{rows}, {n_in}] weight in groups of G = {' or '.join(map(str, groups))}")
        self.shape = (rows, n_in)

    def read_rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.shape[0] if stop is None else stop
        return dequantize(self.packed.read_rows(start, stop), self.scale.read_rows(start, stop), self.shape[1],
                          self.dtype)

    def read(self) -> np.ndarray:
        return self.read_rows()


PARTS = ("_packed", "_scale", "_shape")


def join(tensors: Iterator, cfg: dict, dtype) -> Iterator:
    """(name, tensor) of a checkpoint with each weight's `weight_packed`, `weight_scale` and
    `weight_shape` joined into one `Int4Tensor` named `X.weight`, read dequantized into dtype (in
    whichever order they come); other tensors pass through. A packed weight without its scale,
    or a scale or shape without its weight, is a CheckpointError."""
    groups = tuple(sorted({g.group_size for g in parse_scheme(cfg).groups}))
    waiting: dict[str, dict] = {}

    def part_of(name):
        for p in PARTS:
            if name.endswith(".weight" + p):
                return name[: -len(p)], p
        return None, None

    def joined(base, parts):
        return base, Int4Tensor(base, parts["_packed"], parts["_scale"], parts.get("_shape"), groups, dtype)

    for name, tensor in tensors:
        base, part = part_of(name)
        if base is None:
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[part] = tensor
        if len(parts) == len(PARTS):
            yield joined(base, waiting.pop(base))
    for base, parts in waiting.items():
        if "_packed" in parts and "_scale" in parts:
            yield joined(base, parts)
        else:
            have = next(iter(parts))
            lacks = "_scale" if "_packed" in parts else "_packed"
            raise CheckpointError(f"tensor {base}{have} has no {base}{lacks} in the checkpoint")

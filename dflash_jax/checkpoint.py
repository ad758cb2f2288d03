"""Hugging Face checkpoints <-> Flax parameter trees, and our converted (orbax) format.

Conversion is a table: each row names an HF tensor, the Flax path it fills and the
transform between them (HF Linear weights are [out, in], Flax kernels [in, out]). The
table is read both ways, so missing tensors are reported by their HF names and export
(trained drafters) is the same table backwards.

Loading reads tensor by tensor: each tensor is read, transformed, cast and placed on the
device before the next one is read, so the host never holds a second copy of the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import safetensors_io
from dflash_jax.config import VERSION, ModelConfig, jnp_dtype
from dflash_jax.errors import CheckpointError
from dflash_jax.families import FAMILIES, read_config_json
from dflash_jax.families import model_config as parse_model_config
from dflash_jax.families.table import Row, layer_rows
from dflash_jax.fp8 import FLOAT8, fp8_format, pair_scales, scale_name

# ---------------------------------------------------------------------------- tables


# z-lab DFlash drafters: no `model.` prefix, no embedding or head (borrowed from the target).
# A DFlash2 drafter's (`dflash_jax.dflash2`) add each layer's two dynamic convolutions and the
# candidate selector, named as vLLM's `qwen3_dflash2` loads them.
DRAFTER_TABLE: tuple[Row, ...] = (
    Row("fc.weight", "fc/kernel", True),
    Row("hidden_norm.weight", "hidden_norm/weight"),
    *layer_rows("layers.{i}.", "layers_{i}/"),
    *[row for conv in ("attention_conv", "mlp_conv") for row in (
        Row(f"layers.{{i}}.{conv}.base_kernel", f"layers_{{i}}/{conv}/base_kernel"),
        Row(f"layers.{{i}}.{conv}.kernel_projection.weight", f"layers_{{i}}/{conv}/kernel_projection/kernel", True))],
    Row("candidate_selector.hidden_projection.weight", "candidate_selector/hidden_projection/kernel", True),
    Row("candidate_selector.predecessor_codebook", "candidate_selector/predecessor_codebook"),
    Row("candidate_selector.successor_codebook", "candidate_selector/successor_codebook"),
    Row("norm.weight", "norm/weight"),
)

# Buffers some checkpoints carry that are derived, not learned.
IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)



def _past_last_layer(config, path: tuple[str, ...]) -> bool:
    """Whether `path` is a layer past the decoder's last, in a family whose checkpoints carry such
    layers (`Family.extra_layers`)."""
    family = FAMILIES.get(config.model_type)
    match = re.fullmatch(r"layers_(\d+)", path[1]) if len(path) > 1 else None
    return bool(family and family.extra_layers and match and int(match.group(1)) >= config.num_hidden_layers)


def target_table(model_type: str) -> tuple[Row, ...]:
    """The HF <-> Flax table of a target family (`dflash_jax.families`)."""
    from dflash_jax.families import family

    return family(model_type).table


def table_for(kind: str, config) -> tuple[Row, ...]:
    return DRAFTER_TABLE if kind == "drafter" else target_table(config.model_type)


def hf_to_flax(name: str, table) -> tuple[tuple[str, ...], Row, int | None] | None:
    """(Flax path, row, expert index or None) of an HF tensor name."""
    for row in table:
        m = row.regex.match(name)
        if m:
            groups = m.groupdict()
            expert = groups.pop("e", None)
            return tuple(row.flax.format(**groups).split("/")), row, None if expert is None else int(expert)
    return None


def flax_to_hf(path: tuple[str, ...], table) -> str:
    joined = "/".join(path)
    for row in table:
        pattern = re.escape(row.flax).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$"
        m = re.match(pattern, joined)
        if m and row.part is None:
            return row.hf.format(**m.groupdict(), e="{e}")  # a stacked row keeps its `{e}`
    return joined


# ---------------------------------------------------------------------------- HF files

WEIGHT_FILES = "model.safetensors, model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json"


def _shards(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index_path} is not a valid index file: {e}") from None
    files = [index_path.parent / f for f in dict.fromkeys(weight_map.values())]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"shard {f.name} listed in {index_path.name} is missing")
    return files


def iter_hf_tensors(hf_dir: Path) -> Iterator[tuple[str, "safetensors_io.LazyTensor"]]:
    """Every tensor of an HF directory, one at a time, as a lazy tensor (read on demand;
    bfloat16 via ml_dtypes). Every shard's header is checked against its file before a tensor is
    read (`safetensors_io.check_safetensors_header`)."""
    if (hf_dir / "model.safetensors.index.json").is_file():
        shards = _shards(hf_dir / "model.safetensors.index.json")
        for f in shards:
            safetensors_io.read_header(f)
        for f in shards:
            yield from safetensors_io.iter_lazy_tensors(f)
    elif (hf_dir / "model.safetensors").is_file():
        yield from safetensors_io.iter_lazy_tensors(hf_dir / "model.safetensors")
    elif (hf_dir / "pytorch_model.bin.index.json").is_file():
        for f in _shards(hf_dir / "pytorch_model.bin.index.json"):
            yield from _iter_torch_bin(f)
    elif (hf_dir / "pytorch_model.bin").is_file():
        yield from _iter_torch_bin(hf_dir / "pytorch_model.bin")
    else:
        raise CheckpointError(f"no weights in {hf_dir} (expected {WEIGHT_FILES})")


TORCH_FLOAT8 = {"torch.float8_e4m3fn": "F8_E4M3", "torch.float8_e5m2": "F8_E5M2", "torch.float8_e8m0fnu": "F8_E8M0"}


def _iter_torch_bin(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{path.name} is a PyTorch pickle and needs torch to read; install torch or use safetensors"
        ) from None
    try:
        # weights_only: the unpickler refuses anything but tensors and plain containers,
        # so a malicious pickle cannot execute code. mmap: tensors stay on disk until read.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises a variety of types for bad/unsafe pickles
        raise CheckpointError(f"cannot load {path} safely: {str(e).splitlines()[0]}") from None
    for name in list(state):
        t = state.pop(name)
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.int16).numpy().view(safetensors_io.SAFETENSORS_DTYPES["BF16"])
        elif str(t.dtype) in TORCH_FLOAT8:
            arr = t.view(torch.uint8).numpy().view(safetensors_io.SAFETENSORS_DTYPES[TORCH_FLOAT8[str(t.dtype)]])
        else:
            arr = t.numpy()
        yield name, safetensors_io.ArrayTensor(arr)


# ---------------------------------------------------------------------------- loading


def _flatten(tree) -> dict[tuple[str, ...], object]:
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat[tuple(k.key for k in path)] = leaf
    return flat


def _unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return tree


def _read_transformed(tensor, transpose: bool, dtype, index=None) -> np.ndarray:
    """The Flax-layout array (or the block `index` of it) of an HF tensor, cast to dtype.
    Only the HF rows the block needs are read. `transpose` swaps the last two axes (an HF
    Linear's [out, in] is a Flax kernel's [in, out]; a stack of them keeps its leading axes)."""
    if index is None:
        index = tuple(slice(None) for _ in tensor.shape)
    hf_index = _swap_last_two(tuple(index)) if transpose else tuple(index)
    rows = hf_index[0].indices(tensor.shape[0]) if tensor.shape else (0, 1, 1)
    block = tensor.read_rows(rows[0], rows[1])[(slice(None, None, rows[2]),) + tuple(hf_index[1:])]
    if transpose:
        block = np.swapaxes(block, -1, -2)
    return np.ascontiguousarray(block.astype(dtype))


def _swap_last_two(items: tuple) -> tuple:
    return items[:-2] + (items[-1], items[-2])


def load_hf_params(
    hf_dir: str | Path,
    config: ModelConfig,
    abstract,
    *,
    table=None,
    mesh=None,
    over_data: bool = False,
    progress: bool = False,
):
    """Fill the parameter tree `abstract` (ShapeDtypeStructs) from an HF directory.

    Every checkpoint tensor must map to a parameter and every parameter must be filled,
    with its shape checked. Without a mesh each tensor is read, transformed and put on the
    default device before the next is read. With a mesh each lands straight in its
    sharding (dflash_jax.sharding rules; over_data: split over `data` as well, for FSDP
    training), and for each device only its block is read. Two kinds of parameter are built
    from several tensors on the host, then placed: an expert-stacked one (one HF tensor per
    expert, e.g. Qwen3-MoE), held until its last expert is read; and one stored in parts (MXFP4
    blocks and scales), built by the family's `combine` when its parts are read. An FP8
    checkpoint's float8 tensors are paired with their scales first and dequantized into the
    model's dtype as they are read (`dflash_jax.fp8`). The other way
    round, a tensor several parameters are cut from (`_place_pieces`) is read whole on the host.
    """
    hf_dir = Path(hf_dir)
    table = target_table(config.model_type) if table is None else table
    combine = FAMILIES[config.model_type].combine if config.model_type in FAMILIES else None
    ignored = IGNORED + tuple(re.compile(p) for p in (FAMILIES[config.model_type].ignore
                                                      if config.model_type in FAMILIES else ()))
    expected = _flatten(abstract)
    shardings = None
    if mesh is not None:
        from dflash_jax.sharding import param_shardings

        shardings = _flatten(param_shardings(abstract, mesh, over_data=over_data))
    filled: dict[tuple[str, ...], jax.Array] = {}
    stacks: dict[tuple[str, ...], tuple[np.ndarray, set]] = {}  # path -> (host array, experts read)
    parts: dict[tuple[str, ...], dict] = {}  # path -> {part: tensor}

    def place(path, array):
        array = np.ascontiguousarray(array.astype(expected[path].dtype, copy=False))
        filled[path] = jnp.asarray(array) if shardings is None else jax.device_put(array, shardings[path])

    suffixes = _stored_suffixes(config)
    tensors = _hf_tensors(hf_dir, config, lambda name: _kept_in_fp8(name, table, expected))
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, total=len(expected), desc="loading tensors", unit="tensor")
    for name, tensor in tensors:
        if any(p.match(name) for p in ignored):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head saved anyway; the embedding is the head
        hit = hf_to_flax(name, table)
        if hit is None or hit[1].part is None:  # a part (MXFP4 blocks) is read as its row says, not by suffix
            base, suffix = _split_suffix(name, suffixes)
            hit = hf_to_flax(base, table)
        else:
            suffix = ""
        if hit is None:
            raise CheckpointError(f"unexpected tensor {name!r}: no parameter of a {config.model_type} model maps to it")
        path, row, expert = hit
        path = path[:-1] + (path[-1] + suffix,)  # a weight format's other arrays (scales) beside the weight's
        if row.piece is not None:
            _place_pieces(name, tensor, config, table, expected, filled, place)
            continue
        if path not in expected and _not_kept(name, tensor, config, path, suffix, row, expected):
            continue  # a multi-token-prediction layer, or a tensor a weight format checks and sets aside
        if row.part is not None:
            _combine_part(name, path, row.part, tensor, combine, parts, expected, suffixes, place)
            continue
        if path not in expected:
            raise CheckpointError(f"unexpected tensor {name!r}: the config has no parameter {'/'.join(path)}")
        if path in filled:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        want = expected[path]
        shape = tuple(want.shape[1:]) if row.stacked else tuple(want.shape)  # a stacked row: one expert
        hf_shape = _swap_last_two(shape) if row.transpose else shape
        if tuple(tensor.shape) != hf_shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {hf_shape}")
        _check_float8(name, tensor, want)
        if row.stacked:
            if not 0 <= expert < want.shape[0]:
                raise CheckpointError(f"tensor {name!r}: expert {expert} of a model with {want.shape[0]} experts")
            host, seen = stacks.setdefault(path, (np.empty(want.shape, want.dtype), set()))
            if expert in seen:
                raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
            host[expert] = _read_transformed(tensor, row.transpose, want.dtype)
            seen.add(expert)
            if len(seen) == want.shape[0]:
                place(path, host)
                del stacks[path]
        elif shardings is None:
            filled[path] = jnp.asarray(_read_transformed(tensor, row.transpose, want.dtype))
        else:
            filled[path] = jax.make_array_from_callback(
                tuple(want.shape), shardings[path],
                lambda index, t=tensor, tr=row.transpose, dt=want.dtype: _read_transformed(t, tr, dt, index))
        del tensor
    missing = []
    for p in expected:
        if p in filled:
            continue
        base, suffix = _split_suffix(p[-1], suffixes)
        name = flax_to_hf(p[:-1] + (base,), table) + suffix
        if p in stacks:
            name = name.replace("{e}", str(min(set(range(expected[p].shape[0])) - stacks[p][1])))
        elif p[:-1] + (base,) in parts:
            name = f"{name} ({', '.join(sorted(parts[p[:-1] + (base,)]))} read, another part missing)"
        missing.append(name)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint in {hf_dir} is missing tensor {missing[0]!r}{more}")
    return _unflatten(filled)


def _combine_part(name, path, part, tensor, combine, parts, expected, suffixes, place):
    """One of the tensors a weight is built from (a row with a `part`: MXFP4 blocks, scales), held
    until its family's `combine` builds, from all of them, the parameter `path` (dequantized into
    its dtype) or, for a weight kept in a format, the stored arrays `path` + suffix (combine is
    given {suffix: dtype} and returns {suffix: array})."""
    stored = {s: expected[p] for s in ("",) + suffixes if (p := path[:-1] + (path[-1] + s,)) in expected}
    if not stored:
        raise CheckpointError(f"unexpected tensor {name!r}: the config has no parameter {'/'.join(path)}")
    parts.setdefault(path, {})[part] = tensor
    try:
        arrays = combine(path, parts[path], stored[""].dtype if "" in stored else
                         {s: want.dtype for s, want in stored.items()})
    except ValueError as e:
        raise CheckpointError(f"tensor {name!r}: {e}") from None
    if arrays is None:
        return
    for suffix, array in (arrays.items() if isinstance(arrays, dict) else (("", arrays),)):
        p, want = path[:-1] + (path[-1] + suffix,), stored.get(suffix)
        if want is None or tuple(array.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {name!r} gives {'/'.join(p)} of shape {tuple(array.shape)}, expected "
                                  f"{tuple(want.shape) if want is not None else 'no such parameter'}")
        place(p, array)
    del parts[path]


def _hf_tensors(hf_dir: Path, config, kept):
    """The HF tensors; an FP8 checkpoint's float8 tensors each paired with its scale into one
    tensor, dequantized as it is read, but those of the weights `kept(name)` says the model stores in
    FP8 (`dflash_jax.model.formats.fp8`): they and their scales are read as they are. Another
    quantized checkpoint loaded dense (`load_target(dequantize=True)`): each weight's stored tensors
    joined by its method into one tensor read dequantized (`dflash_jax.model.formats.DEQUANTIZE`)."""
    from dflash_jax.model.formats import DEQUANTIZE
    from dflash_jax.model.weights import formats_in

    tensors = iter_hf_tensors(hf_dir)
    cfg = read_config_json(hf_dir / "config.json") if (hf_dir / "config.json").is_file() else {}
    fmt = fp8_format(cfg)
    if fmt is not None:
        return pair_scales(tensors, fmt, jnp_dtype(config.dtype), keep=kept)
    method = (cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
              or {}).get("quant_method")
    dense = formats_in(config.weight_format) == ("dense",)
    return DEQUANTIZE[method](tensors, cfg, jnp_dtype(config.dtype)) if dense and method in DEQUANTIZE else tensors


def _kept_in_fp8(name: str, table, expected) -> bool:
    """Whether the model stores the HF float8 tensor `name` as it is (its scale beside it)."""
    hit = hf_to_flax(name, table)
    return hit is not None and hit[0][:-1] + (hit[0][-1] + scale_name(""),) in expected


def _check_float8(name: str, tensor, want):
    """A parameter kept in float8 is read from a tensor of that very type (never cast into it)."""
    if np.dtype(want.dtype) in FLOAT8 and np.dtype(tensor.dtype) != np.dtype(want.dtype):
        raise CheckpointError(
            f"tensor {name!r} is {np.dtype(tensor.dtype).name}, but the model keeps it in {np.dtype(want.dtype).name} "
            f"(quantization_config); name its module in modules_to_not_convert, or load it dequantized")


def _stored_suffixes(config) -> tuple[str, ...]:
    """What the config's weight format stores beside each weight (`dflash_jax.model.weights`), as
    suffixes of its name: the loader reads each from the HF tensor named the weight's plus it."""
    from dflash_jax.model.weights import formats_in, weight_format

    suffixes = {s for name in formats_in(config.weight_format) for s in
                weight_format(name).suffixes + weight_format(name).aside}
    return tuple(sorted(suffixes, key=lambda s: (-len(s), s)))  # the longest first: `_scale` after `_scale_inv`


def _not_kept(name, tensor, config, path, suffix, row, expected) -> bool:
    """Whether `name`, a tensor of no parameter, is one the model does not keep: a layer past the
    decoder's last (its family's `extra_layers`), or a tensor the weight's format sets aside
    (`WeightFormat.aside`), checked against the arrays it stores for one matrix (a CheckpointError
    if they disagree)."""
    from dflash_jax.model.weights import format_for, weight_format

    if _past_last_layer(config, path):
        return True
    if not suffix:
        return False
    base = path[:-1] + (path[-1][: -len(suffix)],)
    fmt = weight_format(format_for(config.weight_format, "/".join(base)))
    if suffix not in fmt.aside:
        return False
    stored = {s: tuple(expected[base[:-1] + (base[-1] + s,)].shape[1 if row.stacked else 0:])
              for s in fmt.suffixes if base[:-1] + (base[-1] + s,) in expected}
    problem = fmt.check(suffix, tensor.read(), stored) if fmt.check else None
    if problem:
        raise CheckpointError(f"tensor {name!r} {problem}")
    return True


def _split_suffix(name: str, suffixes: tuple[str, ...]) -> tuple[str, str]:
    """(the weight's name, the stored suffix) of a tensor or parameter name ("" for the weight's own)."""
    for suffix in suffixes:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def _place_pieces(name, tensor, config: ModelConfig, table, expected, filled, place):
    """An HF tensor several parameters are cut from (rows with a `piece`, e.g. Qwen3-Next's fused
    `in_proj_qkvz`): read whole, transformed, cut by its family's `split`, each piece placed. The
    pieces split the Flax layout's last axis, so the tensor's shape is checked against their sum."""
    pieces = {}
    for row in table:
        m = row.regex.match(name) if row.piece is not None else None
        if m:
            pieces[row.piece] = (tuple(row.flax.format(**m.groupdict()).split("/")), row.transpose)
    for path, _ in pieces.values():
        if path not in expected:
            raise CheckpointError(f"unexpected tensor {name!r}: the config has no parameter {'/'.join(path)}")
        if path in filled:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
    first, transpose = next(iter(pieces.values()))
    want = expected[first]
    shape = tuple(want.shape[:-1]) + (sum(expected[p].shape[-1] for p, _ in pieces.values()),)
    hf_shape = _swap_last_two(shape) if transpose else shape
    if tuple(tensor.shape) != hf_shape:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {hf_shape}")
    cut = FAMILIES[config.model_type].split(config, name, _read_transformed(tensor, transpose, want.dtype))
    for piece, (path, _) in pieces.items():
        if tuple(cut[piece].shape) != tuple(expected[path].shape):
            raise CheckpointError(f"tensor {name!r} gives {piece} of shape {tuple(cut[piece].shape)}, "
                                  f"expected {tuple(expected[path].shape)}")
        place(path, cut[piece])


def save_hf_params(params, path: str | Path, *, table, dtype=None):
    """Write a parameter tree as one HF safetensors file: the table read backwards."""
    tensors = {}
    for flax_path, leaf in _flatten(params).items():
        name = flax_to_hf(flax_path, table)
        hit = hf_to_flax(name, table)
        if hit is None or hit[0] != flax_path or hit[1].stacked:
            raise CheckpointError(f"parameter {'/'.join(flax_path)} has no single HF tensor in the table")
        array = np.asarray(jax.device_get(leaf))
        if dtype is not None:
            array = array.astype(dtype)
        tensors[name] = np.swapaxes(array, -1, -2) if hit[1].transpose else array
    safetensors_io.save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------- converted format

METADATA_FILE = "dflash_jax.json"
FORMAT_VERSION = 1
# Files copied next to the weights so a converted directory is self-contained.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def is_converted(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def check_model_dir(path: str | Path, kind: str = "model") -> Path:
    """The directory, if it holds a model; else a one-line error naming it as the `kind`'s."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{kind} directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{kind} {path} is not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{kind} {path} is not a model directory (no config.json)")
    return path


def read_metadata(path: Path) -> dict:
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / METADATA_FILE} is not valid JSON: {e}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by format version {meta.get('format_version')}, this dflash-jax reads {FORMAT_VERSION}"
        )
    return meta


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save_converted(out: Path, params, *, hf_dir: Path, kind: str, dtype: str, config_dict: dict,
                   quantized: bool = False):
    """Write params (orbax) + config.json + side files + metadata into `out` (must not exist).
    quantized: params hold weights in a quantized checkpoint's format (`ModelConfig.weight_format`),
    and config.json keeps its `quantization_config`, so the directory reloads in that format."""
    out.mkdir(parents=True)
    ckptr = _checkpointer()
    ckptr.save((out / "params").absolute(), params)
    ckptr.wait_until_finished()
    ckptr.close()
    if not quantized:  # the weights written are dequantized (FP8, MXFP4): the copy of config.json says no quantization
        config_dict = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    for name in SIDE_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out / name)

    meta = dict(format="dflash-jax", format_version=FORMAT_VERSION, kind=kind, dtype=dtype,
                source=str(hf_dir), dflash_jax_version=VERSION)
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def is_quantized(config) -> bool:
    """Whether a model config keeps some weights in a quantized format (not all "dense")."""
    from dflash_jax.model.weights import formats_in

    return set(formats_in(config.weight_format)) != {"dense"}


def dequantized_params(params, config):
    """params of a model kept in its weights' formats -> the same model's params with every weight
    dense (each materialized into the config's dtype, one at a time, where it lies)."""
    from dflash_jax.model.weights import format_for, weight_format

    dtype = jnp_dtype(config.dtype)
    flat, out = _flatten(params), {}
    suffixes = _stored_suffixes(config)
    weights: dict[tuple[str, ...], dict] = {}
    for path, leaf in flat.items():
        base, suffix = _split_suffix(path[-1], suffixes)
        weights.setdefault(path[:-1] + (base,), {})[suffix] = leaf
    for path, arrays in weights.items():
        fmt = weight_format(format_for(config.weight_format, "/".join(path)))
        if fmt.name == "dense" or set(arrays) != set(fmt.names):
            out.update({path[:-1] + (path[-1] + s,): a for s, a in arrays.items()})
        else:
            out[path] = fmt.materialize(arrays, dtype)
    return _unflatten(out)


def load_converted_params(path: Path, abstract, mesh=None, over_data: bool = False):
    """Restore params written by `save_converted` in the dtypes of `abstract`; with a mesh,
    each array is read straight into its sharding (only the needed chunks). Orbax casts as it
    reads (rounding as jax's `astype` does: float32 to bfloat16 and float16 checked bit for bit),
    so the model is never held a second time in the saved dtype."""
    read_metadata(path)  # the format version is checked before orbax reads anything
    shardings = jax.tree.map(lambda _: None, abstract)
    if mesh is not None:
        from dflash_jax.sharding import param_shardings

        shardings = param_shardings(abstract, mesh, over_data=over_data)
    wanted = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    ckptr = _checkpointer()
    try:
        return ckptr.restore((path / "params").absolute(), wanted)
    except Exception as e:  # orbax raises ValueError/KeyError/FileNotFoundError variants
        raise CheckpointError(f"cannot restore converted checkpoint {path}: {str(e).splitlines()[0]}") from None
    finally:
        ckptr.close()


# ---------------------------------------------------------------------------- public API


def model_kind(config_dict: dict) -> str:
    """'drafter' for DFlash drafter configs, else 'target'."""
    if {"DFlashDraftModel", "DFlash2DraftModel"} & set(config_dict.get("architectures") or []) or "dflash_config" in config_dict:
        return "drafter"
    return "target"


def read_model_config(path: str | Path, kind: str, *, dtype: str | None = None, dequantize: bool = False):
    """The config of a `kind` ("target" | "drafter") model directory, HF or converted, checked
    without reading a weight: a ModelConfig, or a DrafterConfig. dequantize: a quantized target's
    weights dequantized into dtype at load (`dflash_jax.families.hf.model_config`), not kept in its format."""
    path = check_model_dir(path, kind)
    if is_converted(path):
        meta = read_metadata(path)
        if meta.get("kind") != kind:
            raise CheckpointError(f"{path} holds a converted {meta.get('kind')}, not a {kind}")
        dtype = dtype or meta["dtype"]
    else:
        found = model_kind(read_config_json(path / "config.json"))
        if found != kind:
            raise CheckpointError(f"{path} holds a {found} checkpoint, not a {kind}")
    if kind == "drafter":
        from dflash_jax.drafter import DrafterConfig

        return DrafterConfig.from_json(path / "config.json", dtype=dtype)
    return parse_model_config(target_config_dict(path), dtype=dtype, dequantize=dequantize)


def target_config_dict(path: Path) -> dict:
    """A target directory's config.json dict, as its weights are: an FP8 checkpoint's Linear weights
    that it stores unquantized without naming them in `modules_to_not_convert` (the rules would keep
    them in FP8: `dflash_jax.model.formats.fp8.unquantized_modules`) added to it, from the shards'
    headers (no tensor read). A converted checkpoint's config.json keeps the list so added."""
    from dflash_jax.model.formats.fp8 import unquantized_modules

    cfg = read_config_json(path / "config.json")
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8" or is_converted(path) or not any(path.glob("*.safetensors")):
        return cfg
    files = (_shards(path / "model.safetensors.index.json") if (path / "model.safetensors.index.json").is_file()
             else [path / "model.safetensors"])
    dtypes = {name: t["dtype"] for f in files if f.is_file() for name, t in safetensors_io.read_header(f)[0].items()}
    extra = unquantized_modules(cfg, parse_model_config(cfg, dequantize=True), dtypes)
    if not extra:
        return cfg
    return {**cfg, "quantization_config": {**quant, "modules_to_not_convert": [
        *(quant.get("modules_to_not_convert") or []), *extra]}}


def load_model(path: str | Path, kind: str, *, dtype: str | None = None, progress: bool = False, mesh=None,
               over_data: bool = False, dequantize: bool = False):
    """(config, params) of a `kind` ("target" | "drafter") from an HF or converted directory."""
    from dflash_jax.drafter import abstract_drafter_params
    from dflash_jax.model import abstract_params

    config = read_model_config(path, kind, dtype=dtype, dequantize=dequantize)
    path = Path(path)
    abstract = abstract_drafter_params(config) if kind == "drafter" else abstract_params(config)
    if is_converted(path):
        if kind == "target" and dequantize:  # written in its formats: restored so, then dequantized
            kept = read_model_config(path, kind, dtype=dtype)
            if is_quantized(kept):
                params = load_converted_params(path, abstract_params(kept), mesh, over_data)
                return config, dequantized_params(params, kept)
        return config, load_converted_params(path, abstract, mesh, over_data)
    model_config = config.model if kind == "drafter" else config
    try:
        return config, load_hf_params(path, model_config, abstract, table=table_for(kind, model_config),
                                      progress=progress, mesh=mesh, over_data=over_data)
    except CheckpointError as e:
        if kind == "drafter" and config.dflash2 is None and re.search(r"'(layers\.\d+\.\w+_conv|candidate_selector)\.", str(e)):
            raise CheckpointError(f"{e}: a DFlash2 drafter's tensor, but {path / 'config.json'} does not name "
                                  f"architectures DFlash2DraftModel") from None
        raise


def load_target(path: str | Path, *, dtype: str | None = None, progress: bool = False, mesh=None,
                over_data: bool = False, dequantize: bool = False):
    """Load a target model from an HF directory or one written by `dflash_jax.convert`.

    Returns (ModelConfig, params). dtype: "float32" | "bfloat16" (default: the checkpoint's).
    mesh: load each parameter straight into its sharding on that mesh (over_data: split over
    the mesh's `data` axis as well, as FSDP training keeps a frozen target). A quantized checkpoint's
    weights stay in its format (`dflash_jax.model.formats`); dequantize: into dtype as they load.
    """
    return load_model(path, "target", dtype=dtype, progress=progress, mesh=mesh, over_data=over_data,
                      dequantize=dequantize)


def load_drafter(path: str | Path, *, dtype: str | None = None, progress: bool = False, mesh=None):
    """Load a DFlash drafter (z-lab HF format or converted). Returns (DrafterConfig, params)."""
    return load_model(path, "drafter", dtype=dtype, progress=progress, mesh=mesh)


def convert(hf_dir: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False,
            progress: bool = False, dequantize: bool = False) -> Path:
    """HF directory (target or DFlash drafter) -> converted directory. Written under a
    temporary name and renamed at the end, so an interrupted conversion leaves nothing
    that looks complete. A quantized checkpoint's weights stay in its format (as `load_target`
    keeps them); dequantize: written dequantized into dtype, config.json without its quantization."""
    hf_dir, out = check_model_dir(hf_dir), Path(out)
    if is_converted(hf_dir):
        raise CheckpointError(f"{hf_dir} is already a converted checkpoint")
    if out.exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to overwrite it")
    config_dict = read_config_json(hf_dir / "config.json")
    kind = model_kind(config_dict)
    if kind == "target":
        config_dict = target_config_dict(hf_dir)  # as its weights are (FP8: the modules it left dense named)
    # Device arrays, not host numpy: orbax serialises numpy trees with more copies
    # (measured: peak 3.2x vs 2.1x the checkpoint for a 1 GB model).
    config, params = load_model(hf_dir, kind, dtype=dtype, progress=progress, dequantize=dequantize)
    dtype = config.model.dtype if kind == "drafter" else config.dtype
    quantized = kind == "target" and is_quantized(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save_converted(tmp, params, hf_dir=hf_dir, kind=kind, dtype=dtype, config_dict=config_dict, quantized=quantized)
        if out.exists():  # --force: replace only once the new one is complete
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out

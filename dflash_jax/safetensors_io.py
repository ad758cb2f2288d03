"""Reading and writing safetensors one tensor at a time, bfloat16 included, without torch.

The format is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}` and the raw
bytes. We read each tensor (or a range of its rows) with positioned reads into its own
buffer: at most one tensor is held beyond what the caller keeps, and nothing stays mapped.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from dflash_jax.errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}
NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where tensor data starts), checked against the
    file (`check_safetensors_header`)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise CheckpointError(f"{path} is not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read safetensors header of {path}: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    check_safetensors_header(path, header, size - 8 - n)
    return header, 8 + n


def check_safetensors_header(path: Path, header: dict, data_len: int):
    """Refuse, with a one-line CheckpointError naming the file and the tensor, a header whose
    tensors do not match the data they say they hold, before any is read: each tensor's dtype
    must be one we read, its shape a list of sizes, its byte size (its dtype's width x its
    elements) the length of its data_offsets; and the offsets, sorted, must tile the data after
    the header exactly (from 0, each tensor starting where the one before ends, the last ending at
    the file's end): no gap, no overlap, nothing past the end. A header edited by hand (a dtype
    of another width, shifted offsets) or a file cut short would otherwise load garbage."""
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: its header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where} has unsupported dtype {dtype}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise CheckpointError(f"{where} has a bad shape {json.dumps(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where} has bad data_offsets {json.dumps(offsets)}")
        size = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        for d in shape:
            size *= d
        if offsets[1] - offsets[0] != size:
            raise CheckpointError(f"{where}: its data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but "
                                  f"{dtype} {shape} is {size} bytes (a wrong dtype, shape or offsets)")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end} bytes before it"
            raise CheckpointError(f"{path}: tensor {name} starts at data byte {begin}, where the tensor before it "
                                  f"ends at {end}: it {what} (shifted data_offsets?)")
        end = stop
    if end != data_len:
        last = max(spans)[2] if spans else None
        what = f"the tensors end at data byte {end}" + (f" (tensor {last})" if last else "")
        raise CheckpointError(f"{path}: {what}, but the file holds {data_len} bytes of data "
                              f"({'cut short' if end > data_len else 'bytes no tensor accounts for'}; shifted "
                              f"data_offsets or a truncated file?)")


class LazyTensor:
    """A tensor of a safetensors file, read on demand: whole, or a range of rows (axis 0,
    contiguous on disk), so a host can read only the shard its devices need."""

    def __init__(self, path: Path, name: str, offset: int, shape: tuple[int, ...], dtype):
        self.path, self.name, self.offset = path, name, offset
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def read_rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        rows = self.shape[0] if self.shape else 1
        stop = rows if stop is None else stop
        row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        buf = bytearray((stop - start) * row_bytes)
        view, got = memoryview(buf), 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while got < len(buf):
                n = os.preadv(fd, [view[got:]], self.offset + start * row_bytes + got)
                if n <= 0:
                    raise CheckpointError(f"{self.path}: truncated data for tensor {self.name}")
                got += n
        finally:
            os.close(fd)
        out = np.frombuffer(buf, dtype=self.dtype)
        return out.reshape((stop - start,) + self.shape[1:]) if self.shape else out.reshape(())

    def read(self) -> np.ndarray:
        return self.read_rows()


class ArrayTensor:
    """An in-memory array with LazyTensor's interface (for pytorch_model.bin files)."""

    def __init__(self, array: np.ndarray):
        self.array, self.shape, self.dtype = array, tuple(array.shape), array.dtype

    def read_rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.array[start:stop]

    def read(self) -> np.ndarray:
        return self.array


def iter_lazy_tensors(path: str | Path) -> Iterator[tuple[str, LazyTensor]]:
    """(name, LazyTensor) for every tensor in the file; nothing is read yet."""
    header, start = read_header(path)  # checked against the file
    for name, info in header.items():
        begin, _ = info["data_offsets"]
        yield name, LazyTensor(Path(path), name, start + begin, info["shape"], SAFETENSORS_DTYPES[info["dtype"]])


def iter_tensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor in the file, one read each."""
    for name, tensor in iter_lazy_tensors(path):
        yield name, tensor.read()


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None):
    """Write tensors (numpy, bfloat16 allowed) to a safetensors file."""
    header, offset = {}, 0
    arrays = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in NAMES:
            raise CheckpointError(f"cannot save tensor {name} of dtype {arr.dtype}")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays[name] = arr
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays.values():
            f.write(arr.tobytes())

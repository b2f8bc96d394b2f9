"""Reading and validating safetensors headers, without trusting the file.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (an object
mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]}, plus an
optional "__metadata__" of strings), then the data section; offsets are relative to the
start of the data section. Every header is checked completely here before the loader
copies a byte of data, so a truncated, corrupt or hostile file fails with a message that
names the file and the tensor instead of crashing the daemon or reading out of bounds.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: Largest JSON header accepted (the safetensors format's own limit).
MAX_HEADER_BYTES = 100 * 1000 * 1000

#: safetensors dtype names -> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_FIX = "re-download or re-save the checkpoint"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded as it is; the message says which and why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a safetensors header (offsets relative to the data section)."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    #: The JSON header bytes exactly as stored (part of the model key).
    raw: bytes
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_offset(self) -> int:
        """File offset of the data section."""
        return 8 + len(self.raw)

    def file_offset(self, name: str) -> int:
        return self.data_offset + self.tensors[name].begin


def _fail(path: Path, problem: str, tensor: str | None = None) -> CheckpointError:
    where = f"{path}" + (f", tensor {tensor!r}" if tensor is not None else "")
    return CheckpointError(f"corrupt safetensors file {where}: {problem}; {_FIX}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and fully validate the header of the safetensors file at `path`.

    Raises CheckpointError naming the file, the tensor and the problem for: a file too
    short for the length prefix, a header length beyond the file or above
    MAX_HEADER_BYTES, a header that is not a JSON object, an unknown dtype, a malformed
    shape or data_offsets, offsets outside the data section, a byte range that does not
    match shape x dtype, and tensors that overlap. Gaps between tensors are allowed.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise _fail(path, f"file is {file_size} bytes, shorter than the 8-byte header length (truncated?)")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + header_len > file_size:
                raise _fail(
                    path, f"header length {header_len} reaches beyond the end of the {file_size}-byte file (truncated?)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e.strerror or e}") from e
    if len(raw) != header_len:
        raise _fail(path, "file shrank while its header was read")
    return parse_header(path, raw, file_size)


def parse_header(path: Path, raw: bytes, file_size: int) -> SafetensorsHeader:
    """Validate header bytes `raw` of a file of `file_size` bytes (see read_header)."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise _fail(path, f"header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"header is a JSON {type(obj).__name__}, not an object")

    data_size = file_size - 8 - len(raw)
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, spec in obj.items():
        if name == "__metadata__":
            if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
                raise _fail(path, "__metadata__ must be an object of strings")
            metadata = dict(spec)
            continue
        tensors[name] = _parse_tensor(path, name, spec, data_size)

    _check_overlaps(path, tensors)
    return SafetensorsHeader(path=path, file_size=file_size, raw=bytes(raw), tensors=tensors, metadata=metadata)


def _parse_tensor(path: Path, name: str, spec: object, data_size: int) -> TensorInfo:
    if not isinstance(spec, dict):
        raise _fail(path, "entry is not an object", name)
    dtype = spec.get("dtype")
    if dtype not in SAFETENSORS_DTYPES:
        raise _fail(path, f"unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})", name)
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"shape {shape!r} is not a list of non-negative integers", name)
    offsets = spec.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _fail(path, f"data_offsets {offsets!r} is not a pair of integers", name)
    begin, end = offsets
    if begin < 0 or begin > end:
        raise _fail(path, f"data_offsets [{begin}, {end}] are not an increasing pair of non-negative offsets", name)
    if end > data_size:
        raise _fail(
            path, f"data_offsets [{begin}, {end}] reach beyond the {data_size}-byte data section (truncated?)", name
        )
    numel = math.prod(shape)
    want = numel * SAFETENSORS_DTYPES[dtype].itemsize
    if end - begin != want:
        raise _fail(
            path,
            f"holds {end - begin} bytes but shape {shape} x {dtype} needs {want} (dtype/shape/nbytes mismatch)",
            name,
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_overlaps(path: Path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: (t.begin, t.end))
    for a, b in zip(spans, spans[1:]):
        if b.begin < a.end:
            raise _fail(
                path, f"bytes [{b.begin}, {b.end}) overlap tensor {a.name!r} at [{a.begin}, {a.end})", b.name
            )

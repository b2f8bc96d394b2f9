"""The tensor table: where each tensor of a resident model lives inside its slabs.

Shared by the daemon (which builds it while packing) and clients (which validate every
entry before viewing a tensor, so a corrupt or hostile table cannot make a client read
outside a slab).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# dtype names as they appear on the wire, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


#: Bytes per element of each wire dtype (read once per entry while decoding a table).
_ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def crc32_of(t: torch.Tensor) -> int:
    """The stored checksum of a tensor's bytes: CRC-32 for host tensors (unchanged), and
    for tensors in GPU memory the GPU checksum the loader records for GPU slabs (wsum32,
    computed on the device); see resident.daemon.checksum."""
    from resident.daemon.checksum import checksum_of

    return checksum_of(t)


class TensorTableError(ValueError):
    pass


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    slab: int
    offset: int
    nbytes: int
    crc32: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise TensorTableError("tensor entry without a name")
        itemsize = _ITEMSIZE.get(self.dtype)
        if itemsize is None:
            torch_dtype(self.dtype)   # raises, naming the supported dtypes
        shape, strides = self.shape, self.strides
        if len(shape) != len(strides):
            raise TensorTableError(f"{self.name}: shape {shape} and strides {strides} differ in rank")
        if (shape and min(shape) < 0) or (strides and min(strides) < 0):
            raise TensorTableError(f"{self.name}: negative shape or stride")
        numel = math.prod(shape)
        if numel * itemsize != self.nbytes:
            raise TensorTableError(
                f"{self.name}: nbytes {self.nbytes} != {numel} elements x {itemsize} bytes ({self.dtype})"
            )
        # The furthest element addressed must lie inside [offset, offset + nbytes)
        # (contiguous strides reach exactly its last element).
        if numel and strides != contiguous_strides(shape):
            span = (sum((d - 1) * s for d, s in zip(shape, strides)) + 1) * itemsize
            if span > self.nbytes:
                raise TensorTableError(f"{self.name}: strides {strides} reach beyond its {self.nbytes} bytes")
        if self.offset < 0 or self.slab < 0:
            raise TensorTableError(f"{self.name}: negative slab or offset")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


@dataclass
class TensorTable:
    entries: list[TensorEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise TensorTableError(f"duplicate tensor names in table: {dup[:5]}")

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def validate(self, slab_sizes: list[int]) -> None:
        """Every entry inside its slab, no two entries overlapping."""
        by_slab: dict[int, list[TensorEntry]] = {}
        for e in self.entries:
            if e.slab >= len(slab_sizes):
                raise TensorTableError(f"{e.name}: slab {e.slab} does not exist ({len(slab_sizes)} slabs)")
            if e.offset + e.nbytes > slab_sizes[e.slab]:
                raise TensorTableError(
                    f"{e.name}: bytes [{e.offset}, {e.offset + e.nbytes}) beyond slab {e.slab} of {slab_sizes[e.slab]} bytes"
                )
            by_slab.setdefault(e.slab, []).append(e)
        for slab, entries in by_slab.items():
            entries.sort(key=lambda e: e.offset)
            for a, b in zip(entries, entries[1:]):
                if a.offset + a.nbytes > b.offset:
                    raise TensorTableError(f"{a.name} and {b.name} overlap in slab {slab}")

    def views(self, slabs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over `slabs` (uint8 tensors), after validating the table.

        One `as_strided` per entry over the slab viewed once per dtype (instead of a slice,
        a dtype view and an as_strided each): the same tensors, a third of the torch calls.
        """
        self.validate([s.numel() for s in slabs])
        typed: dict[tuple[int, str], torch.Tensor | None] = {}
        out: dict[str, torch.Tensor] = {}
        for e in self.entries:
            size = _ITEMSIZE[e.dtype]
            key = (e.slab, e.dtype)
            base = typed.get(key, False)
            if base is False:
                base = typed[key] = _typed_view(slabs[e.slab], DTYPES[e.dtype])
            if base is not None and e.offset % size == 0:
                out[e.name] = base.as_strided(e.shape, e.strides, base.storage_offset() + e.offset // size)
            else:
                raw = slabs[e.slab][e.offset : e.offset + e.nbytes]
                out[e.name] = raw.view(DTYPES[e.dtype]).as_strided(e.shape, e.strides)
        return out

    # --- wire format -------------------------------------------------------------------
    def to_proto(self) -> list:
        from resident.protos.resident.v1 import weight_cache_pb2 as pb

        return [
            pb.TensorEntry(
                name=e.name, dtype=e.dtype, shape=list(e.shape), strides=list(e.strides),
                slab=e.slab, offset=e.offset, nbytes=e.nbytes, crc32=e.crc32,
            )
            for e in self.entries
        ]

    @classmethod
    def from_proto(cls, entries) -> "TensorTable":
        return cls([
            TensorEntry(
                name=p.name, dtype=p.dtype, shape=tuple(p.shape), strides=tuple(p.strides),
                slab=p.slab, offset=p.offset, nbytes=p.nbytes, crc32=p.crc32,
            )
            for p in entries
        ])


def _typed_view(slab: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The uint8 `slab` (whole elements of it) as `dtype`, or None where its start is not
    aligned to the element size (entries are then viewed one by one)."""
    size = dtype.itemsize
    if slab.storage_offset() % size or slab.data_ptr() % size:
        return None
    return slab[: slab.numel() // size * size].view(dtype)


# --- tensor-parallel shards ------------------------------------------------------------------
#: A sharded model's table names rank r's tensors `rank<r>.<stored name>`; an attach of rank r
#: sees its own tensors under their stored names, in its own slabs numbered from 0.
def rank_name(rank: int, name: str) -> str:
    return f"rank{rank}.{name}"


def select_rank(table: TensorTable, slab_ranks: tuple[int, ...] | list[int],
                rank: int) -> tuple[TensorTable, list[int]]:
    """Rank `rank`'s part of a sharded table: (its entries with the rank prefix removed and
    slab indices renumbered 0..k-1, the global indices of those k slabs in order)."""
    slabs = [i for i, r in enumerate(slab_ranks) if r == rank]
    local = {g: i for i, g in enumerate(slabs)}
    prefix = rank_name(rank, "")
    entries = []
    for e in table.entries:
        if not e.name.startswith(prefix):
            continue
        if e.slab not in local:
            raise TensorTableError(f"{e.name}: slab {e.slab} does not belong to rank {rank}")
        entries.append(TensorEntry(name=e.name[len(prefix):], dtype=e.dtype, shape=e.shape, strides=e.strides,
                                   slab=local[e.slab], offset=e.offset, nbytes=e.nbytes, crc32=e.crc32))
    return TensorTable(entries), slabs

"""The load plan: everything decided before a byte of tensor data is read.

Resolve the source, read and validate every safetensors header, check the layout and the
shapes, decide the storage dtype and the stored tensors (fused, fp8 weights with their
scales), and compute the key — for the model, a paired draft (whose tensors join the plan
as `draft.<name>`, after the vocabulary check of `pairing.py`) and its sharding.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from resident.daemon import layout, pairing, quant, sharding
from resident.daemon.model_key import compute_key, file_identity, pair_key, sharded_key
from resident.daemon.safetensors_io import CheckpointError, SafetensorsHeader, TensorInfo, read_header
from resident.daemon.source import ModelSource, index_weight_map, resolve_model

if TYPE_CHECKING:
    from resident.daemon.loader import LoadSpec

#: Source dtypes resident loads (unquantized floating-point checkpoints).
_FLOAT_SOURCES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True)
class _Part:
    """One checkpoint tensor to read: `info` in the file of `header`."""

    header: SafetensorsHeader
    info: TensorInfo


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as stored. A weight with `quantize` has its scale as the next StoredTensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: tuple[_Part, ...] = ()
    quantize: bool = False
    is_scale: bool = False

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class LoadPlan:
    """Everything decided before reading data."""

    source: ModelSource
    headers: list[SafetensorsHeader]
    dtype: str
    quantization: str
    key: str
    tensors: list[StoredTensor]
    stats: dict[str, tuple[int, int]] = field(default_factory=dict)
    own_key: str = ""  # the checkpoint's own key (before pairing or sharding); "" = `key`
    draft: LoadPlan | None = None  # a paired draft's own plan (its tensors are also in `tensors`, renamed)
    tensor_parallel_size: int = 1

    @property
    def bytes_to_read(self) -> int:
        return sum(p.info.nbytes for t in self.tensors for p in t.parts)


def key_for(spec: LoadSpec) -> tuple[str, ModelSource]:
    """The key load(spec) would produce, from headers and stat() alone (no data read)."""
    plan = plan_load(spec)
    return plan.key, plan.source


def plan_load(spec: LoadSpec) -> LoadPlan:
    """Resolve, validate every header, check layout and shapes, compute the key — for the
    model, its paired draft (vocabulary compatibility included) and its sharding."""
    own = _plan_one(spec.model, spec.revision, spec.hub_cache, spec.dtype, spec.quantization)
    n = spec.tensor_parallel_size
    if spec.draft is not None:
        if n > 1:
            raise ValueError(f"a draft model cannot be paired with a tensor-parallel target yet (--draft with "
                             f"--tensor-parallel-size {n}); load the target with tensor-parallel size 1, or "
                             "without --draft")
        draft = _plan_one(spec.draft, None, spec.hub_cache, spec.dtype, spec.quantization)
        pairing.check_vocab_compatible(own.source.folder, own.source.config, spec.model,
                                       draft.source.folder, draft.source.config, spec.draft)
        tensors = own.tensors + [replace(t, name=pairing.draft_name(t.name)) for t in draft.tensors]
        headers = list({str(h.path): h for h in own.headers + draft.headers}.values())
        return LoadPlan(own.source, headers, own.dtype, own.quantization, pair_key(own.key, draft.key), tensors,
                        {**own.stats, **draft.stats}, own_key=own.key, draft=draft)
    if n > 1:
        sharding.check_shardable(own.source.config, n)
        return replace(own, key=sharded_key(own.key, n), own_key=own.key, tensor_parallel_size=n)
    return own


def _plan_one(model: str, revision: str | None, hub_cache: str | None, dtype: str, quantization: str) -> LoadPlan:
    source = resolve_model(model, revision, hub_cache)
    stats = {str(p): file_identity(p) for p in source.files}
    headers = [read_header(p) for p in source.files]
    where = _locate_tensors(source, headers)
    names = set(where)
    fused = layout.plan(source.config, names)
    layout.check_shapes(source.config, {n: where[n].info.shape for n in names})
    dtype = _resolve_dtype(dtype, [where[s] for f in fused for s in f.sources])
    tensors = _storage_plan(fused, where, torch_dtype_of(dtype), quantization)
    key = compute_key(source, headers, dtype, quantization)
    return LoadPlan(source, headers, dtype, quantization, key, tensors, stats)


def torch_dtype_of(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _locate_tensors(source: ModelSource, headers: list[SafetensorsHeader]) -> dict[str, _Part]:
    where: dict[str, _Part] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if name in where:
                raise CheckpointError(
                    f"tensor {name!r} is stored twice, in {where[name].header.path} and {h.path}; "
                    f"re-download or re-save the checkpoint"
                )
            where[name] = _Part(h, info)
    weight_map = index_weight_map(source.folder)
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in where or where[name].header.path.name != fname:
                found = where[name].header.path.name if name in where else "no file"
                raise CheckpointError(
                    f"{source.folder}/model.safetensors.index.json puts tensor {name!r} in {fname}, but it is in "
                    f"{found}; re-download or re-save the checkpoint"
                )
    return where


def _resolve_dtype(requested: str, parts: list[_Part]) -> str:
    """`auto` is the checkpoint's dominant floating dtype (by bytes); float64 becomes float32."""
    for p in parts:
        if p.info.dtype not in _FLOAT_SOURCES:
            raise CheckpointError(
                f"tensor {p.info.name!r} in {p.header.path} is {p.info.dtype}; resident loads unquantized "
                f"floating-point checkpoints (F32, F16, BF16) and quantizes on load (--quantization)"
            )
    if requested != "auto":
        return requested
    by_dtype: dict[str, int] = {}
    for p in parts:
        by_dtype[p.info.dtype] = by_dtype.get(p.info.dtype, 0) + p.info.nbytes
    top = max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "F32"
    return {"F32": "float32", "F64": "float32", "F16": "float16", "BF16": "bfloat16"}[top]


def _storage_plan(
    fused: list[layout.FusedTensor], where: dict[str, _Part], dtype: torch.dtype, quantization: str
) -> list[StoredTensor]:
    out: list[StoredTensor] = []
    for f in fused:
        parts = tuple(where[s] for s in f.sources)
        shape = _fused_shape(f.name, parts)
        if f.quantizable and quantization == "fp8_per_tensor":
            out.append(StoredTensor(f.name, quant.FP8_DTYPE, shape, parts, quantize=True))
            out.append(StoredTensor(quant.scale_name(f.name), torch.float32, (), is_scale=True))
        else:
            out.append(StoredTensor(f.name, dtype, shape, parts))
    return out


def _fused_shape(name: str, parts: tuple[_Part, ...]) -> tuple[int, ...]:
    first = parts[0].info.shape
    if len(parts) == 1:
        return first
    for p in parts:
        if len(p.info.shape) == 0 or p.info.shape[1:] != first[1:]:
            raise layout.LayoutError(
                f"cannot fuse {[q.info.name for q in parts]} into {name}: shapes "
                f"{[q.info.shape for q in parts]} differ beyond the first dimension"
            )
    return (sum(p.info.shape[0] for p in parts),) + first[1:]

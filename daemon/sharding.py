"""Tensor-parallel sharding of the stored (fused) Llama-family layout.

Pure functions over stored names (see `layout.py`), shared by the daemon (which places rank
r's shard on `devices[r]`) and the engine's tests (which shard a full model in-process):

- column-parallel (dim 0): `qkv_proj` rows as `[q_r; k_r; v_r]` (each part split by whole
  heads, so rank r computes its own heads), `gate_up_proj` as `[gate_r; up_r]` (so the
  rank-local activation still sees `[gate | up]`), and `qkv_proj.bias` split like its rows;
- row-parallel (dim 1): `o_proj`, `down_proj` — each rank's partial product is summed by an
  all-reduce in the engine; `o_proj.bias` is kept whole on every rank and added once, after
  the all-reduce;
- vocab-parallel (dim 0): `embed_tokens` and `lm_head` split by contiguous vocab ranges;
- replicated: norms, Qwen3's q/k norms, fp8 `*.weight_scale` (one per-tensor scale of the
  full fused weight: dequantizing a shard with it is exact), and `draft.*` tensors.

`shard_tensor(..., rank, tp_size)` for all ranks, put back together, is the full tensor (no
padding), so TP=N computes what TP=1 does up to summation order.
"""
from __future__ import annotations

import torch

from resident.daemon.layout import LayoutError, head_dim

#: Suffixes of stored tensors split along dim 0 (output rows / vocab).
_COLUMN = (".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.bias", ".mlp.gate_up_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
#: Suffixes of stored tensors split along dim 1 (input columns).
_ROW = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")


def _dims(config: dict) -> dict[str, int]:
    heads = int(config["num_attention_heads"])
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "intermediate_size": int(config["intermediate_size"]),
        "vocab_size": int(config["vocab_size"]),
    }


def check_shardable(config: dict, tp_size: int) -> None:
    """Raise LayoutError naming the first config field `tp_size` does not divide (and the fix)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise LayoutError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    try:
        dims = _dims(config)
    except KeyError as e:
        raise LayoutError(f"config.json lacks {e.args[0]!r}, needed to shard the model") from None
    for field, value in dims.items():
        if value % tp_size:
            valid = [n for n in range(1, value + 1) if all(v % n == 0 for v in dims.values())]
            raise LayoutError(
                f"tensor_parallel_size {tp_size} does not divide {field} ({value}); "
                f"use a tensor-parallel size that divides the model's heads, kv heads, "
                f"intermediate size and vocabulary: {', '.join(map(str, valid))}"
            )


def shard_dim(name: str) -> int | None:
    """0 for column- and vocab-parallel tensors, 1 for row-parallel ones, None if replicated."""
    if name.startswith("draft."):
        return None
    if name in _VOCAB or name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def _check_rank(rank: int, tp_size: int) -> None:
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside the tensor-parallel group of size {tp_size}")


def shard_shape(name: str, shape: tuple[int, ...], config: dict, tp_size: int) -> tuple[int, ...]:
    """The shape of every rank's shard of stored tensor `name` whose full shape is `shape`."""
    check_shardable(config, tp_size)
    shape = tuple(int(s) for s in shape)
    dim = shard_dim(name)
    if dim is None or tp_size == 1:
        return shape
    if len(shape) <= dim or shape[dim] % tp_size:
        raise LayoutError(f"tensor {name} of shape {shape} cannot be split {tp_size} ways along dim {dim}")
    out = list(shape)
    out[dim] //= tp_size
    return tuple(out)


def _part_sizes(name: str, config: dict) -> list[int]:
    """The row blocks a fused dim-0 tensor is made of, each split separately."""
    if name.endswith((".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.bias")):
        dims = _dims(config)
        d = head_dim(config)
        return [dims["num_attention_heads"] * d, dims["num_key_value_heads"] * d, dims["num_key_value_heads"] * d]
    if name.endswith(".mlp.gate_up_proj.weight"):
        inter = _dims(config)["intermediate_size"]
        return [inter, inter]
    return []


def shard_tensor(name: str, full: torch.Tensor, config: dict, rank: int, tp_size: int) -> torch.Tensor:
    """Rank `rank`'s shard of stored tensor `name` (a new contiguous tensor, `full`'s dtype/device).

    Replicated tensors come back as a contiguous copy-free view when `full` is contiguous
    (callers that need their own memory copy anyway).
    """
    want = shard_shape(name, tuple(full.shape), config, tp_size)
    _check_rank(rank, tp_size)
    dim = shard_dim(name)
    if dim is None or tp_size == 1:
        return full.contiguous()
    parts = _part_sizes(name, config)
    if parts:
        if sum(parts) != full.shape[0]:
            raise LayoutError(
                f"tensor {name} has {full.shape[0]} rows but config.json implies {sum(parts)} "
                f"({' + '.join(map(str, parts))}); the config and the weights do not belong together"
            )
        pieces = []
        for block in full.split(parts, dim=0):
            n = block.shape[0] // tp_size
            pieces.append(block[rank * n : (rank + 1) * n])
        out = torch.cat(pieces, dim=0)
    else:
        n = full.shape[dim] // tp_size
        out = full.narrow(dim, rank * n, n).contiguous()
    if tuple(out.shape) != want:  # an invariant of the two functions above
        raise AssertionError(f"shard of {name}: shape {tuple(out.shape)} != {want}")
    return out

"""Each tensor-parallel rank's place in its group (see tp_executor.py's module doc), used by
rank 0 and by the child ranks alike: the ranks' devices (`rank_devices`), the model's
rank-local config checked before any weights (`check_tp_config`), and a rank's own shard of
the weights (`open_rank_store`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from resident.daemon.loader import LoadSpec
from resident.worker.config import ModelConfig
from resident.worker.weight_store import WeightStore, open_store

logger = logging.getLogger("resident.worker.tp_executor")   # its lines kept their logger name


def rank_devices(device: torch.device, size: int) -> list[str]:
    """The device of every rank: the CPU for all, or `size` consecutive GPUs from rank 0's."""
    if device.type != "cuda":
        return ["cpu"] * size
    first = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if first + size > count:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs from cuda:{first} (one per rank), but "
                         f"this process sees {count} (cuda:0..cuda:{count - 1}); lower --tensor-parallel-size, "
                         "pick an earlier --device, or adjust CUDA_VISIBLE_DEVICES")
    return [f"cuda:{first + r}" for r in range(size)]


def check_tp_config(spec: LoadSpec, size: int) -> ModelConfig:
    """The rank-local config of `spec`'s model, read from its config.json before any weights;
    raises ValueError naming the field `size` does not divide."""
    from resident.daemon.source import resolve_model

    source = resolve_model(spec.model, revision=spec.revision, hub_cache=spec.hub_cache)
    config = json.loads((Path(source.folder) / "config.json").read_text())
    return ModelConfig.from_hf(config).for_tp(size)


def open_rank_store(spec: LoadSpec, preload: str, socket_path: str | None, devices: list[str], rank: int,
                    verify_sample: int = 16) -> WeightStore:
    """Rank `rank`'s shard of `spec`'s model, attached from the daemon (which holds the model as
    len(devices) shards, rank r's on devices[r] when they are GPUs) or loaded here, per `preload`;
    its checksums verified."""
    placed = tuple(devices) if devices[0].startswith("cuda") else ()
    store = open_store(dataclasses.replace(spec, tensor_parallel_size=len(devices), devices=placed), preload,
                       socket_path, client_name=f"resident-serve-tp{rank}", device=devices[rank], tp_rank=rank)
    try:
        if rank > 0:   # rank 0's is verified (and timed) by the serving process itself
            store.verify(verify_sample)
    except BaseException:
        store.close()
        raise
    logger.info("rank %d/%d: its shard holds %.1f MB (%s)", rank, len(devices),
                sum(t.numel() * t.element_size() for t in store.tensors.values()) / 1e6, store.source)
    return store


__all__ = ["check_tp_config", "open_rank_store", "rank_devices"]

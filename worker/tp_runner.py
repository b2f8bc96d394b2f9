"""The ModelRunner of a tensor-parallel rank (see tp_executor.py's module doc): every rank
builds the same one over its own shard (`build_rank_runner`, also the KV plan's probe runner:
`probe_runner`), and rank 0 wraps its own in `TPRunner`, which sends every forward-running
call to the other ranks before running it itself, so all ranks issue the same collectives in
the same order.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from resident.worker.config import ModelConfig
from resident.worker.distributed import ParallelGroup
from resident.worker.tp_commands import compact
from resident.worker.tp_kv import grow_in_lockstep


class TPRunner:
    """Rank 0's ModelRunner of a TP group: forward-running methods go to every rank."""

    def __init__(self, group: ParallelGroup, runner: Any, send: Callable[[tuple], None],
                 on_failure: Callable[[str, BaseException], None] | None = None) -> None:
        """`on_failure(method, error)`: rank 0's own part of a forward-running call raised —
        the other ranks may be waiting in that call's collectives, which rank 0 will not join."""
        self.group = group
        self.runner = runner
        self._send = send
        self._on_failure = on_failure

    def _local(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.runner, method)(*args)
        except BaseException as e:
            if self._on_failure is not None and method != "close":
                self._on_failure(method, e)
            raise

    def _all(self, method: str, *args: Any) -> Any:
        self._send(("call", method, args))
        return self._local(method, *args)

    def _step(self, method: str, out: Any) -> Any:
        self._send(("call", method, (compact(out),)))
        return self._local(method, out)

    #: Async scheduling (engine.py): every rank runs `execute_async` and samples the same tokens
    #: (identical all-gathered logits; per-request seeds, and one shared `sampler_seed` for the
    #: rest), so each substitutes its own copy of the previous step's tokens for the placeholders.
    supports_async_scheduling = True

    def execute(self, out: Any) -> Any:
        return self._step("execute", out)

    def execute_async(self, out: Any) -> Any:
        return self._step("execute_async", out)

    def logits(self, out: Any) -> torch.Tensor:
        return self._step("logits", out)

    def warmup(self) -> None:
        self._all("warmup")

    def capture_graphs(self) -> float:
        return self._all("capture_graphs")

    def idle_work(self) -> bool:
        """Every rank captures the same graph (they captured the same sizes at start); the
        captures' collectives need all of them."""
        return self._all("idle_work")

    def profile_peak_bytes(self) -> int:
        return self._all("profile_peak_bytes")

    def close(self) -> None:
        self._all("close")

    def map_kv_blocks(self, num_blocks: int) -> None:
        """Every rank maps `num_blocks` blocks off its stepping thread (rank 0: the caller's,
        the KV growth thread; the others: a thread of their own, see `tp_kv.KVMapper`)."""
        self._send(("map", num_blocks))
        self.runner.map_kv_blocks(num_blocks)

    def grow_kv_cache(self, num_blocks: int) -> None:
        """Every rank takes `num_blocks` blocks between the same two steps (the command stream
        is ordered), or none does (`tp_kv.grow_in_lockstep`). Engine thread, between steps."""
        self._send(("grow", num_blocks))
        grow_in_lockstep(self.group, self.runner, num_blocks, None)

    def __getattr__(self, name: str) -> Any:
        # Everything else (kv_cache, num_blocks, model_config, ...) is rank 0's own.
        return getattr(self.runner, name)


def build_rank_runner(group: ParallelGroup, model_config: ModelConfig, weights: Mapping[str, torch.Tensor],
                      device: str, kwargs: dict) -> Any:
    """This rank's ModelRunner over its shard; `kwargs` (engine_config included) as
    `TPGroup.build_runner` sent them."""
    from resident.worker.model_runner import ModelRunner

    return ModelRunner(model_config, kwargs.pop("engine_config"), weights, device=device, parallel=group, **kwargs)


def probe_runner(group: ParallelGroup, model_config: ModelConfig, weights: Mapping[str, torch.Tensor], device: str,
                 kw: Mapping[str, Any], engine_config: Any) -> Any:
    """The KV plan's probe runner on this rank (`tp_kv.plan_rank_kv`; `kw`: the plan's keywords)."""
    return build_rank_runner(group, model_config, weights, device,
                             {"engine_config": engine_config, "cuda_graphs": kw["cuda_graphs"]})


__all__ = ["TPRunner", "build_rank_runner", "probe_runner"]

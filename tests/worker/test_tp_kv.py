"""The KV cache of a tensor-parallel group (worker/tp_kv.py), on CPU with the GPU queries
stubbed: the same sizing logic a 2-GPU group runs, seen from rank 0 with the other rank's
answers to the group's all-min scripted.

- The activation/graph headroom comes from the KV profile cache when rank 0 found it there
  (no rank builds a probe), else it is measured, the largest rank's value is used by all and
  stored under a key of the rank-local config and the TP size (a TP=1 worker of the same
  model, or a TP=4 group, does not hit it);
- every rank gets the smallest rank's block count, and an address reservation for growth;
- growth after ready is all-or-none: one rank that could not map the blocks stops every
  rank from taking them.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from resident.worker import gpu_kv_plan
from resident.worker import tp_kv
from resident.worker.config import ModelConfig
from resident.worker.distributed import ParallelError
from resident.worker.kv_profile_cache import KvProfileCache
from resident.worker.kv_sizing import ModelDoesNotFit

MiB = 2**20
GPU = "NVIDIA H200 (stub)"
KW = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, utilization=0.9,
          cuda_graphs="lazy", num_kv_blocks=None)


class ScriptedGroup:
    """Rank 0 of a 2-rank group whose peer answers every all_min with the next scripted value."""

    rank, size = 0, 2

    def __init__(self, peer: list[int]) -> None:
        self.peer = list(peer)
        self.seen: list[int] = []

    def all_min(self, value: int) -> int:
        self.seen.append(value)
        return min(value, self.peer.pop(0))

    def wait_comm_warmup(self) -> None:
        self.comm_waited = True


class Probe:
    def __init__(self, peak: int, built: list) -> None:
        self.peak = peak
        built.append(self)
        self.closed = False

    def profile_peak_bytes(self) -> int:
        return self.peak

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def stub_gpu(monkeypatch):
    """A 16 GiB GPU with 10 GiB free, 2 MiB granularity; no CUDA needed."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: GPU)
    monkeypatch.setattr(gpu_kv_plan, "gpu_memory_info", lambda index: (10 << 30, 16 << 30))
    monkeypatch.setattr(gpu_kv_plan, "vmm_granularity", lambda index: 2 * MiB)


@pytest.fixture
def rank_local(tiny_model):
    path = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    full = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = {"model.embed_tokens.weight": torch.empty(128, 64, dtype=torch.bfloat16)}
    return full, full.for_tp(2), weights


def test_measured_headroom_is_the_largest_ranks_and_is_cached_for_the_same_group_only(stub_gpu, rank_local,
                                                                                    tmp_path):
    full, local, weights = rank_local
    cache = KvProfileCache(tmp_path / "kv-profile.json")
    built: list[Probe] = []
    # The peer measured 300 MiB (all_min of negatives = the largest), and could hold 40 blocks.
    group = ScriptedGroup([-300 * MiB, 40])
    plan = tp_kv.plan_rank_kv(group, local, weights, "cuda:0", dict(KW), lambda ec: Probe(100 * MiB, built),
                              None, cache)
    assert len(built) == 1 and built[0].closed
    assert plan.headroom_source == "measured" and plan.budget.headroom_bytes == 300 * MiB
    assert set(plan.timings) >= {"comm wait", "measure", "probe_build", "profile_forward"}
    assert group.comm_waited                              # NCCL's buffers exist before free memory is read
    assert plan.num_kv_blocks == 40                       # the smallest rank's
    assert plan.max_num_kv_blocks == 16 * 8               # room to grow to max_num_seqs full requests

    key = tp_kv.tp_headroom_key(group, local, weights, "cuda:0", KW)
    assert key.tensor_parallel_size == 2 and json.loads(key.model)["num_heads"] == full.num_heads // 2
    assert cache.lookup(key) == 300 * MiB
    # Not for a TP=1 worker of the same model, nor for another group size.
    tp1 = tp_kv.tp_headroom_key(type("G", (), {"size": 1})(), full, weights, "cuda:0", KW)
    tp4 = tp_kv.tp_headroom_key(type("G", (), {"size": 4})(), local, weights, "cuda:0", KW)
    assert cache.lookup(tp1) is None and cache.lookup(tp4) is None


def test_cached_headroom_builds_no_probe_on_any_rank(stub_gpu, rank_local):
    _, local, weights = rank_local
    built: list[Probe] = []
    group = ScriptedGroup([10**9])
    plan = tp_kv.plan_rank_kv(group, local, weights, "cuda:0", dict(KW, cache_lookup_s=0.001),
                              lambda ec: Probe(1, built), 250 * MiB)
    assert built == [] and group.seen == [plan.num_kv_blocks]   # one all_min: the block count, no headroom vote
    assert plan.headroom_source == "cached" and plan.budget.headroom_bytes == 250 * MiB
    assert plan.timings["cache_lookup"] == 0.001


def test_too_little_memory_on_one_rank_names_the_fix(stub_gpu, rank_local, monkeypatch):
    _, local, weights = rank_local
    monkeypatch.setattr(gpu_kv_plan, "gpu_memory_info", lambda index: (1 << 30, 16 << 30))   # 15 of 16 GiB used
    with pytest.raises(ModelDoesNotFit, match="raise --gpu-memory-utilization"):
        tp_kv.plan_rank_kv(ScriptedGroup([]), local, weights, "cuda:0", dict(KW), lambda ec: Probe(1, []), MiB)


class Runner:
    def __init__(self, fail: bool = False) -> None:
        self.grown: list[int] = []
        self.fail = fail

    @property
    def num_blocks(self) -> int:
        return self.grown[-1] if self.grown else 64

    def grow_kv_cache(self, n: int) -> None:
        if self.fail:
            raise MemoryError("cannot allocate the new blocks")
        self.grown.append(n)


class VotingGroup:
    """Rank 0 of a 2-rank group whose peer answers every all_gather_object with the next
    scripted value (its failure cause, or None)."""

    rank, size = 0, 2

    def __init__(self, peer: list[str | None]) -> None:
        self.peer = list(peer)
        self.seen: list[str | None] = []

    def all_gather_object(self, obj):
        self.seen.append(obj)
        return [obj, self.peer.pop(0)]


def test_growth_is_all_or_none_and_names_the_rank_that_failed():
    runner = Runner()
    tp_kv.grow_in_lockstep(VotingGroup([None, None]), runner, 96, None)
    assert runner.grown == [96]

    with pytest.raises(ParallelError, match=r"rank 1 could not map them \(MemoryError: cuMemCreate\)"):
        tp_kv.grow_in_lockstep(VotingGroup(["MemoryError: cuMemCreate"]), runner, 128, None)
    group = VotingGroup([None])
    with pytest.raises(ParallelError, match=r"rank 0 could not map them \(MemoryError: out of memory\)"):
        tp_kv.grow_in_lockstep(group, runner, 128, MemoryError("out of memory"))
    assert group.seen == ["MemoryError: out of memory"]   # it told the others, so they do not grow either
    assert runner.grown == [96]

    # Taking the blocks fails on one rank after every rank mapped them: all learn of it.
    group = VotingGroup([None, None])
    with pytest.raises(ParallelError, match=r"rank 0 could not take them \(MemoryError: cannot allocate"):
        tp_kv.grow_in_lockstep(group, Runner(fail=True), 128, None)
    assert group.seen == [None, "MemoryError: cannot allocate the new blocks"]
    with pytest.raises(ParallelError, match=r"rank 1 could not take them"):
        tp_kv.grow_in_lockstep(VotingGroup([None, "MemoryError: x"]), runner, 128, None)
    assert runner.grown == [96, 128]   # this rank took them; the engine hands out none (it raised)
    tp_kv.grow_in_lockstep(VotingGroup([None, None]), runner, 128, None)   # a retry does not grow it twice
    assert runner.grown == [96, 128]


def test_mapper_maps_off_the_calling_thread_and_reports_its_error_once():
    import threading

    seen: list[tuple[int, str]] = []

    class Slow:
        def map_kv_blocks(self, n: int) -> None:
            seen.append((n, threading.current_thread().name))
            if n > 100:
                raise MemoryError("cuMemCreate failed")

    mapper = tp_kv.KVMapper()
    mapper.start(Slow(), 64)
    assert mapper.wait() is None
    mapper.start(Slow(), 128)
    assert isinstance(mapper.wait(), MemoryError)
    assert mapper.wait() is None
    assert [n for n, _ in seen] == [64, 128] and all(name == "tp-kv-map" for _, name in seen)


# --- a real 2-rank group over gloo whose rank 1 fails -----------------------------------------
#: Stands in for the child ranks' interpreter: makes rank 1's mapping (`map`: what a GPU rank
#: does on its mapper thread), taking of the blocks (`take`: where a CPU cache allocates) or
#: step (`execute`) fail (`none`: nothing), then runs the real child
#: (`python -m resident.worker.tp_executor SPEC`).
INJECT = '''
import json, runpy, sys
from resident.worker.kv_cache import KVCache
from resident.worker.model_runner import ModelRunner
where, rank, module, spec = sys.argv[1], int(sys.argv[2]), sys.argv[4], sys.argv[5]
if json.loads(spec)["rank"] == rank:
    def fail(self, n):
        raise MemoryError(f"cannot map {n} blocks (injected)")
    if where == "map":
        ModelRunner.map_kv_blocks = fail
    elif where == "take":
        KVCache.grow = fail
    elif where == "execute":
        def fail_step(self, out):
            raise MemoryError("out of memory in the forward (injected)")
        ModelRunner.execute = fail_step
sys.argv = [module, spec]
runpy.run_module(module, run_name="__main__", alter_sys=True)
'''
BOUND_S = 45
CONFIG = dict(block_size=8, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((9, 21))]


def greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    from resident.worker.sampling_params import SamplingParams

    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        tokens[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def run_with_failing_rank1(path, tmp_path, monkeypatch, where: str, scenario) -> None:
    """`scenario(engine)` on rank 0 of a 2-rank CPU group of `path` whose rank 1 fails at
    `where`; fails the test if it has not returned after BOUND_S seconds."""
    import sys
    import threading

    from resident.daemon.loader import LoadSpec
    from resident.worker.engine import LLMEngine
    from resident.worker.engine_config import EngineConfig
    from resident.worker.serve_config import ServeConfig
    from resident.worker.tp_executor import TPGroup

    inject = tmp_path / "inject.py"
    inject.write_text(INJECT)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {inject} {where} 1 "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))   # TPGroup spawns the children with it
    config = EngineConfig(**CONFIG)
    serve = ServeConfig(model=str(path), preload="off", device="cpu", tensor_parallel_size=2, cpu_threads=1,
                        verify_sample=-1)

    def run() -> None:
        store = group.open_store()
        runner = group.build_runner(store.tensors, engine_config=config, max_num_kv_blocks=64)
        try:
            scenario(LLMEngine(config, runner))
        finally:
            try:
                runner.close()
            except ParallelError:   # rank 1 is gone (the step test)
                runner.runner.close()
            store.close()

    group = TPGroup(serve, LoadSpec(str(path)), torch.device("cpu"))
    try:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(BOUND_S)
        if worker.is_alive():
            group._stopping.set()             # not a dead rank to exit for: the test fails instead
            for p in group._procs:
                p.kill()
            pytest.fail(f"rank 0 still waits {BOUND_S} s after rank 1 failed at {where!r}")
    finally:
        group.close()


def record_watcher_exits(monkeypatch):
    """The exit codes rank 0's rank watchers ask for (os._exit recorded, not done) and an
    event set at the first."""
    import logging
    import os
    import threading

    exited: list[int] = []
    watched = threading.Event()

    def record_exit(code: int) -> None:
        exited.append(code)
        watched.set()

    monkeypatch.setattr(os, "_exit", record_exit)          # the watcher's exit: not this test process's
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    return exited, watched


@pytest.mark.parametrize("where", ["map", "take"])
def test_a_rank_that_cannot_grow_fails_the_growth_on_every_rank_and_the_group_keeps_serving(
        tiny_model, tmp_path, monkeypatch, capfd, where):
    """Rank 1 of a real 2-rank CPU group cannot map (or take) the new KV blocks: the growth
    fails within the step on rank 0 with an error naming rank 1 and its cause (no rank is
    left waiting in a collective until the 600 s gloo timeout), the engine keeps its block
    count, and both ranks go on serving the same greedy tokens as before."""
    result: dict = {}

    def scenario(engine) -> None:
        result["before"] = greedy(engine, PROMPTS)
        engine.prepare_kv_blocks(64)          # the growth thread's half
        try:
            engine.add_kv_blocks(48)          # the engine thread's half, between two steps
        except ParallelError as e:
            result["error"] = str(e)
        result["blocks"] = engine.num_kv_blocks
        result["after"] = greedy(engine, PROMPTS)

    run_with_failing_rank1(tiny_model("qwen2"), tmp_path, monkeypatch, where, scenario)
    assert result.get("error") and re.search(rf"rank 1 could not {where} them \(MemoryError: cannot map 64.*"
                                             r"injected\)", result["error"]), result
    assert "rank 0" not in result["error"]
    assert result["blocks"] == 16
    assert result["after"] == result["before"] and all(len(t) == 12 for t in result["after"])
    assert re.search(r"tp-rank1 WARNING .*rank 1: KV cache growth to 64 blocks failed", capfd.readouterr().err)


def test_a_rank_whose_step_fails_ends_the_group_at_once(tiny_model, tmp_path, monkeypatch, capfd):
    """Rank 1's forward raises while rank 0 is in the step's collectives: rank 1 exits (it
    will not join them), so rank 0's step fails within seconds and its rank watcher exits
    the worker with RANK_DIED_EXIT for the supervisor, instead of waiting 600 s."""
    from resident.worker.tp_executor import RANK_DIED_EXIT

    exited, watched = record_watcher_exits(monkeypatch)
    errors: list[BaseException] = []

    def scenario(engine) -> None:
        try:
            greedy(engine, PROMPTS)
        except Exception as e:  # noqa: BLE001 - what rank 0's engine thread would see
            errors.append(e)
        watched.wait(BOUND_S / 2)

    run_with_failing_rank1(tiny_model("qwen2"), tmp_path, monkeypatch, "execute", scenario)
    assert errors, "rank 0's step returned although rank 1 never joined its collectives"
    assert exited == [RANK_DIED_EXIT]
    assert re.search(r"rank 1: execute failed \(MemoryError: out of memory in the forward \(injected\)\); "
                     r"this rank exits", capfd.readouterr().err)


def test_rank_0s_failing_step_ends_the_other_ranks_at_once(tiny_model, tmp_path, monkeypatch, caplog):
    """Rank 0's own forward raises after the step went to rank 1, which then waits in the
    step's collectives for a rank 0 that never joins: rank 0 ends rank 1 at once and its
    watcher exits the worker with RANK_DIED_EXIT, instead of rank 1 waiting out 600 s."""
    from resident.worker.model_runner import ModelRunner
    from resident.worker.tp_executor import RANK_DIED_EXIT

    exited, watched = record_watcher_exits(monkeypatch)
    errors: list[BaseException] = []

    def scenario(engine) -> None:
        def fail_step(self, out):
            raise MemoryError("out of memory in rank 0's forward (injected)")

        monkeypatch.setattr(ModelRunner, "execute", fail_step)   # this process is rank 0 only
        try:
            greedy(engine, PROMPTS)
        except MemoryError as e:
            errors.append(e)
        watched.wait(BOUND_S / 2)

    run_with_failing_rank1(tiny_model("qwen2"), tmp_path, monkeypatch, "none", scenario)
    assert errors and exited == [RANK_DIED_EXIT]
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) ended after rank 0's execute failed \(MemoryError: out "
                     r"of memory in rank 0's forward \(injected\)\)", caplog.text)

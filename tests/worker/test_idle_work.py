"""Start-up work left for after ready: in lazy mode the decode graphs of batch sizes 2, 4
and 8 are captured by the engine thread while no request runs (DecodeGraphs.capture_idle,
LLMEngine.idle_work, AsyncEngine's loop), one at a time, so a request waits for one capture
at most; a failing unit is logged and serving goes on."""
from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch
from test_kv_growth import GrowableRunner, expected, prompt

from resident.worker.async_engine import AsyncEngine
from resident.worker.cuda_graphs import DecodeGraphs
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.sampling_params import SamplingParams


def _graphs(mode: str, max_num_seqs: int = 24) -> tuple[DecodeGraphs, list[int]]:
    graphs = DecodeGraphs(lambda *a: torch.zeros(1), max_num_seqs=max_num_seqs, max_blocks_per_seq=4, pad_slot=0,
                          pad_block=0, device=torch.device("cpu"), mode=mode)
    captured: list[int] = []

    def capture(size: int) -> None:   # a CPU stand-in for the CUDA capture
        captured.append(size)
        graphs._graphs[size] = (None, None)

    graphs.capture = capture
    return graphs, captured


def test_lazy_mode_captures_batch_1_before_ready_and_the_small_sizes_after() -> None:
    graphs, captured = _graphs("lazy")
    graphs.capture_startup()
    assert captured == [1] and graphs.idle_pending == (8, 4, 2)
    graphs.capture(4)   # a batch of 3-4 came first: captured on first use (DecodeGraphs.run)
    assert graphs.idle_pending == (8, 2)
    assert graphs.capture_idle() is True and captured[-1] == 8
    assert graphs.capture_idle() is False and captured[-1] == 2
    assert graphs.capture_idle() is False and captured == [1, 4, 8, 2]   # nothing left: no capture


def test_eager_mode_captures_everything_before_ready_and_off_nothing() -> None:
    graphs, captured = _graphs("eager")
    graphs.capture_startup()
    assert captured == [24, 16, 8, 4, 2, 1] and graphs.idle_pending == ()
    graphs, captured = _graphs("off")
    graphs.capture_startup()
    assert captured == [] and graphs.idle_pending == () and graphs.capture_idle() is False


class IdleRunner(GrowableRunner):
    """GrowableRunner with `units` of idle work, recording the thread and whether a request ran."""

    def __init__(self, config: EngineConfig, units: int, fail: bool = False) -> None:
        super().__init__(config)
        self.units, self.fail = units, fail
        self.idle_calls: list[str] = []
        self.executing = False

    def execute(self, out):
        self.executing = True
        try:
            return super().execute(out)
        finally:
            self.executing = False

    def idle_work(self) -> bool:
        assert not self.executing
        self.idle_calls.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("capture failed: operation not permitted when stream is capturing")
        self.units -= 1
        return self.units > 0


async def _generate(ae: AsyncEngine, rid: str, p: list[int]) -> list[int]:
    got: list[int] = []
    async for out in ae.generate(rid, p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)):
        got += out.new_token_ids
    return got


CONFIG = EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=32, max_num_batched_tokens=64)


def _serve(runner: IdleRunner) -> list[int]:
    engine = LLMEngine(CONFIG, runner)

    async def main() -> list[int]:
        ae = AsyncEngine(engine)
        ae.start()
        got = await _generate(ae, "r", prompt(3, 10))
        for _ in range(200):   # the rest of the idle work, after the request
            if runner.units <= 0 or runner.fail:
                break
            await asyncio.sleep(0.01)
        ae.shutdown()
        return got

    return asyncio.run(main())


def test_the_engine_thread_runs_idle_work_while_no_request_runs() -> None:
    runner = IdleRunner(CONFIG, units=3)
    assert _serve(runner) == expected(prompt(3, 10), 6)
    assert runner.idle_calls == ["resident-engine"] * 3 and runner.units == 0   # then no more calls


def test_failing_idle_work_is_logged_and_serving_goes_on(caplog) -> None:
    runner = IdleRunner(CONFIG, units=3, fail=True)
    with caplog.at_level(logging.WARNING, logger="resident.worker.async_engine"):
        assert _serve(runner) == expected(prompt(3, 10), 6)
    assert len(runner.idle_calls) == 1 and "start-up work after ready failed" in caplog.text


def test_the_engine_has_no_idle_work_while_a_request_is_unfinished() -> None:
    runner = IdleRunner(CONFIG, units=3)
    engine = LLMEngine(CONFIG, runner)
    engine.add_request("r", prompt(1, 5), SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.idle_work() is False and runner.idle_calls == []


def test_the_runner_loads_the_samplers_kernels_after_its_graphs_in_a_thread(tiny_model, monkeypatch, caplog) -> None:
    """After the idle graphs (none here, on CPU), the runner's idle work starts the sampler's
    warm-up in a thread, once, under CAPTURE_LOCK; close() joins it."""
    import importlib
    import json

    from weights_util import fused_weights_from_hf_folder

    from resident.worker.config import ModelConfig
    from resident.worker.cuda_graphs import CAPTURE_LOCK
    from resident.worker.model_runner import ModelRunner

    importlib.import_module("resident.worker.op_prefetch")   # so that sys.modules holds it

    path = tiny_model("llama")
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=64)
    runner = ModelRunner(ModelConfig.from_hf(json.loads((path / "config.json").read_text())), config,
                         fused_weights_from_hf_folder(path))
    calls = []

    def spy(device, vocab_size, rows, prompt_len, free_bytes):
        calls.append((threading.current_thread().name, CAPTURE_LOCK.locked(), vocab_size, rows, prompt_len,
                      free_bytes() > 0))
        return 2
    # The module the runner imports from (sys.modules: another test may have re-imported it,
    # leaving the package attribute on a different module object).
    import sys
    monkeypatch.setattr(sys.modules["resident.worker.op_prefetch"], "warm_sampler", spy)
    assert runner.idle_work() is False and calls == []   # a CPU warm-up leaves nothing for after ready
    runner._sampler_warm_pending = True   # as a GPU warm-up does
    with caplog.at_level(logging.INFO, logger="resident.worker.model_runner"):
        assert runner.idle_work() is False and runner.idle_work() is False
        runner.close()
    assert calls == [("resident-sampler-warmup", True, runner.model_config.vocab_size, (1,), runner._warmup_tokens(), True)]
    assert "the sampler's kernels loaded in the background after ready" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_captured_after_ready_beside_kv_growth_give_the_eager_tokens(tiny_model) -> None:
    """A lazy runner captures batch 1 at start; behind a served request the engine thread
    captures 8, 4 and 2 while the growth thread maps the rest of the KV cache (CAPTURE_LOCK
    keeps the two apart), and batches of 2-4 then replay those graphs with the tokens of a
    runner that captured every size at start."""
    import json

    from resident.worker.async_engine import KVGrowth
    from resident.worker.config import ModelConfig
    from resident.worker.model_runner import ModelRunner
    from weights_util import fused_weights_from_hf_folder

    path = tiny_model("llama3")
    mc = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    small = EngineConfig(block_size=8, num_kv_blocks=16, max_model_len=64, max_num_seqs=8)
    full = EngineConfig(block_size=8, num_kv_blocks=256, max_model_len=64, max_num_seqs=8)
    prompts = [[(i * 7 + k) % 256 for i in range(12 + k)] for k in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def serve(runner: ModelRunner, config: EngineConfig, grow_to: int | None) -> list[list[int]]:
        ae = AsyncEngine(LLMEngine(config, runner))
        ae.start()
        growth = ae.start_kv_growth(KVGrowth(grow_to, 16)) if grow_to else None
        first = [t async for out in ae.generate("first", prompts[0], params) for t in out.new_token_ids]
        if growth is not None:
            growth.join(60)
        for _ in range(500):   # the idle captures, once the first request is done
            if not runner.graphs.idle_pending:
                break
            await asyncio.sleep(0.01)

        async def one(i: int) -> list[int]:
            return [t async for out in ae.generate(f"r{i}", prompts[i], params) for t in out.new_token_ids]

        rest = await asyncio.gather(*[one(i) for i in range(1, 4)])
        ae.shutdown()
        return [first, *rest]

    runner = ModelRunner(mc, small, weights, device="cuda", cuda_graphs="lazy", max_num_kv_blocks=256)
    runner.warmup()   # greedy: leaves the sampler's kernels for after the idle graphs
    assert runner._sampler_warm_pending
    runner.capture_graphs()
    assert set(runner.graphs.capture_s) == {1} and runner.graphs.idle_pending == (8, 4, 2)
    got = asyncio.run(serve(runner, small, grow_to=256))
    assert set(runner.graphs.capture_s) == {1, 2, 4, 8} and runner.graphs.num_replays > 0
    assert runner.num_blocks == 256
    runner._sampler_thread.join(60)
    assert not runner._sampler_thread.is_alive() and not runner._sampler_warm_pending
    reference = ModelRunner(mc, full, weights, device="cuda", cuda_graphs="eager")   # every size at start
    reference.capture_graphs()
    want = asyncio.run(serve(reference, full, grow_to=None))
    assert got == want and all(len(t) == 16 for t in got)


def test_idle_work_done_is_set_once_nothing_is_left_and_a_snapshot_waits_for_it() -> None:
    """AsyncEngine.idle_work_done: set at once for an engine without idle work, after the last
    unit otherwise; SnapshotControl's quiesce waits for it (a capture must not run while the
    detach unmaps the weights)."""
    from types import SimpleNamespace

    from resident.worker.snapshot_control import SnapshotControl

    release = threading.Event()

    class SlowRunner(IdleRunner):
        def idle_work(self) -> bool:
            release.wait(10)
            return super().idle_work()

    runner = SlowRunner(CONFIG, units=1)

    async def main() -> tuple[bool, bool, bool]:
        plain = AsyncEngine(SimpleNamespace(has_unfinished_requests=lambda: False))
        plain.start()
        ae = AsyncEngine(LLMEngine(CONFIG, runner))
        ae.start()
        await asyncio.sleep(0.05)
        worker = SimpleNamespace(engine=ae, runner=runner)
        control = SnapshotControl.__new__(SnapshotControl)
        control.worker, control.server_state = worker, SimpleNamespace(num_http_in_flight=0)
        busy = control._startup_work_running()
        release.set()
        await control._quiesce(10)
        done = ae.idle_work_done.is_set()
        plain_done = plain.idle_work_done.wait(5)
        ae.shutdown()
        plain.shutdown()
        return busy, done, plain_done

    assert asyncio.run(main()) == (True, True, True)

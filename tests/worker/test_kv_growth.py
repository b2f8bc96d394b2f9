"""Growing the KV cache while serving: BlockManager.add_blocks, LLMEngine.add_kv_blocks,
AsyncEngine.start_kv_growth, the CPU runner's grow_kv_cache, and the start-up sizing."""
from __future__ import annotations

import asyncio
import threading
import zlib
from array import array
from pathlib import Path

import pytest
import torch

from weights_util import fused_weights_from_hf_folder

from resident.worker.async_engine import AsyncEngine, KVGrowth
from resident.worker.block_manager import BlockManager
from resident.worker.config import ModelConfig
from resident.worker.engine import LLMEngine
from resident.worker.engine_config import EngineConfig
from resident.worker.kv_sizing import initial_kv_blocks
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ModelRunnerOutput, SchedulerOutput
from resident.worker.request import Request
from resident.worker.sampling_params import SamplingParams
from resident.worker.serve_config import ServeConfig

VOCAB = 50
GREEDY = SamplingParams(temperature=0.0)


def next_token(context: list[int]) -> int:
    return 1 + zlib.crc32(array("q", context).tobytes()) % (VOCAB - 1)


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class GrowableRunner:
    """A fake runner whose KV cache is a list of slots; checks every sampled context against it."""

    def __init__(self, config: EngineConfig, fail_map_at: int | None = None) -> None:
        self.bs = config.block_size
        self.num_blocks = config.num_kv_blocks
        self.kv: list[tuple[int, int] | None] = [None] * (self.num_blocks * self.bs)
        self.mapped = self.num_blocks
        self.fail_map_at = fail_map_at
        self.threads: dict[str, set[str]] = {"map": set(), "grow": set(), "execute": set()}
        self.mapped_on_engine_thread = 0

    def map_kv_blocks(self, num_blocks: int) -> None:
        self.threads["map"].add(threading.current_thread().name)
        if self.fail_map_at is not None and num_blocks >= self.fail_map_at:
            raise MemoryError("cannot allocate 2048 MiB on cuda:0")
        self.mapped = max(self.mapped, num_blocks)

    def grow_kv_cache(self, num_blocks: int) -> None:
        self.threads["grow"].add(threading.current_thread().name)
        if num_blocks > self.mapped:            # as the real runner: map what was not mapped ahead
            self.mapped_on_engine_thread += num_blocks - self.mapped
            self.mapped = num_blocks
        self.kv += [None] * ((num_blocks - self.num_blocks) * self.bs)
        self.num_blocks = num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.threads["execute"].add(threading.current_thread().name)
        for s in out.scheduled:
            assert all(0 <= b < self.num_blocks for b in s.block_table), f"block beyond the cache: {s.block_table}"
            for j, t in enumerate(s.token_ids):
                p = s.start_pos + j
                self.kv[s.block_table[p // self.bs] * self.bs + p % self.bs] = (t, p)
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                known = s.prompt_token_ids + s.output_token_ids
                cached = [self.kv[s.block_table[p // self.bs] * self.bs + p % self.bs] for p in range(len(known))]
                assert cached == [(t, p) for p, t in enumerate(known)], f"{s.request_id}: KV cache corrupt"
                sampled[s.request_id] = next_token(known)
        return ModelRunnerOutput(sampled=sampled)


def prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 7 + i * 13) % (VOCAB - 1) for i in range(n)]


# --- BlockManager.add_blocks ------------------------------------------------------------
def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, GREEDY, 0, 8)


def test_add_blocks_keeps_running_requests_and_prefix_cache() -> None:
    bm = BlockManager(6, 4)
    held = _req("held", prompt(1, 12))
    assert bm.allocate_slots(held, 12, [])
    held.start_running(0)
    held.advance(12)
    bm.cache_full_blocks(held)
    done = _req("done", prompt(2, 8))
    assert bm.allocate_slots(done, 8, [])
    done.start_running(0)
    done.advance(8)
    bm.cache_full_blocks(done)
    bm.free(done)                                   # its 2 blocks stay cached, evictable
    before = bm.check_integrity()
    held_table = list(bm.block_table("held"))
    assert (before.num_used, before.num_evictable, before.num_free) == (3, 2, 1)

    bm.add_blocks(4)
    after = bm.check_integrity()
    assert bm.num_blocks == 10 and bm.num_free_blocks == 7
    assert (after.num_used, after.num_evictable, after.num_free) == (3, 2, 5)
    assert bm.block_table("held") == held_table
    assert bm.usage == pytest.approx(3 / 10)
    again = _req("again", prompt(2, 8) + [1])
    blocks, n = bm.get_computed_blocks(again)
    assert n == 8 and len(blocks) == 2               # the cached prefix survived the growth
    # New blocks are plain free ones: handed out before any cached block is evicted.
    fresh = _req("fresh", prompt(3, 20))
    assert bm.allocate_slots(fresh, 20, [])
    assert bm.block_table("fresh") == [6, 7, 8, 9, 5]
    assert bm.get_computed_blocks(again)[1] == 8
    bm.check_integrity()
    with pytest.raises(ValueError, match="at least one block"):
        bm.add_blocks(0)


# --- LLMEngine.add_kv_blocks ----------------------------------------------------------------
def test_request_that_did_not_fit_runs_after_growth_with_integrity_every_step() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=64)
    runner = GrowableRunner(config)
    engine = LLMEngine(config, runner)
    pa, pb = prompt(1, 20), prompt(2, 20)
    engine.add_request("a", pa, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    engine.add_request("b", pb, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    finished: set[str] = set()
    grown_at = None
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 3:
            # 5 blocks for a's 20 prompt tokens leave too few for b: it waits.
            assert [r.request_id for r in engine.scheduler.waiting] == ["b"]
            engine.add_kv_blocks(8)
            grown_at = step
            # a's prompt blocks are in the prefix cache: a request sharing them hits it.
            engine.add_request("c", pa[:16] + [3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
        engine.scheduler.block_manager.check_integrity()
        if grown_at is not None and step == grown_at:
            assert {r.request_id for r in engine.scheduler.running} >= {"a", "b"}, "b still waits after growth"
            assert "a" not in finished
    assert finished == {"a", "b", "c"}
    assert tokens["a"] == expected(pa, 10) and tokens["b"] == expected(pb, 10)
    assert tokens["c"] == expected(pa[:16] + [3], 4)
    assert engine.scheduler.prefix_cache_hits >= 16
    assert engine.scheduler.num_preemptions == 0
    assert engine.num_kv_blocks == 16 and runner.num_blocks == 16
    assert engine.scheduler.block_manager.check_integrity().num_used == 0


def test_cpu_model_runner_grows_without_changing_the_tokens(tiny_model) -> None:
    path: Path = tiny_model("llama")
    import json

    model_config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = fused_weights_from_hf_folder(path)
    p = [(i * 5 + 1) % model_config.vocab_size for i in range(13)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(num_blocks: int, grow_at: int | None) -> list[int]:
        config = EngineConfig(block_size=4, num_kv_blocks=num_blocks, max_model_len=32, max_num_batched_tokens=64)
        engine = LLMEngine(config, ModelRunner(model_config, config, weights))
        engine.add_request("r", p, params)
        out: list[int] = []
        step = 0
        while engine.has_unfinished_requests():
            if step == grow_at:
                engine.add_kv_blocks(24)
            for o in engine.step():
                out += o.new_token_ids
            engine.scheduler.block_manager.check_integrity()
            step += 1
        return out

    full = generate(32, None)
    grown = generate(8, 3)         # KV of the prompt and 2 tokens written before the growth
    assert len(full) == 12 and grown == full


# --- AsyncEngine.start_kv_growth ----------------------------------------------------------
def test_background_growth_maps_off_the_engine_thread_while_serving() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=64)
    runner = GrowableRunner(config)
    engine = LLMEngine(config, runner)
    chunks: list[int] = []
    done: list[tuple[int, float]] = []

    async def main() -> list[int]:
        ae = AsyncEngine(engine)
        ae.start()
        finished = asyncio.Event()
        loop = asyncio.get_running_loop()
        thread = ae.start_kv_growth(KVGrowth(30, 8, chunks.append,
                                             lambda n, s: (done.append((n, s)), loop.call_soon_threadsafe(finished.set))))
        got: list[int] = []
        async for out in ae.generate("r", prompt(4, 20), SamplingParams(temperature=0.0, max_tokens=10,
                                                                        ignore_eos=True)):
            got += out.new_token_ids
        await asyncio.wait_for(finished.wait(), 10)
        thread.join(5)
        # Three requests of 30 tokens (8 blocks each) now run side by side.
        results = await asyncio.gather(*[_collect(ae, f"x{i}", prompt(10 + i, 20)) for i in range(3)])
        assert all(r == expected(prompt(10 + i, 20), 10) for i, r in enumerate(results))
        ae.shutdown()
        return got

    got = asyncio.run(main())
    assert got == expected(prompt(4, 20), 10)
    assert chunks == [16, 24, 30] and done[0][0] == 30 and done[0][1] >= 0
    assert engine.num_kv_blocks == 30 and runner.num_blocks == 30
    assert runner.threads["map"] == {"resident-kv-grow"} and runner.mapped_on_engine_thread == 0
    assert runner.threads["grow"] == {"resident-engine"} == runner.threads["execute"]
    assert engine.scheduler.num_preemptions == 0
    engine.scheduler.block_manager.check_integrity()


async def _collect(ae: AsyncEngine, rid: str, p: list[int]) -> list[int]:
    got: list[int] = []
    async for out in ae.generate(rid, p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)):
        got += out.new_token_ids
    return got


def test_growth_that_cannot_map_stops_and_serving_goes_on(caplog) -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=64)
    runner = GrowableRunner(config, fail_map_at=20)
    engine = LLMEngine(config, runner)
    done: list[int] = []

    async def main() -> list[int]:
        ae = AsyncEngine(engine)
        ae.start()
        ae.start_kv_growth(KVGrowth(40, 8, None, lambda n, s: done.append(n))).join(10)
        got = await _collect(ae, "r", prompt(5, 20))
        ae.shutdown()
        return got

    with caplog.at_level("WARNING"):
        got = asyncio.run(main())
    assert done == [16] and engine.num_kv_blocks == 16
    assert "KV cache growth stopped at 16 of 40 blocks" in caplog.text and "cannot allocate" in caplog.text
    assert got == expected(prompt(5, 20), 10)
    engine.scheduler.block_manager.check_integrity()


# --- start-up sizing ------------------------------------------------------------------------
def test_initial_kv_blocks() -> None:
    mib2 = 2 << 20                                     # Llama-3-8B: 2 MiB per 16-token block
    assert initial_kv_blocks(50_000, mib2, 4 << 30, 512) == 2048
    assert initial_kv_blocks(50_000, mib2, 256 << 20, 512) == 512   # at least one --max-model-len request
    assert initial_kv_blocks(1000, mib2, 4 << 30, 512) == 1000      # never more than the budget
    with pytest.raises(ValueError):
        initial_kv_blocks(1000, 0, 4 << 30, 512)
    with pytest.raises(ValueError, match="kv-cache-initial"):
        ServeConfig(model="m", preload="off", kv_cache_initial_bytes=-1)


def test_cpu_kv_cache_grow_keeps_contents(tiny_model) -> None:
    from resident.worker.kv_cache import KVCache
    import json

    mc = ModelConfig.from_hf(json.loads((tiny_model("llama") / "config.json").read_text()))
    cache = KVCache.allocate(mc, 4, 4, torch.float32)
    for t in cache.tensors:
        t.normal_()
    old = [t.clone() for t in cache.tensors]
    cache.grow(9)
    assert cache.num_blocks == 9 and cache.mapped_num_blocks == 9
    for t, o in zip(cache.tensors, old):
        assert t.shape[1] == 9 and torch.equal(t[:, :4], o) and not t[:, 4:].any()


# --- on a GPU: the VMM cache grows in place under captured graphs ---------------------------
def _gpu_run(runner: ModelRunner, config: EngineConfig, prompts: list[list[int]], grow_to: int | None,
             ) -> tuple[list[list[int]], set[int]]:
    """r0, r1 from the start; at step 3 (after growing, when `grow_to`) r2, which gets new blocks first."""
    engine = LLMEngine(config, runner)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in (0, 1):
        engine.add_request(f"r{i}", prompts[i], params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    used: set[int] = set()
    step = 0
    while engine.has_unfinished_requests():
        if step == 3:
            if grow_to is not None:
                mapper = threading.Thread(target=runner.map_kv_blocks, args=(grow_to,), name="resident-kv-grow")
                mapper.start()          # maps while the engine could step: blocks beyond the cache are unused
                mapper.join()
                engine.add_kv_blocks(grow_to - engine.num_kv_blocks)
            engine.add_request("r2", prompts[2], params)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        for rid in out:
            used.update(engine.scheduler.block_manager.block_table(rid))
        engine.scheduler.block_manager.check_integrity()
        step += 1
    return [out[f"r{i}"] for i in range(3)], used


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cache_grows_in_place_under_graphs(tiny_model) -> None:
    import json

    path = tiny_model("llama3")
    mc = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    prompts = [[(i * 7 + k) % 256 for i in range(n)] for k, n in ((1, 20), (2, 20), (3, 30))]
    small = EngineConfig(block_size=8, num_kv_blocks=16, max_model_len=64, max_num_seqs=8)
    full = EngineConfig(block_size=8, num_kv_blocks=64, max_model_len=64, max_num_seqs=8)
    runner = ModelRunner(mc, small, weights, device="cuda", cuda_graphs="eager", max_num_kv_blocks=64)
    runner.capture_graphs()
    base, reserved = runner.kv_cache.memory.ptr, runner.kv_cache.memory.reserved_bytes
    grown, used = _gpu_run(runner, small, prompts, grow_to=64)
    assert runner.num_blocks == 64 and runner.pad_block == 64 and runner.graphs.pad_block == 64
    assert runner.kv_cache.memory.ptr == base and runner.kv_cache.memory.reserved_bytes == reserved
    assert max(used) >= 16, "no request used a block added by the growth"
    assert runner.graphs.num_replays > 0
    reference = ModelRunner(mc, full, weights, device="cuda", cuda_graphs="eager")
    reference.capture_graphs()
    want, _ = _gpu_run(reference, full, prompts, grow_to=None)
    assert grown == want and all(len(t) == 24 for t in grown)

"""Tensor parallelism on CPU (gloo, two processes) against TP=1 on the same float32 weights.

The test process is rank 0 of a real group (`TPGroup` spawns rank 1 with
`python -m resident.worker.tp_executor`); each rank opens only its own shard. Through the
ModelRunner (paged KV cache, chunked prefill, batched decode):
- teacher-forced logits over prompt + 48 tokens within 1e-3 of TP=1, and greedy tokens equal
  wherever TP=1's top-2 margin exceeds 1e-3 (Llama with q/k/v and o biases, Qwen2, Qwen3 with
  q/k norms and tied embeddings);
- free greedy generation through `execute` equal to TP=1 up to TP=1's first near-tie;
- each rank holds about half the weights; unsplittable configs fail before anything starts.
End to end: `resident serve --tensor-parallel-size 2` answers over HTTP with TP=1's greedy
completion, and exits with a clear error when a child rank dies.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import time

import pytest
import torch

from serve_helpers import daemon_helpers, http, servable_tiny_model, start_serve, stop_serve
from weights_util import fused_weights_from_hf_folder

from resident.daemon.loader import LoadSpec
from resident.worker.config import ModelConfig, ModelConfigError
from resident.worker.engine_config import EngineConfig
from resident.worker.entrypoint import ServeConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.sampling_params import SamplingParams
from resident.worker.tp_executor import RANK_DIED_EXIT, TPGroup, rank_devices

LOGIT_TOL = 1e-3
MARGIN = 1e-3
BLOCK = 8
NUM_FORCED = 48
CHUNK = 20          # prefill chunk: positions cross block and chunk boundaries
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_FORCED)

ARCHS = {
    "llama": {"attention_bias": True},   # q/k/v bias split per rank, o_proj bias added once
    "qwen2": {},                          # q/k/v bias
    "qwen3": {},                          # q/k norm, tied embeddings
}


def engine_config() -> EngineConfig:
    return EngineConfig(block_size=BLOCK, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
                        max_model_len=128)


def forced_logits(runner, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced logits of every position of each sequence, all sequences in one batch
    per step, prefilled in chunks of CHUNK tokens."""
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    tables = [list(range(i * 16, i * 16 + 16))[::-1] for i in range(len(seqs))]   # shuffled-looking blocks
    start = 0
    while start < max(len(s) for s in seqs):
        sched = []
        for i, s in enumerate(seqs):
            if start < len(s):
                chunk = s[start:start + CHUNK]
                sched.append(ScheduledRequest(f"r{i}", chunk, start, tables[i][:-(-(start + len(chunk)) // BLOCK)],
                                              False, GREEDY, s, []))
        logits = runner.logits(SchedulerOutput(sched, sum(len(x.token_ids) for x in sched), set()))
        pos = 0
        for x in sched:
            i = int(x.request_id[1:])
            out[i].append(logits[pos:pos + len(x.token_ids)])
            pos += len(x.token_ids)
        start += CHUNK
    return [torch.cat(o) for o in out]


def generate(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy generation of n tokens for each prompt, batched, through `execute`."""
    outs: list[list[int]] = [[] for _ in prompts]
    tables = [list(range(32 + i * 16, 48 + i * 16)) for i in range(len(prompts))]
    sched = [ScheduledRequest(f"g{i}", p, 0, tables[i][:-(-len(p) // BLOCK)], True, GREEDY, p, [])
             for i, p in enumerate(prompts)]
    for _ in range(n):
        res = runner.execute(SchedulerOutput(sched, sum(len(s.token_ids) for s in sched), set()))
        nxt = []
        for i, s in enumerate(sched):
            tok = res.sampled[s.request_id]
            outs[i].append(tok)
            pos = s.start_pos + len(s.token_ids)
            nxt.append(ScheduledRequest(s.request_id, [tok], pos, tables[i][:-(-(pos + 1) // BLOCK)], True, GREEDY,
                                        prompts[i], list(outs[i])))
        sched = nxt
    return outs


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tp2_matches_tp1_on_the_same_weights(tiny_model, arch):
    path = tiny_model(arch, **ARCHS[arch])
    rng = random.Random(arch)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (13, 30)]
    seqs = [p + [rng.randrange(256) for _ in range(NUM_FORCED)] for p in prompts]

    full = fused_weights_from_hf_folder(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tp1 = ModelRunner(cfg, engine_config(), full)
    want_logits = forced_logits(tp1, seqs)
    want_tokens = generate(tp1, prompts, 24)
    tp1.close()

    serve = ServeConfig(model=str(path), preload="off", device="cpu", tensor_parallel_size=2, cpu_threads=1,
                        verify_sample=-1)
    got_logits, got_tokens = run_tp2(serve, path, cfg, full, seqs, prompts, source="local")
    assert_tp_matches(cfg, full, prompts, want_logits, got_logits, want_tokens, got_tokens)


def run_tp2(serve: ServeConfig, path, cfg: ModelConfig, full: dict, seqs, prompts, source: str, check=None):
    """This process as rank 0 of a TP=2 group over `path`: (forced logits, greedy tokens);
    `check()` runs while every rank holds its weights."""
    group = TPGroup(serve, LoadSpec(str(path)), torch.device("cpu"))
    try:
        store = group.open_store()
        assert (store.source, store.tp_rank) == (source, 0)
        assert group.model_config.num_heads == cfg.num_heads // 2
        assert group.model_config.num_kv_heads == cfg.num_kv_heads // 2
        # This rank holds its shard only: half of every split tensor, the small norms whole.
        assert 0.45 * nbytes(full) < nbytes(store.tensors) < 0.55 * nbytes(full)
        runner = group.build_runner(store.tensors, engine_config=engine_config())
        assert runner.kv_cache.tensors[0].shape[3] == cfg.num_kv_heads // 2   # this rank's kv heads only
        got = forced_logits(runner, seqs), generate(runner, prompts, 24)
        if check is not None:
            check()
        runner.close()
        store.close()
    finally:
        group.close()
    return got


def assert_tp_matches(cfg, full, prompts, want_logits, got_logits, want_tokens, got_tokens) -> None:
    for want, got in zip(want_logits, got_logits):
        assert got.shape == want.shape == (len(want), cfg.vocab_size)
        assert (got - want).abs().max().item() < LOGIT_TOL
        clear = top2_margin(want) > MARGIN
        assert clear.float().mean() > 0.9
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    num_compared = 0
    for want, got, p in zip(want_tokens, got_tokens, prompts):
        n = len(want)   # up to TP=1's first near-tie
        m = top2_margin(forced_logits(ModelRunner(cfg, engine_config(), full), [p + want])[0])[len(p) - 1:]
        ties = (m[:n] <= MARGIN).nonzero()
        if len(ties):
            n = int(ties[0])
        assert got[:n] == want[:n]
        num_compared += n
    assert num_compared >= 16


def test_tp2_ranks_attach_their_shards_from_a_real_daemon(tiny_model, short_tmp):
    """A daemon process holds the model as 2 shards (loaded at rank 0's request); both ranks
    attach their own (rank 0 here, rank 1 in its own process) and compute what TP=1 computes
    from the whole model."""
    path = tiny_model("llama", attention_bias=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (9, 21)]
    seqs = [p + [rng.randrange(256) for _ in range(NUM_FORCED)] for p in prompts]
    full = fused_weights_from_hf_folder(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tp1 = ModelRunner(cfg, engine_config(), full)
    want_logits, want_tokens = forced_logits(tp1, seqs), generate(tp1, prompts, 24)

    helpers = daemon_helpers()
    daemon = helpers.start_daemon(short_tmp)
    try:
        # --preload auto: rank 0 asks the daemon to load the model as 2 shards, then every rank attaches.
        serve = ServeConfig(model=str(path), preload="auto", socket=daemon.socket, device="cpu",
                            tensor_parallel_size=2, cpu_threads=1)

        def one_lease_per_rank() -> None:
            with daemon.client("check") as c:
                (info,) = [m for m in c.list() if m.tensor_parallel_size == 2]
            assert list(info.devices) == ["cpu", "cpu"]
            leases = {lease.client_name: lease.pid for lease in info.leases}
            assert set(leases) == {"resident-serve-tp0", "resident-serve-tp1"}
            assert leases["resident-serve-tp0"] == os.getpid() != leases["resident-serve-tp1"]

        got_logits, got_tokens = run_tp2(serve, path, cfg, full, seqs, prompts, source="daemon",
                                         check=one_lease_per_rank)
    finally:
        daemon.stop()
    assert_tp_matches(cfg, full, prompts, want_logits, got_logits, want_tokens, got_tokens)


def test_tp2_kv_cache_grows_on_every_rank_between_two_steps(tiny_model):
    """A TP group started with a KV cache too small for the workload grows it after start
    (`map_kv_blocks` from another thread, as the growth thread calls it, then `grow_kv_cache`
    between two steps): every rank takes the new blocks — a rank that did not would fail on
    the first step writing past its old cache — and the group then computes TP=1's logits
    and greedy tokens with blocks beyond the old size."""
    import threading

    path = tiny_model("qwen2")
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (11, 25)]
    seqs = [p + [rng.randrange(256) for _ in range(NUM_FORCED)] for p in prompts]
    full = fused_weights_from_hf_folder(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tp1 = ModelRunner(cfg, engine_config(), full)
    want_logits, want_tokens = forced_logits(tp1, seqs), generate(tp1, prompts, 24)

    serve = ServeConfig(model=str(path), preload="off", device="cpu", tensor_parallel_size=2, cpu_threads=1,
                        verify_sample=-1)
    small = EngineConfig(block_size=BLOCK, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=256,
                         max_model_len=128)
    group = TPGroup(serve, LoadSpec(str(path)), torch.device("cpu"))
    try:
        store = group.open_store()
        runner = group.build_runner(store.tensors, engine_config=small, max_num_kv_blocks=64)
        assert runner.kv_cache.num_blocks == 16   # forced_logits uses blocks up to 31, generate up to 63
        mapper = threading.Thread(target=runner.map_kv_blocks, args=(64,))   # the growth thread's half
        mapper.start()
        mapper.join()
        runner.grow_kv_cache(64)                                             # the engine thread's half
        assert runner.kv_cache.num_blocks == runner.num_blocks == 64
        got_logits, got_tokens = forced_logits(runner, seqs), generate(runner, prompts, 24)
        runner.close()
        store.close()
    finally:
        group.close()
    assert_tp_matches(cfg, full, prompts, want_logits, got_logits, want_tokens, got_tokens)


def test_unsplittable_model_fails_before_any_rank_starts(tiny_model):
    path = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    serve = ServeConfig(model=str(path), preload="off", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ModelConfigError, match=r"--tensor-parallel-size 3 does not divide the model's "
                                               r"num_attention_heads \(4\)"):
        TPGroup(serve, LoadSpec(str(path)), torch.device("cpu"))
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        ModelConfig.from_hf(dict(json.loads((path / "config.json").read_text()),
                                 num_attention_heads=8, num_key_value_heads=1)).for_tp(2)
    with pytest.raises(ModelConfigError, match="intermediate_size"):
        ModelConfig.from_hf(dict(json.loads((path / "config.json").read_text()),
                                 intermediate_size=129)).for_tp(2)
    assert cfg.for_tp(1) is cfg
    with pytest.raises(ModelConfigError, match="already rank-local"):
        cfg.for_tp(2).for_tp(2)


def test_more_ranks_than_gpus_is_refused():
    assert rank_devices(torch.device("cpu"), 3) == ["cpu"] * 3
    visible = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"--tensor-parallel-size {visible + 1} needs {visible + 1} GPUs"):
        rank_devices(torch.device("cuda", 0), visible + 1)


def completion(base: str, prompt: str) -> str:
    status, body = http(base, "POST", "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_serve_tp2_over_http_equals_tp1_and_dies_with_a_rank(tmp_path):
    model = servable_tiny_model(tmp_path / "m", "qwen2")
    prompts = ["hello world", "tensor parallel ranks"]
    args = ("--preload", "off", "--device", "cpu", "--max-model-len", "128", "--cpu-threads", "1")
    tp1 = start_serve(model, tmp_path / "tp1.log", *args)
    try:
        want = [completion(tp1.base_url, p) for p in prompts]
    finally:
        stop_serve(tp1)
    log = tmp_path / "tp2.log"
    tp2 = start_serve(model, log, *args, "--tensor-parallel-size", "2")
    try:
        assert [completion(tp2.base_url, p) for p in prompts] == want
        child = int(re.search(r"children pids (\d+)", log.read_text()).group(1))
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while tp2.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tp2.proc.poll() == RANK_DIED_EXIT
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) exited", log.read_text())
    finally:
        stop_serve(tp2)

    # And the other way round: a child rank does not outlive rank 0.
    log = tmp_path / "tp2b.log"
    tp2 = start_serve(model, log, *args, "--tensor-parallel-size", "2")
    try:
        child = int(re.search(r"children pids (\d+)", log.read_text()).group(1))
    finally:
        stop_serve(tp2)   # SIGKILL: no chance to stop its children
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def gpu_forced_logits(runner, seqs: list[list[int]], prompt_len: int) -> torch.Tensor:
    """Logits [num_seqs, len - 1, vocab] predicting each next token: the prompts prefilled in
    one step, then the rest teacher-forced one token per sequence per step (decode batches,
    which run as captured CUDA graphs)."""
    tables = [list(range(i * 32, (i + 1) * 32)) for i in range(len(seqs))]
    blocks = lambda n: -(-n // 16)  # noqa: E731
    sched = [ScheduledRequest(f"s{i}", s[:prompt_len], 0, tables[i][:blocks(prompt_len)], False, GREEDY, s, [])
             for i, s in enumerate(seqs)]
    logits = runner.logits(SchedulerOutput(sched, len(seqs) * prompt_len, set()))
    out = [list(logits[i * prompt_len:(i + 1) * prompt_len - 1].float().cpu()) for i in range(len(seqs))]
    last = [logits[(i + 1) * prompt_len - 1].float().cpu() for i in range(len(seqs))]
    for pos in range(prompt_len, len(seqs[0])):
        for i in range(len(seqs)):
            out[i].append(last[i])
        sched = [ScheduledRequest(f"s{i}", [s[pos]], pos, tables[i][:blocks(pos + 1)], False, GREEDY, s, [])
                 for i, s in enumerate(seqs)]
        step = runner.logits(SchedulerOutput(sched, len(seqs), set())).float().cpu()
        last = list(step)
    return torch.stack([torch.stack(o) for o in out])


def tp1_gpu_logits(path, dtype: str, seqs, ec) -> torch.Tensor:
    from resident.worker.weight_store import LocalStore

    store = LocalStore(LoadSpec(str(path), dtype=dtype), "cuda:0")
    runner = ModelRunner(ModelConfig.from_hf(store.config), ec, store.tensors, device="cuda:0", cuda_graphs="lazy")
    try:
        return gpu_forced_logits(runner, seqs, 64)
    finally:
        runner.close()
        store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")
def test_tp2_bf16_on_two_gpus_agrees_with_tp1(tmp_path):
    """A random-weight model of a real shape (hidden 2048, 16/8 heads, 32k vocab) in bf16: TP=2
    over NCCL (prefill eager, decode in CUDA graphs) picks TP=1's top-1 token >= 99 % of the
    time wherever TP=1's top-2 margin is above bf16's resolution of the logits (random
    weights give Gaussian logits over 32k tokens: many top-2 gaps are below one bf16 step,
    where any reordering of sums flips the winner), and is as close to a float32 TP=1 as bf16
    TP=1 is."""
    from fixtures_models import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama", dtype="bfloat16", init_std=0.05, hidden_size=2048,
                           intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
    rng = random.Random(0)
    seqs = [[rng.randrange(32000) for _ in range(192)] for _ in range(4)]
    ec = EngineConfig(block_size=16, num_kv_blocks=160, max_num_seqs=8, max_num_batched_tokens=1024,
                      max_model_len=512)
    torch.cuda.set_device(0)
    exact = tp1_gpu_logits(path, "float32", seqs, ec).argmax(-1)
    want = tp1_gpu_logits(path, "auto", seqs, ec)

    serve = ServeConfig(model=str(path), preload="off", device="cuda:0", tensor_parallel_size=2)
    group = TPGroup(serve, LoadSpec(str(path)), torch.device("cuda", 0))
    try:
        shard = group.open_store()
        assert shard.tensors["model.embed_tokens.weight"].device == torch.device("cuda", 0)
        runner = group.build_runner(shard.tensors, engine_config=ec, cuda_graphs="lazy")
        runner.warmup()
        got = gpu_forced_logits(runner, seqs, 64)
        assert runner.graphs is not None and runner.graphs.capture_s, "decode steps ran in CUDA graphs"
        runner.close()
        shard.close()
    finally:
        group.close()
    top = want.topk(2, dim=-1).values
    resolved = (top[..., 0] - top[..., 1]) > 4 * torch.finfo(torch.bfloat16).eps * top[..., 0].abs()
    same = got.argmax(-1) == want.argmax(-1)
    agree_resolved = same[resolved].float().mean().item()
    tp1_exact = (want.argmax(-1) == exact).float().mean().item()
    tp2_exact = (got.argmax(-1) == exact).float().mean().item()
    print(f"TP=2 vs TP=1 bf16 top-1: {same.float().mean().item():.4f} overall, {agree_resolved:.4f} on the "
          f"{resolved.float().mean().item():.2%} resolved positions; vs float32: TP=1 {tp1_exact:.4f}, "
          f"TP=2 {tp2_exact:.4f}")
    assert resolved.float().mean() > 0.5
    assert agree_resolved >= 0.99
    assert tp2_exact >= tp1_exact - 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")
def test_serve_tp2_on_two_gpus_over_http_equals_tp1(tmp_path):
    """`resident serve --tensor-parallel-size 2` on cuda:0 and cuda:1 (KV cache planned on every
    rank, NCCL, decode graphs) answers with TP=1's greedy completion."""
    model = servable_tiny_model(tmp_path / "m", "qwen2")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    args = ("--preload", "off", "--device", "cuda:0", "--max-model-len", "256", "--gpu-memory-utilization", "0.3")
    prompts = ["hello world", "tensor parallel ranks"]
    tp1 = start_serve(model, tmp_path / "tp1.log", *args, env=env)
    try:
        want = [completion(tp1.base_url, p) for p in prompts]
    finally:
        stop_serve(tp1)
    tp2 = start_serve(model, tmp_path / "tp2.log", *args, "--tensor-parallel-size", "2", env=env)
    try:
        assert [completion(tp2.base_url, p) for p in prompts] == want
    finally:
        tp2.kill(signal.SIGTERM)


def _fused_allreduce_rank(rank: int, port: int, out_dir: str) -> None:
    """One rank of test_fused_allreduce_matches_nccl (spawned)."""
    from resident.worker.custom_allreduce import CustomAllReduce
    from resident.worker.distributed import ParallelConfig, ParallelGroup
    from resident.worker.kernels.dispatch import get_kernels

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = ParallelGroup(ParallelConfig(rank, 2, "nccl", store_port=port))
    kern = get_kernels(dev)
    fused = CustomAllReduce(group, 4096, torch.bfloat16, dev)
    report: dict = {"diff": {}, "graph_diff": {}, "fused_us": {}, "nccl_us": {}}
    for rows in (1, 7, 64):
        x = torch.randn(rows, 4096, device=dev, generator=torch.Generator(dev).manual_seed(rows * 10 + rank))
        x = x.to(torch.bfloat16)
        res = torch.randn(rows, 4096, device=dev, generator=torch.Generator(dev).manual_seed(rows)).bfloat16()
        w = (1 + 0.1 * torch.randn(4096, device=dev, generator=torch.Generator(dev).manual_seed(1))).bfloat16()
        want = kern.fused_add_rms_norm(group.all_reduce(x.clone()), res, w, 1e-5)
        for _ in range(3):   # call counters and data parities advance
            got = fused.all_reduce_add_rms_norm(x, res, w, 1e-5)
        report["diff"][rows] = max((g.float() - e.float()).abs().max().item() for g, e in zip(got, want))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused.all_reduce_add_rms_norm(x, res, w, 1e-5)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        report["graph_diff"][rows] = max((g.float() - e.float()).abs().max().item() for g, e in zip(captured, want))
        for name, fn in (("fused", lambda: fused.all_reduce_add_rms_norm(x, res, w, 1e-5)),
                         ("nccl", lambda: kern.fused_add_rms_norm(group.all_reduce(x.clone()), res, w, 1e-5))):
            group.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                fn()
            end.record()
            torch.cuda.synchronize()
            report[f"{name}_us"][rows] = start.elapsed_time(end) * 1e3 / 200
    torch.save(report, os.path.join(out_dir, f"rank{rank}.pt"))
    fused.close()
    group.close()


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")
def test_fused_allreduce_matches_nccl(tmp_path):
    """The one-shot CUDA-IPC all-reduce + residual add + RMSNorm equals NCCL's all-reduce followed
    by the fused add + norm kernel (within one bf16 ulp of the result), eagerly and replayed from a
    CUDA graph, for decode batch sizes; prints its time per call next to NCCL's."""
    import torch.multiprocessing as mp

    from resident.worker.distributed import open_store_master

    store = open_store_master(2)
    mp.spawn(_fused_allreduce_rank, args=(store.port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        print(f"rank {rank}: fused us {report['fused_us']}, nccl+norm us {report['nccl_us']}")
        for rows in (1, 7, 64):
            assert report["diff"][rows] <= 0.0625, report
            assert report["graph_diff"][rows] <= 0.0625, report

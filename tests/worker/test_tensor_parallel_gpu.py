"""Tensor parallelism on two GPUs (NCCL): bf16 agreement with TP=1 on a decisive random model
of a real shape, `resident serve --tensor-parallel-size 2` over HTTP with KV growth after
ready and the KV profile cache, and the fused one-shot all-reduce against NCCL. Marked gpu;
skipped without two GPUs (tests/h200.sh `tp` runs them)."""
from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import torch

from serve_helpers import servable_tiny_model, start_serve, stop_serve
from test_tensor_parallel import GREEDY, completion
from tp_fixtures import decided_by_layers, make_decisive_model, resolved

from resident.daemon.loader import LoadSpec
from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.outputs import ScheduledRequest, SchedulerOutput
from resident.worker.serve_config import ServeConfig
from resident.worker.tp_executor import TPGroup


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
    """Issue 8's bf16 check on a random model of a real shape (hidden 2048, 16/8 heads, 32k
    vocab, 4 layers) made decisive (tests/worker/tp_fixtures.py: an antipodal pair of hot LM
    head rows and embedding offsets, so its top-2 gaps are not below bf16's resolution as on
    plain random weights, where TP=2 measured 94.8 %): TP=2 over NCCL (prefill eager, decode in
    CUDA graphs) picks TP=1's top-1 token at >= 99 % of 764 positions, >= 99 % of them
    resolved, the layers deciding a share of them; and is as close to a float32 TP=1 as bf16
    TP=1 is."""
    path = make_decisive_model(tmp_path / "m", dtype="bfloat16", init_std=0.02, hidden_size=2048,
                               intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
                               max_shard_size="8GB")
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
    num_positions = want.shape[0] * want.shape[1]
    same = got.argmax(-1) == want.argmax(-1)
    agree, share = same.float().mean().item(), resolved(want).float().mean().item()
    # Position p of sequence i predicts token p + 1 from input token p.
    by_layers = decided_by_layers(path, torch.tensor(seqs)[:, :-1], want.argmax(-1))
    tp1_exact = (want.argmax(-1) == exact).float().mean().item()
    tp2_exact = (got.argmax(-1) == exact).float().mean().item()
    print(f"TP=2 vs TP=1 bf16 top-1: {agree:.4f} over {num_positions} positions, {share:.2%} of them resolved "
          f"(top-2 gap above 4 bf16 eps of the top logit), decided by the layers {by_layers:.2%}; vs float32: "
          f"TP=1 {tp1_exact:.4f}, TP=2 {tp2_exact:.4f}")
    assert num_positions >= 512
    assert share >= 0.99
    assert agree >= 0.99
    assert by_layers >= 0.02
    assert tp2_exact >= tp1_exact - 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")
def test_serve_tp2_on_two_gpus_over_http_equals_tp1(tmp_path):
    """`resident serve --tensor-parallel-size 2` on cuda:0 and cuda:1 (KV cache planned on every
    rank, NCCL, decode graphs) answers with TP=1's greedy completion, synchronous (the first
    start) and with `--async-scheduling auto`, which means on for a GPU TP group (the second);
    its KV cache starts small (--kv-cache-initial) and grows after ready on both ranks; the second
    start reads the activation headroom from the KV profile cache (no probe on any rank)."""
    model = servable_tiny_model(tmp_path / "m", "qwen2")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    args = ("--preload", "off", "--device", "cuda:0", "--max-model-len", "256", "--gpu-memory-utilization", "0.3")
    prompts = ["hello world", "tensor parallel ranks"]
    tp1 = start_serve(model, tmp_path / "tp1.log", *args, env=env)
    try:
        want = [completion(tp1.base_url, p) for p in prompts]
    finally:
        stop_serve(tp1)
    # The second start runs async scheduling (every rank substitutes its own copy of the
    # sampled tokens): `auto` turns it on for a TP group on GPUs.
    for run, headroom, scheduling in ((1, "measured", "off"), (2, "cached", "auto")):
        log = tmp_path / f"tp2-{run}.log"
        tp2 = start_serve(model, log, *args, "--tensor-parallel-size", "2", "--kv-cache-initial", "4KiB",
                          "--async-scheduling", scheduling, env=env)
        try:
            assert [completion(tp2.base_url, p) for p in prompts] == want
            deadline = time.monotonic() + 60
            while "KV cache growth done" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            text = log.read_text()
            assert re.search(r"KV cache growth done: \d+ -> \d+ blocks", text), text[-3000:]
            assert text.count("KV cache grown to") >= 2, "both ranks grew"   # kv_cache.grow logs on each rank
            assert f"headroom {headroom}" in text
            on_off = "on" if scheduling == "auto" else "off"
            assert f"async scheduling: {on_off} (--async-scheduling {scheduling})" in text
            assert [completion(tp2.base_url, p) for p in prompts] == want   # after the growth too
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

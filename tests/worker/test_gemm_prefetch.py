"""The start-up prefetch (worker/gemm_prefetch.py): which GEMMs and shapes a start runs, when
it applies, and the background thread's stages and outcomes (on CPU too); on a GPU, every
stage runs and leaves no memory behind."""
from __future__ import annotations

import json
import logging
import sys
import threading
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from resident.worker import gemm_prefetch
from resident.worker.gemm_prefetch import (STAGES, GemmPrefetch, enabled, gemms, plan_for, plan_for_serve, run,
                                           run_stage, start_for_serve, warmup_prefill_tokens)
from resident.worker.serve_config import ServeConfig

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


def test_plan_names_every_linear_with_the_warm_up_and_graph_sizes():
    plan = plan_for(LLAMA, dtype="auto", quantization="none", block_size=16, max_num_batched_tokens=2048,
                    max_model_len=None, graph_sizes=(1, 2, 4, 8))
    assert plan.linears == (("qkv_proj", 64 + 2 * 32, 64), ("o_proj", 64, 64), ("gate_up_proj", 320, 64),
                            ("down_proj", 64, 160), ("lm_head", 320, 64))
    assert plan.layer_ms == (32, 1, 2, 4, 8) and plan.head_ms == (1, 2, 4, 8)
    assert (plan.dtype, plan.fp8) == ("bfloat16", False)
    # The later stages' shapes: the sampler's vocabulary, the embedding, the KV blocks zeroed.
    assert (plan.hidden_size, plan.vocab_size, plan.prefill_tokens, plan.kv_block) == (64, 320, 32, (16, 2, 16))
    fp8 = plan_for(LLAMA, dtype="float16", quantization="fp8_per_tensor", block_size=16, max_num_batched_tokens=8,
                   max_model_len=64, graph_sizes=())
    assert fp8.layer_ms == (7, 1) and fp8.head_ms == (1,) and (fp8.dtype, fp8.fp8) == ("float16", True)
    # The runner's warm-up prefills as many tokens (model_runner.py uses the same function).
    assert warmup_prefill_tokens(16, 2048, 4096) == 32 and warmup_prefill_tokens(16, 2048, 10) == 9
    with pytest.raises(ValueError):
        plan_for({"model_type": "llama"}, dtype="auto", quantization="none", block_size=16,
                 max_num_batched_tokens=8, max_model_len=64, graph_sizes=())


def test_it_applies_to_one_gpu_and_a_local_llama_folder_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    base = ServeConfig(model=str(tmp_path), preload="off", device="cuda", cuda_graphs="lazy", max_num_seqs=64)
    on = {"RESIDENT_GEMM_PREFETCH": "on"}
    plan = plan_for_serve(base, on)
    assert plan is not None and plan.layer_ms == (32, 1, 2, 4, 8)
    eager = plan_for_serve(replace(base, cuda_graphs="eager", max_num_seqs=24), on)
    assert eager.layer_ms == (32, 1, 2, 4, 8, 16, 24)
    assert plan_for_serve(replace(base, cuda_graphs="off"), on).layer_ms == (32, 1)
    assert plan_for_serve(base, {}) == plan, "on by default"
    for off in ("off", "0", "false", "NO"):
        assert plan_for_serve(base, {"RESIDENT_GEMM_PREFETCH": off}) is None
    assert plan_for_serve(replace(base, tensor_parallel_size=2), on) is None
    assert plan_for_serve(replace(base, model="org/not-a-local-folder"), on) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))   # not a usable config: skipped
    assert plan_for_serve(base, on) is None


def test_an_unknown_switch_value_is_warned_about_and_means_on(caplog):
    with caplog.at_level(logging.WARNING, logger="resident.worker.gemm_prefetch"):
        assert enabled({"RESIDENT_GEMM_PREFETCH": "maybe"})
    assert "RESIDENT_GEMM_PREFETCH='maybe' is neither on nor off" in caplog.text and "=off" in caplog.text
    assert enabled({}) and enabled({"RESIDENT_GEMM_PREFETCH": " On "})
    assert not enabled({"RESIDENT_GEMM_PREFETCH": "off"})


def _plan(graph_sizes=(1,)):
    return plan_for(LLAMA, dtype="auto", quantization="none", block_size=16, max_num_batched_tokens=64,
                    max_model_len=None, graph_sizes=graph_sizes)


def test_the_thread_reports_each_stage_and_skips(caplog):
    caplog.set_level(logging.INFO, logger="resident.worker.gemm_prefetch")
    ran = []
    stages = [(name, lambda p, d, f, name=name, n=n: ran.append(name) or n, unit)
              for (name, _, unit), n in zip(STAGES, (9, 7))]
    done = GemmPrefetch(_plan(), torch.device("cpu"), lambda: True, stages=stages).start()
    assert done.join() and done.error is None and ran == ["GEMMs", "other ops"]   # the sampler's: after ready
    assert done.num_gemms == 9
    # The one line the bench restart keeps (cli/bench_restart_runs.py: "GEMM prefetch.*"), each stage's time in it.
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GEMM prefetch"))
    assert "GEMMs 0.00 s (9 GEMMs), other ops 0.00 s (7 ops)" in line
    skipped = GemmPrefetch(_plan(), 0, lambda: False, stages=[("GEMMs", lambda p, d, f: 1 / 0, "GEMMs")]).start()
    skipped.join()
    assert skipped.skipped and skipped.num_gemms == 0 and skipped.error is None


def test_start_for_serve_imports_the_stages_before_the_thread(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    config = ServeConfig(model=str(tmp_path), preload="off", device="cuda")
    assert start_for_serve(config, lambda: True, {"RESIDENT_GEMM_PREFETCH": "off"}) is None
    monkeypatch.delitem(sys.modules, "resident.worker.op_prefetch", raising=False)
    t = start_for_serve(config, lambda: False, {})   # on by default
    assert t is not None and "resident.worker.op_prefetch" in sys.modules
    t.join()
    assert t.skipped == "no CUDA context was created in advance"


def test_a_failing_stage_is_logged_and_the_next_ones_run(caplog):
    caplog.set_level(logging.DEBUG, logger="resident.worker.gemm_prefetch")

    def boom(p, d, f):
        raise RuntimeError("no sort kernel here")
    stages = [("GEMMs", lambda p, d, f: 3, "GEMMs"), ("sampler", boom, "calls"),
              ("other ops", lambda p, d, f: 5, "ops")]
    t = GemmPrefetch(_plan(), torch.device("cpu"), None, stages=stages).start()
    assert t.join() is False   # reported, never raised: the start goes on
    assert [(o.name, o.count, o.error is None) for o in t.outcomes] == [
        ("GEMMs", 3, True), ("sampler", 0, False), ("other ops", 5, True)]
    line = t.describe()
    assert line.startswith("GEMM prefetch: ") and "sampler failed after" in line and "no sort kernel here" in line
    assert "other ops 0.00 s (5 ops)" in line and "the warm-up does the failed stages' work" in line
    assert any(r.levelno == logging.INFO and "no sort kernel here" in r.getMessage() for r in caplog.records)
    assert any(r.exc_info and "sampler stage failed" in r.getMessage() for r in caplog.records)   # traceback at DEBUG


def test_the_stages_run_on_a_cpu_device():
    t = GemmPrefetch(_plan(graph_sizes=(1, 2, 4)), torch.device("cpu")).start()
    assert t.join(), t.error
    counts = {o.name: o.count for o in t.outcomes}
    # GEMMs: 4 layer linears x (32, 1, 2, 4) + the head x (1, 2, 4).
    assert counts == {"GEMMs": 4 * 4 + 3, "other ops": 4 + 1 + 2 * 3 + 1}


def test_the_gemm_stage_leaves_one_row_to_the_row_gemv_where_it_takes_it(monkeypatch):
    # The Triton row GEMV serves M = 1 of a layer's linears (gemv.takes_one_row): no cuBLAS first
    # use for them; the LM head and the other Ms as before.
    pytest.importorskip("triton")
    from resident.worker.kernels import gemv

    plan = _plan(graph_sizes=(1, 2))
    ran = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: ran.append((x.shape[0], w.shape[0])) or real(x, w))
    monkeypatch.setattr(gemv, "takes_one_row", lambda n, k, device, fp8=False: True)
    assert gemms(plan, torch.device("cpu"), lambda: 1 << 40) == 4 * 2 + 2
    assert sorted(m for m, _ in ran) == [1] + [2] * 5 + [32] * 4   # M = 1: the LM head's only


def test_the_plan_waits_for_the_weight_sized_stage_only_and_only_it_empties_the_cache(monkeypatch):
    """wait_memory() returns once the GEMM stage is done (its cache emptied) while the later
    stages still run; join() waits for those; only the GEMM stage empties torch's cache."""
    release_sampler = threading.Event()
    emptied: list[bool] = []
    real_run_stage = gemm_prefetch.run_stage

    def run_stage(stage, plan, device, free_bytes=None, empty_cache=True):
        emptied.append(empty_cache)
        return real_run_stage(stage, plan, device, free_bytes, empty_cache)

    monkeypatch.setattr(gemm_prefetch, "run_stage", run_stage)
    stages = [("GEMMs", lambda p, d, f: 3, "GEMMs"),
              ("sampler", lambda p, d, f: release_sampler.wait(10) and 2, "calls"),
              ("other ops", lambda p, d, f: 1, "ops")]
    t = GemmPrefetch(_plan(), torch.device("cpu"), stages=stages).start()
    t.wait_memory()
    assert [o.name for o in t.outcomes] == ["GEMMs", "sampler"] and t._thread.is_alive()   # the sampler still runs
    release_sampler.set()
    assert t.join() and [o.count for o in t.outcomes] == [3, 2, 1]
    assert emptied == [True, False, False]
    assert "waited 0.00 s for its memory" in t.describe()


def test_wait_memory_returns_when_the_thread_ends_early_or_never_started():
    skipped = GemmPrefetch(_plan(), 0, lambda: False).start()
    assert skipped.wait_memory(timeout_s=10) < 10 and skipped.join() and skipped.skipped
    assert GemmPrefetch(_plan(), 0).wait_memory() == 0.0   # not started: nothing to wait for


def test_run_stage_empties_the_cache_even_when_the_stage_fails(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def boom(p, d, f):
        raise MemoryError("out of memory")
    monkeypatch.setattr(torch.cuda, "device", lambda dev: nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)
    assert run_stage(lambda p, d, f: (d.type, f()), _plan(), 0, free_bytes=lambda: 7) == ("cuda", 7)
    with pytest.raises(MemoryError):
        run_stage(boom, _plan(), 0, free_bytes=lambda: 7)
    assert emptied == [True, True]
    assert run_stage(lambda p, d, f: d.type, _plan(), torch.device("cpu")) == "cpu" and len(emptied) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["none", "fp8_per_tensor"])
def test_gpu_stages_run_and_free_their_memory(quantization):
    plan = plan_for(dict(LLAMA, hidden_size=256, intermediate_size=512, vocab_size=1024), dtype="auto",
                    quantization=quantization, block_size=16, max_num_batched_tokens=64, max_model_len=None,
                    graph_sizes=(1, 2, 4, 8))
    from resident.worker.kernels.gemv import takes_one_row

    dev = torch.device("cuda", torch.cuda.current_device())
    # M = 1 of the layers' linears the row GEMV takes (the H200 under the default) is not run.
    expected = 4 * 5 + 4 - sum(takes_one_row(n, k, dev, quantization == "fp8_per_tensor")
                               for name, n, k in plan.linears if name != "lm_head")
    assert run(plan, torch.cuda.current_device()) == expected
    # The first run leaves what a first GEMM in this thread leaves anyway (torch's cuBLAS
    # workspace for the handle, 32 MiB measured on the H200); the weights and inputs are freed.
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert run(plan, torch.cuda.current_device()) == expected
    assert torch.cuda.memory_allocated() == before
    skipped = run(plan, torch.cuda.current_device(), free_bytes=lambda: 1024)   # nothing fits: nothing runs
    assert skipped == 0
    # The whole thread: every stage runs; the second time (the first thread's cuBLAS handle and
    # workspace reused from torch's pool, and the later stages' few MB from torch's cache, which
    # only the GEMM stage empties) nothing more stays allocated or cached.
    for _ in range(2):
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t = GemmPrefetch(plan, torch.cuda.current_device()).start()
        assert t.join(), t.error
        assert [o.count > 0 for o in t.outcomes] == [True] * len(STAGES)
    assert torch.cuda.memory_allocated() == allocated and torch.cuda.memory_reserved() <= reserved

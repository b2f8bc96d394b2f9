"""The GEMM prefetch (worker/gemm_prefetch.py): which GEMMs a start runs, when it applies,
and the background thread's outcomes; on a GPU, the GEMMs run and leave no memory behind."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch

from resident.worker.entrypoint import ServeConfig
from resident.worker.gemm_prefetch import GemmPrefetch, plan_for, plan_for_serve, run, warmup_prefill_tokens

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
    assert plan_for_serve(base, {}) is None and plan_for_serve(base, {"RESIDENT_GEMM_PREFETCH": "off"}) is None
    assert plan_for_serve(replace(base, tensor_parallel_size=2), on) is None
    assert plan_for_serve(replace(base, model="org/not-a-local-folder"), on) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))   # not a usable config: skipped
    assert plan_for_serve(base, on) is None


def test_the_thread_reports_done_skipped_and_failed(caplog):
    plan = plan_for(LLAMA, dtype="auto", quantization="none", block_size=16, max_num_batched_tokens=64,
                    max_model_len=None, graph_sizes=(1,))
    caplog.set_level(logging.INFO, logger="resident.worker.gemm_prefetch")
    done = GemmPrefetch(plan, 0, lambda: True, runner=lambda p, i: 9).start()
    done.join()
    assert done.num_gemms == 9 and "for 9 GEMMs" in caplog.text and done.error is None
    skipped = GemmPrefetch(plan, 0, lambda: False, runner=lambda p, i: 1 / 0).start()
    skipped.join()
    assert skipped.skipped and skipped.num_gemms == 0

    def boom(p, i):
        raise RuntimeError("no cuBLAS here")
    failed = GemmPrefetch(plan, 0, None, runner=boom).start()
    failed.join()
    assert "no cuBLAS here" in failed.describe() and "the warm-up does" in failed.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["none", "fp8_per_tensor"])
def test_gpu_gemms_run_and_free_their_memory(quantization):
    plan = plan_for(dict(LLAMA, hidden_size=256, intermediate_size=512, vocab_size=1024), dtype="auto",
                    quantization=quantization, block_size=16, max_num_batched_tokens=64, max_model_len=None,
                    graph_sizes=(1, 2, 4, 8))
    assert run(plan, torch.cuda.current_device()) == 4 * 5 + 4
    # The first run leaves what a first GEMM in this thread leaves anyway (torch's cuBLAS
    # workspace for the handle, 32 MiB measured on the H200); the weights and inputs are freed.
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert run(plan, torch.cuda.current_device()) == 4 * 5 + 4
    assert torch.cuda.memory_allocated() == before
    skipped = run(plan, torch.cuda.current_device(), free_bytes=lambda: 1024)   # nothing fits: nothing runs
    assert skipped == 0

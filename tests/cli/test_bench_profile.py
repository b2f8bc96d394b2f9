"""`bench throughput --profile` (cli/bench_profile.py): kernel names sorted into categories, per-step
sums, the gap to the timed step, GEMM GB/s, the "other" names to improve the table with; profiling
real torch ops on CPU; a failing profile never takes the timed figures down with it."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from resident.cli.bench_profile import (CATEGORIES, EXTRA_STEPS, NUM_PROFILE_STEPS, NUM_REPLAY_WARMUP,
                                        NUM_TIMED_REPLAYS, KernelTime, classify, format_profile, gemm_weight_bytes,
                                        graph_forward_eagerly, profile_decode, recording_replay_sizes, replay_split,
                                        summarize, time_replays)

ROOT = Path(__file__).resolve().parents[2]

# Kernel names as the profiler reports them on an H100/H200 (cuBLAS, cuBLASLt, CUTLASS, PyTorch).
VENDOR_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "gemm",
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>(...)": "gemm",
    "void gemvx::kernel<int, int, __nv_bfloat16, __nv_bfloat16, float, false, true, true, false, 7, false>(...)":
        "gemm",
    "cutlass3x_sm90_tensorop_s64x8x32gemm_e4m3_e4m3_f32_bf16_bf16_64x8x128_1x1x1_0_tnn_align16_warpspecialized": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)": "gemm",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
    "unsigned int, long, 4, 4> >(at::native::ReduceOp<...>)": "sampling",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
    "(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "sampling",
    "Memcpy HtoD (Pinned -> Device)": "copies",
    "Memcpy DtoH (Device -> Pinned)": "copies",
    "Memset (Device)": "copies",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
    "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(...)": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, std::array<char*, 1> >(...)":
        "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel"
    "(at::TensorIteratorBase&)::{lambda()#1}>(...)": "activation",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
    "true>(...)": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3>)": "other",
}

OURS = {"_fp8_gemv_kernel": "gemm", "_decode_kernel": "attention", "_merge_splits_kernel": "attention",
        "_prefill_kernel": "attention", "_rms_norm_kernel": "norm", "_ar_add_rms_norm_kernel": "norm",
        "_rotary_kv_kernel": "rotary_kv", "_silu_and_mul_kernel": "activation",
        "_quantize_small_kernel": "quantization", "_quantize_kernel": "quantization", "_absmax_kernel": "quantization"}


@pytest.mark.parametrize("name,category", sorted({**VENDOR_NAMES, **OURS}.items()))
def test_kernel_names_are_classified(name, category):
    assert classify(name) == category


def test_every_triton_kernel_of_the_worker_has_a_category():
    """A new Triton kernel in worker/kernels (or the fused all-reduce) must get a row in PATTERNS."""
    names = set()
    for path in [*sorted((ROOT / "worker" / "kernels").glob("*.py")), ROOT / "worker" / "custom_allreduce.py"]:
        names |= set(re.findall(r"@triton\.jit\s+def (\w+_kernel)\(", path.read_text()))
    assert {"_fp8_gemv_kernel", "_decode_kernel", "_rotary_kv_kernel", "_argmax_chunk_kernel"} <= names
    assert classify("_argmax_merge_kernel") == "sampling"
    assert {n: classify(n) for n in names if classify(n) == "other"} == {}


def test_scopes_decide_first_then_the_name_then_the_launching_ops():
    # CPU reference ops: the kernel function they ran in wins over the op name
    assert classify("aten::mm", scopes=("reference.paged_attention",)) == "attention"
    assert classify("aten::index", scopes=("attention.write_kv", "reference.rotary_kv_write")) == "rotary_kv"
    scopes = ("linear.quantize_fp8_per_tensor_dynamic", "reference.fp8_linear")
    assert classify("aten::abs", scopes=scopes) == "quantization"
    assert classify("aten::mm", scopes=("linear.__call__",)) == "gemm"   # a scope that says nothing
    # a kernel whose name says nothing: its launching op decides
    assert classify("kernel_0x1", ancestors=("aten::mm", "aten::linear")) == "gemm"
    assert classify("kernel_0x1", ancestors=("aten::add",)) == "other"
    assert list(CATEGORIES)[-1] == "other" and set(VENDOR_NAMES.values()) | set(OURS.values()) <= set(CATEGORIES)


def test_summarize_sums_per_step_and_compares_with_the_timed_step():
    events = [KernelTime("nvjet_tst_a", 300.0), KernelTime("_fp8_gemv_kernel", 100.0),   # step 1: 400 us GEMM
              KernelTime("nvjet_tst_a", 250.0), KernelTime("_fp8_gemv_kernel", 150.0),   # step 2
              KernelTime("_decode_kernel", 60.0), KernelTime("_decode_kernel", 40.0),
              KernelTime("mystery_a", 30.0), KernelTime("mystery_b", 50.0), KernelTime("mystery_b", 10.0),
              KernelTime("mystery_c", 1.0), KernelTime("Memset (Device)", 9.0)]
    p = summarize(events, num_steps=2, step_s=1e-3, gemm_weight_bytes=4_000_000, copy_bandwidth=20e9, top=2)
    cats = p["categories"]
    assert list(cats) == list(CATEGORIES)
    assert cats["gemm"] == {"us_per_step": 400.0, "fraction_of_step": 0.4, "calls_per_step": 2.0}
    assert cats["attention"]["us_per_step"] == 50.0 and cats["copies"]["us_per_step"] == 4.5
    assert cats["other"]["us_per_step"] == 45.5 and cats["norm"]["us_per_step"] == 0.0
    assert p["kernel_us_per_step"] == 500.0 and p["step_us"] == 1000.0
    assert p["gap_us_per_step"] == 500.0 and p["gap_fraction"] == 0.5
    assert p["calls_per_step"] == 5.5
    assert p["gemm_bytes_per_s"] == pytest.approx(4e6 / 400e-6)           # 10 GB/s
    assert p["gemm_fraction_of_copy_bandwidth"] == pytest.approx(0.5)
    assert p["top_other"] == [{"name": "mystery_b", "us_per_step": 30.0, "calls_per_step": 1.0},
                              {"name": "mystery_a", "us_per_step": 15.0, "calls_per_step": 0.5}]
    assert "same kernels" in p["assumption"]
    text = format_profile("profile none batch 1", {**p, "graph_mode": {"kernel_us_per_step": 490.0,
                                                                       "calls_per_step": 5.0}})
    for needle in ("GEMM/GEMV", "gap (step - kernels)", "10 GB/s (50% of the copy bandwidth", "mystery_b",
                   "graph replays", "same kernels"):
        assert needle in text, text


def test_summarize_without_gemm_or_events_and_bad_arguments():
    p = summarize([], num_steps=1, step_s=2e-3, gemm_weight_bytes=10, copy_bandwidth=1e9)
    assert p["kernel_us_per_step"] == 0 and p["gap_fraction"] == 1.0
    assert p["gemm_bytes_per_s"] is None and p["gemm_fraction_of_copy_bandwidth"] is None
    assert "GEMM:" not in format_profile("t", {**p, "graph_mode": None})
    with pytest.raises(ValueError, match="num_steps"):
        summarize([], num_steps=0, step_s=1.0, gemm_weight_bytes=0, copy_bandwidth=1.0)
    with pytest.raises(ValueError, match="step_s"):
        summarize([], num_steps=1, step_s=0.0, gemm_weight_bytes=0, copy_bandwidth=1.0)


def test_gemm_weight_bytes_count_matrices_and_the_embedding_only_as_a_tied_head():
    w = {"model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
         "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16, dtype=torch.float8_e4m3fn),
         "model.layers.0.mlp.down_proj.weight_scale": torch.ones((), dtype=torch.float32),
         "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}
    assert gemm_weight_bytes(w) == 100 * 8 * 2 + 8 * 16
    w["lm_head.weight"] = torch.zeros(100, 8, dtype=torch.bfloat16)
    assert gemm_weight_bytes(w) == 100 * 8 * 2 + 8 * 16


def _decode_like_step():
    """A CPU stand-in for one engine step: a GEMM, a softmax/argmax sampler, one token decoded."""
    x, w = torch.randn(2, 64), torch.randn(128, 64)

    def step() -> int:
        logits = torch.nn.functional.linear(x, w)
        torch.softmax(logits, -1).argmax(-1).tolist()
        return 2
    return step


def test_profile_decode_profiles_real_cpu_ops():
    calls = []
    step = _decode_like_step()

    def counted() -> int:
        calls.append(1)
        return step()
    p = profile_decode(counted, 1e-3, runner=None, on_gpu=False, gemm_bytes=128 * 64 * 4, copy_bandwidth=1e9)
    assert "error" not in p, p
    assert len(calls) == 1 + NUM_PROFILE_STEPS <= EXTRA_STEPS
    assert p["time_source"] == "cpu op self time" and p["graph_mode"] is None
    assert not {"replay_us_per_step", "gap_inside_graph_us", "gap_between_replays_us", "replay_error"} & set(p)
    assert "gap split" not in format_profile("profile none batch 1", p)
    assert p["categories"]["gemm"]["calls_per_step"] >= 1 and p["categories"]["gemm"]["us_per_step"] > 0
    assert p["categories"]["sampling"]["calls_per_step"] >= 2      # softmax, argmax
    assert p["gemm_bytes_per_s"] > 0


def test_a_failing_profile_is_reported_not_raised(caplog):
    def broken() -> int:
        raise RuntimeError("boom")
    p = profile_decode(broken, 1e-3, runner=None, on_gpu=False, gemm_bytes=1, copy_bandwidth=1.0)
    assert p == {"error": "RuntimeError: boom"} and "--profile failed" in caplog.text
    assert "no profile (RuntimeError: boom)" in format_profile("profile none batch 1", p)
    sizes = iter([3, 3, 2, 3, 3, 3, 3])   # a request left the batch mid-profile
    step = _decode_like_step()
    p = profile_decode(lambda: (step(), next(sizes))[1], 1e-3, runner=None, on_gpu=False, gemm_bytes=1,
                       copy_bandwidth=1.0)
    assert "the batch changed" in p["error"]


def test_graph_forward_eagerly_runs_the_graphs_forward_and_restores_replay():
    class Graphs:
        def __init__(self):
            self.log = []

        def load(self, size, staged, tables):
            self.log.append(("load", size))

        def eager_logits(self, size):
            self.log.append(("eager", size))
            return "eager"

        def run(self, size, staged, tables):
            return "replayed"

    runner = SimpleNamespace(graphs=Graphs())
    with graph_forward_eagerly(runner):
        assert runner.graphs.run(4, None, None) == "eager"
    assert runner.graphs.log == [("load", 4), ("eager", 4)]
    assert runner.graphs.run(4, None, None) == "replayed"
    with graph_forward_eagerly(SimpleNamespace(graphs=None)):
        pass


class FakeGpu:
    """A device clock that only graph replays advance (`us_per_replay` each), and CUDA-like events on it."""

    def __init__(self, us_per_replay: float):
        self.us_per_replay, self.now_us, self.num_replays, self.num_syncs = us_per_replay, 0.0, 0, 0

    def replay(self) -> None:
        self.now_us += self.us_per_replay
        self.num_replays += 1

    def event(self) -> SimpleNamespace:
        ev = SimpleNamespace(at_us=None)
        ev.record = lambda: setattr(ev, "at_us", self.now_us)
        ev.elapsed_time = lambda end: (end.at_us - ev.at_us) / 1e3   # ms, as torch.cuda.Event's
        return ev

    def synchronize(self) -> None:
        self.num_syncs += 1


def test_time_replays_times_only_the_replays_after_the_warmup_ones():
    gpu = FakeGpu(4400.0)
    assert time_replays(gpu.replay, event=gpu.event, synchronize=gpu.synchronize) == pytest.approx(4400.0)
    assert gpu.num_replays == NUM_REPLAY_WARMUP + NUM_TIMED_REPLAYS and gpu.num_syncs == 1
    with pytest.raises(ValueError, match="num_timed"):
        time_replays(gpu.replay, num_timed=0, event=gpu.event, synchronize=gpu.synchronize)


def test_recording_replay_sizes_sees_each_graph_run_and_restores_it():
    class Graphs:
        def run(self, size, staged, tables):
            return f"logits {size}"

    runner = SimpleNamespace(graphs=Graphs())
    with recording_replay_sizes(runner) as sizes:
        assert runner.graphs.run(4, None, None) == "logits 4"
        runner.graphs.run(2, None, None)
    assert sizes == [4, 2] and "run" not in vars(runner.graphs)
    with recording_replay_sizes(SimpleNamespace(graphs=None)) as sizes:
        pass
    assert sizes == []


def test_replay_split_divides_the_gap_and_a_failure_leaves_the_profile(caplog):
    gpu = FakeGpu(4437.0)
    graphs = SimpleNamespace(_graphs={1: (SimpleNamespace(replay=lambda: pytest.fail("wrong size")), None),
                                      4: (SimpleNamespace(replay=gpu.replay), None)})
    split = replay_split(graphs, [1, 4, 4], kernel_us=4400.0, step_us=5177.0, event=gpu.event,
                         synchronize=gpu.synchronize)
    assert split == {"replay_graph_size": 4, "replay_us_per_step": pytest.approx(4437.0),
                     "gap_inside_graph_us": pytest.approx(37.0), "gap_between_replays_us": pytest.approx(740.0)}
    # noise may make a part negative: reported as measured
    gpu.us_per_replay = 4390.0
    split = replay_split(graphs, [4], 4400.0, 5177.0, event=gpu.event, synchronize=gpu.synchronize)
    assert split["gap_inside_graph_us"] == pytest.approx(-10.0)
    p = {**summarize([KernelTime("nvjet_tst_a", 4400.0)], num_steps=1, step_s=5177e-6, gemm_weight_bytes=1,
                     copy_bandwidth=1.0), "graph_mode": None}
    text = format_profile("profile none batch 4", {**p, **split})
    assert "gap split: -10.0 us inside the graph" in text and "size-4 graph 4390.0 us/step" in text
    assert "787.0 us between replays" in text
    assert "gap split" not in format_profile("profile none batch 4", p)

    assert replay_split(graphs, [], 1.0, 2.0) == {"replay_error": "RuntimeError: the graph-mode steps replayed "
                                                                  "no decode graph"}
    broken = SimpleNamespace(_graphs={4: (SimpleNamespace(replay=lambda: 1 / 0), None)})
    split = replay_split(broken, [4], 1.0, 2.0, event=gpu.event, synchronize=gpu.synchronize)
    assert split == {"replay_error": "ZeroDivisionError: division by zero"} and "left unsplit" in caplog.text
    text = format_profile("profile none batch 4", {**p, **split})
    assert "gap split: not measured (ZeroDivisionError" in text and "GEMM/GEMV" in text

"""The fused producers of fp8 GEMM inputs on a GPU: bit for bit the unfused kernels + quantization.

`rmsnorm.add_rms_norm_fp8_into` / `fused_add_rms_norm_fp8` and `activation.silu_and_mul_fp8_into`
/ `silu_and_mul_fp8` against `fused_add_rms_norm` (or `rms_norm`) and `silu_and_mul` followed by
`fp8_quant.quantize_fp8_per_tensor` — the same fp8 bytes, scale and new residual — on each path
(coop: one launch through the grid barrier; two; unfused), at decode batches of Llama-3-8B widths
(hidden 4096, intermediate 14336); the quantization also equals the CPU reference's. Then CUDA
graph capture and replays, a capture before any eager coop call and a grid beyond the SMs (the
two path), and a 2-layer fp8 model at Llama-3-8B widths whose logits over a prefill and graph-
replayed decode steps (batch 1 to 64) are the same with the fused ops and without. The
interpreter, torch-backend and sm_90 build tests are in test_kernels_fp8_fused.py.
"""
from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels_fp8 import LaunchSpy  # noqa: E402

from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, quantize_fp8_per_tensor_dynamic  # noqa: E402

pytestmark = pytest.mark.gpu

M_SIZES = (1, 2, 8, 64, 256)
EPS = 1e-5


def _norm_inputs(kind: str, m: int, k: int, dtype: torch.dtype, seed: int):
    """(x, residual, weight) on the GPU: random with an outlier, zeros, or tiny values but for one
    huge output in the last row's last column (only the last program's slot holds the maximum)."""
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    w = 1 + 0.1 * torch.randn(k, generator=g)
    if kind == "random":
        x[m // 2, k // 3] = 60.0
    elif kind == "zeros":
        x, r = torch.zeros(m, k), torch.zeros(m, k)
    elif kind == "huge_in_last_row":
        x, r = x * 0.01, r * 0.01
        x[m - 1, k - 1], w[k - 1] = 3000.0, 50.0
    return x.to(dtype).cuda(), r.to(dtype).cuda(), w.to(dtype).cuda()


def _silu_input(kind: str, m: int, i: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(m, 2 * i, generator=torch.Generator().manual_seed(seed)) * 3
    if kind == "zeros":
        x.zero_()
    elif kind == "huge_in_last_tile":
        x *= 0.01
        x[m - 1, i - 1] = x[m - 1, 2 * i - 1] = 150.0
    return x.to(dtype).cuda()


def _unfused_norm(x, r, w):
    """(x_q, scale, new residual): the Triton norm, then the fused quantization of fp8_linear."""
    from resident.worker.kernels import rmsnorm
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    normed, res = (rmsnorm.rms_norm(x, w, EPS), x) if r is None else rmsnorm.fused_add_rms_norm(x, r, w, EPS)
    x_q, scale = quantize_fp8_per_tensor(normed)
    want_q, want_scale = quantize_fp8_per_tensor_dynamic(normed.cpu())     # the CPU reference, as always
    assert torch.equal(scale.cpu(), want_scale) and torch.equal(x_q.view(torch.uint8).cpu(), want_q.view(torch.uint8))
    return x_q, scale, res


def _unfused_silu(x):
    from resident.worker.kernels import activation
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    return quantize_fp8_per_tensor(activation.silu_and_mul(x))


def _assert_identical(got_q, got_scale, want_q, want_scale) -> None:
    assert torch.equal(got_scale, want_scale), f"scale {got_scale.item()!r} != {want_scale.item()!r}"
    diff = (got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} quantized values differ"


def _fits(x: torch.Tensor, num_programs: int) -> bool:
    from resident.worker.kernels.fp8_quant import coop_grid_unsupported_reason

    return coop_grid_unsupported_reason(x, num_programs) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "zeros", "huge_in_last_row"])
@pytest.mark.parametrize("k", [4096, 8192, 1000])
@pytest.mark.parametrize("m", M_SIZES)
def test_gpu_fused_norm_is_bit_identical_to_norm_then_quantize(m: int, k: int, kind: str, dtype: torch.dtype,
                                                                monkeypatch) -> None:
    from resident.worker.kernels import rmsnorm

    x, r, w = _norm_inputs(kind, m, k, dtype, seed=m * 7 + k)
    spy = LaunchSpy(rmsnorm._rms_norm_fp8_kernel)
    monkeypatch.setattr(rmsnorm, "_rms_norm_fp8_kernel", spy)
    fits = _fits(x, m)
    assert rmsnorm.choose_fp8_path(x, w) == ("coop" if fits else "two")     # 256 rows > an H200's 132 SMs
    for res in (r, None):
        want_q, want_scale, want_res = _unfused_norm(x, res, w)
        x_q, scale, new_res = rmsnorm.fused_add_rms_norm_fp8(x, res, w, EPS)
        _assert_identical(x_q, scale, want_q, want_scale)
        assert torch.equal(new_res, want_res) and (res is not None or new_res is x)
        for path in ("coop", "two", "unfused") if fits else ("two", "unfused"):
            out = torch.empty(m, k, dtype=FP8_DTYPE, device="cuda")
            scale, new_res = rmsnorm.add_rms_norm_fp8_into(x, res, w, EPS, out, path=path)
            _assert_identical(out, scale, want_q, want_scale)
            assert torch.equal(new_res, want_res)
        if not fits:
            with pytest.raises(ValueError, match="multiprocessors"):
                rmsnorm.add_rms_norm_fp8_into(x, res, w, EPS, out, path="coop")
    assert len(spy.grids) == 2 * (3 if fits else 2) and set(spy.grids) == {(m,)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "zeros", "huge_in_last_tile"])
@pytest.mark.parametrize("i", [14336, 4096, 1000])
@pytest.mark.parametrize("m", M_SIZES)
def test_gpu_fused_silu_and_mul_is_bit_identical_to_silu_then_quantize(m: int, i: int, kind: str,
                                                                       dtype: torch.dtype) -> None:
    from resident.worker.kernels import activation
    from resident.worker.kernels.fp8_quant import _large_grid

    x = _silu_input(kind, m, i, dtype, seed=m * 7 + i)
    want_q, want_scale = _unfused_silu(x)
    x_q, scale = activation.silu_and_mul_fp8(x)
    _assert_identical(x_q, scale, want_q, want_scale)
    _, _, (gm, gk) = _large_grid(m, i)
    fits = _fits(x, gm * gk)                        # 256 x 14336: 448 programs, more than an H200's SMs
    for path in ("coop", "two") if fits else ("two",):
        out = torch.empty(m, i, dtype=FP8_DTYPE, device="cuda")
        _assert_identical(out, activation.silu_and_mul_fp8_into(x, out, path=path), want_q, want_scale)
    if not fits:
        with pytest.raises(ValueError, match="multiprocessors"):
            activation.silu_and_mul_fp8_into(x, out, path="coop")


def test_gpu_decode_batches_up_to_64_take_the_coop_paths() -> None:
    """On an H200 (132 SMs) Llama-3-8B decode at batch 64: one launch each (64 norm rows; 16 x 7
    SiLU tiles of the 14336-wide activation)."""
    from resident.worker.kernels import rmsnorm
    from resident.worker.kernels.fp8_quant import _large_grid

    x, _, w = _norm_inputs("random", 64, 4096, torch.bfloat16, seed=1)
    assert rmsnorm.choose_fp8_path(x, w) == "coop"
    _, _, (gm, gk) = _large_grid(64, 14336)
    assert _fits(x, gm * gk)


@pytest.mark.parametrize("m", [1, 64, 256])
def test_gpu_fused_ops_replay_in_a_cuda_graph(m: int, monkeypatch) -> None:
    from resident.worker.kernels import activation, fp8_quant, rmsnorm

    x, r, w = _norm_inputs("random", m, 4096, torch.bfloat16, seed=m)
    gu = _silu_input("random", m, 14336, torch.bfloat16, seed=m)

    def step():
        return (rmsnorm.fused_add_rms_norm_fp8(x, r, w, EPS), rmsnorm.fused_add_rms_norm_fp8(x, None, w, EPS),
                activation.silu_and_mul_fp8(gu))

    step()                                        # compile, and create the barrier state, outside the capture
    torch.cuda.synchronize()
    norm_spy, silu_spy = LaunchSpy(rmsnorm._rms_norm_fp8_kernel), LaunchSpy(activation._silu_and_mul_fp8_kernel)
    monkeypatch.setattr(rmsnorm, "_rms_norm_fp8_kernel", norm_spy)
    monkeypatch.setattr(activation, "_silu_and_mul_fp8_kernel", silu_spy)
    quantize_spy = LaunchSpy(fp8_quant._quantize_kernel)
    monkeypatch.setattr(fp8_quant, "_quantize_kernel", quantize_spy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (nq, ns, nres), (pq, ps, pres), (sq, ss) = step()
    assert len(norm_spy.grids) == 2 and len(silu_spy.grids) == 1
    coop_norm = _fits(x, m)
    _, _, (gm, gk) = fp8_quant._large_grid(m, 14336)
    coop_silu = _fits(gu, gm * gk)
    assert len(quantize_spy.grids) == (0 if coop_norm else 2) + (0 if coop_silu else 1)
    # Launches through the capture stream's barrier state (a one-row norm needs no barrier).
    num_coop = 2 * (coop_norm and m > 1) + coop_silu
    state = fp8_quant._COOP_STATES.get((torch.cuda.current_device(),
                                        torch.cuda.graph.default_capture_stream.cuda_stream))
    assert state is not None or num_coop == 0   # (states outlive a test: one may exist without a coop launch here)
    before = state.tolist() if num_coop else [0, 0]
    for i in range(20):
        scale = 0.1 + 3 * i
        x.copy_(torch.randn_like(x) * scale)
        r.copy_(torch.randn_like(r))
        gu.copy_(torch.randn_like(gu) * scale)
        if i % 7 == 3:
            x.zero_()
            r.zero_()
            gu.zero_()
        graph.replay()
        want_q, want_scale, want_res = _unfused_norm(x.clone(), r.clone(), w)
        _assert_identical(nq, ns, want_q, want_scale)
        assert torch.equal(nres, want_res)
        want_q, want_scale, _ = _unfused_norm(x.clone(), None, w)
        _assert_identical(pq, ps, want_q, want_scale)
        assert pres.data_ptr() == x.data_ptr()
        _assert_identical(sq, ss, *_unfused_silu(gu.clone()))
    torch.cuda.synchronize()
    if num_coop:
        assert before[0] == 0 and state.tolist() == [0, before[1] + 20 * num_coop]


def test_gpu_capture_before_any_eager_coop_call_takes_the_two_path(monkeypatch) -> None:
    """No barrier state exists yet: a capture must not allocate one (see fp8_quant), so both fused
    ops take their two path inside it, bit-identical all the same."""
    from resident.worker.kernels import activation, fp8_quant, rmsnorm

    x, r, w = _norm_inputs("random", 8, 4096, torch.bfloat16, seed=2)
    gu = _silu_input("random", 8, 14336, torch.bfloat16, seed=2)
    rmsnorm.add_rms_norm_fp8_into(x, r, w, EPS, torch.empty(8, 4096, dtype=FP8_DTYPE, device="cuda"), path="two")
    activation.silu_and_mul_fp8_into(gu, torch.empty(8, 14336, dtype=FP8_DTYPE, device="cuda"), path="two")
    torch.cuda.synchronize()                      # compiled outside the capture
    monkeypatch.setattr(fp8_quant, "_COOP_ARENAS", {})
    monkeypatch.setattr(fp8_quant, "_COOP_STATES", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nq, ns, nres = rmsnorm.fused_add_rms_norm_fp8(x, r, w, EPS)
        sq, ss = activation.silu_and_mul_fp8(gu)
        with pytest.raises(ValueError, match="no barrier state"):
            rmsnorm.add_rms_norm_fp8_into(x, r, w, EPS, torch.empty(8, 4096, dtype=FP8_DTYPE, device="cuda"),
                                          path="coop")
    assert fp8_quant._COOP_ARENAS == {}
    graph.replay()
    torch.cuda.synchronize()
    want_q, want_scale, want_res = _unfused_norm(x, r, w)
    _assert_identical(nq, ns, want_q, want_scale)
    assert torch.equal(nres, want_res)
    _assert_identical(sq, ss, *_unfused_silu(gu))


def test_gpu_grids_beyond_the_sms_take_the_two_path(monkeypatch) -> None:
    from resident.worker.kernels import activation, fp8_quant, rmsnorm

    monkeypatch.setattr(fp8_quant, "_num_sms", lambda device_index: 8)
    x, r, w = _norm_inputs("random", 64, 4096, torch.bfloat16, seed=3)
    assert rmsnorm.choose_fp8_path(x, w) == "two"
    out = torch.empty(64, 4096, dtype=FP8_DTYPE, device="cuda")
    with pytest.raises(ValueError, match="64 programs exceeds the device's 8 multiprocessors"):
        rmsnorm.add_rms_norm_fp8_into(x, r, w, EPS, out, path="coop")
    want_q, want_scale, want_res = _unfused_norm(x, r, w)
    x_q, scale, res = rmsnorm.fused_add_rms_norm_fp8(x, r, w, EPS)
    _assert_identical(x_q, scale, want_q, want_scale)
    assert torch.equal(res, want_res)
    gu = _silu_input("random", 4, 4096, torch.bfloat16, seed=3)       # 1 x 2 tiles: fits in 8
    want_q, want_scale = _unfused_silu(gu)
    spy = LaunchSpy(fp8_quant._quantize_kernel)
    monkeypatch.setattr(fp8_quant, "_quantize_kernel", spy)
    _assert_identical(*activation.silu_and_mul_fp8(gu), want_q, want_scale)
    assert spy.grids == []                                              # the coop path: one launch


# --- attention emitting o_proj's fp8 input ---------------------------------------------------------
@pytest.mark.parametrize("few_sms", [False, True])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 64, 100])
def test_gpu_paged_attention_fp8_is_attention_then_quantization(batch: int, few_sms: bool, monkeypatch) -> None:
    """`paged_attention_fp8` at Llama-3-8B heads (32 query, 8 kv, dim 128): the fp8 bytes and scale of
    paged_attention followed by quantize_fp8_per_tensor — decode split (1..8; up to 4 the split
    merge quantizes, a cooperative grid: no quantization launch) and unsplit (64, 100), eagerly
    and replayed in a CUDA graph with static decode metadata; a prefill batch too. few_sms: a
    device of 8 multiprocessors, where no merge grid fits and the quantization launches."""
    from kernel_batches import make_paged_batch

    from resident.worker.kernels import fp8_quant, paged_attention

    if few_sms:
        monkeypatch.setattr(fp8_quant, "_num_sms", lambda device_index: 8)
    spies = {name: LaunchSpy(getattr(fp8_quant, name)) for name in ("_quantize_small_kernel", "_quantize_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(fp8_quant, name, spy)

    hq, hkv, d = 32, 8, 128
    rng = random.Random(batch)
    ctx = [299] + [rng.randrange(1, 300) for _ in range(batch - 1)]   # (a split decode at batches 1..8)
    pb = make_paged_batch([1] * batch, ctx, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=torch.bfloat16,
                          device="cuda", seed=batch)
    q = torch.randn(batch, hq, d, device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
    q = q.to(torch.bfloat16)
    q[batch // 2, 3] *= 40                                  # one head's output sets the scale

    def want(meta):
        return fp8_quant.quantize_fp8_per_tensor(paged_attention.paged_attention(q, pb.kv_cache, meta, d ** -0.5)
                                                 .view(batch, hq * d))

    got = paged_attention.paged_attention_fp8(q, pb.kv_cache, pb.meta, d ** -0.5)
    launches = sum(len(spy.grids) for spy in spies.values())
    _assert_identical(*got, *want(pb.meta))
    splits = paged_attention.pick_decode_config(batch, hkv, max(pb.meta.seq_lens_host), q.device).num_splits
    sms = 8 if few_sms else torch.cuda.get_device_properties(0).multi_processor_count
    merge_quantizes = splits > 1 and batch * hq <= sms
    assert merge_quantizes == (batch <= 4 and not few_sms)
    assert launches == (0 if merge_quantizes else 1)   # the quantization's launch (one kernel on every other path)
    static = dataclasses.replace(pb.meta, static_decode=True)
    want_q, want_scale = want(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_q, got_scale = paged_attention.paged_attention_fp8(q, pb.kv_cache, static, d ** -0.5)
    got_q.zero_()
    graph.replay()
    _assert_identical(got_q, got_scale, want_q, want_scale)
    q.mul_(0.5)                                             # a replay sees new queries
    graph.replay()
    _assert_identical(got_q, got_scale, *want(static))
    chunk = make_paged_batch([5, 3], [7, 0], num_kv_heads=hkv, head_dim=d, block_size=16, dtype=torch.bfloat16,
                             device="cuda", seed=5)
    qp = torch.randn(8, hq, d, device="cuda").to(torch.bfloat16)
    _assert_identical(*paged_attention.paged_attention_fp8(qp, chunk.kv_cache, chunk.meta, d ** -0.5),
                      *fp8_quant.quantize_fp8_per_tensor(paged_attention.paged_attention(qp, chunk.kv_cache,
                                                                                         chunk.meta, d ** -0.5)
                                                         .view(8, hq * d)))


# --- a 2-layer fp8 model at Llama-3-8B widths ----------------------------------------------------
def _fp8_llama8b_wide(num_layers: int = 2, vocab: int = 32000):
    """(ModelConfig, weights on the GPU): bf16 norms and embeddings, fp8_per_tensor projections."""
    from resident.worker.config import ModelConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": num_layers, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": vocab, "max_position_embeddings": 8192,
           "rms_norm_eps": EPS, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, 4096), "model.norm.weight": (4096,),
              "lm_head.weight": (vocab, 4096)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (4096,), f"{p}.post_attention_layernorm.weight": (4096,),
                       f"{p}.self_attn.qkv_proj.weight": (6144, 4096), f"{p}.self_attn.o_proj.weight": (4096, 4096),
                       f"{p}.mlp.gate_up_proj.weight": (28672, 4096), f"{p}.mlp.down_proj.weight": (4096, 14336)})
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * torch.randn(shape, generator=g, device="cuda")).to(torch.bfloat16)
            continue
        w = torch.randn(shape, generator=g, device="cuda") * 0.02
        if name.endswith("_proj.weight"):
            scale = (w.abs().amax() / FP8_MAX).to(torch.float32)
            weights[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            weights[name.removesuffix(".weight") + ".weight_scale"] = scale
        else:
            weights[name] = w.to(torch.bfloat16)
    return ModelConfig.from_hf(cfg), weights


def test_gpu_fp8_model_decode_logits_are_identical_with_the_fused_ops(monkeypatch) -> None:
    from resident.worker.engine_config import EngineConfig
    from resident.worker.kernels import dispatch
    from resident.worker.model_runner import ModelRunner
    from resident.worker.outputs import ScheduledRequest, SchedulerOutput
    from resident.worker.sampling_params import SamplingParams

    config, weights = _fp8_llama8b_wide()
    ec = EngineConfig(block_size=16, num_kv_blocks=64 * 3, max_model_len=48, max_num_seqs=64,
                      max_num_batched_tokens=1024)
    triton_kernels = dispatch._triton_kernels
    runners = {}
    for name, kernels in (("fused", triton_kernels()),
                          ("unfused", dataclasses.replace(triton_kernels(), fused_add_rms_norm_fp8=None,
                                                          silu_and_mul_fp8=None, paged_attention_fp8=None))):
        monkeypatch.setattr(dispatch, "_triton_kernels", lambda kernels=kernels: kernels)
        runners[name] = ModelRunner(config, ec, weights, device="cuda", cuda_graphs="eager")
        runners[name].capture_graphs()
    assert all(layer.fuse_fp8_quant and layer.fuse_o_quant for layer in runners["fused"].model.layers)
    assert not any(layer.fuse_fp8_quant or layer.fuse_o_quant for layer in runners["unfused"].model.layers)
    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(rng.randrange(4, 12))] for _ in range(64)]
    tables = [list(range(3 * i, 3 * i + 3)) for i in range(64)]
    schedule = [rng.sample(range(64), size) for size in (1, 2, 8, 64, 33, 64, 5)]
    tokens = [rng.randrange(32000) for _ in range(97)]

    def run(runner) -> list[torch.Tensor]:
        seqs = [list(p) for p in prompts]
        prefill = [ScheduledRequest(f"r{i}", p, 0, tables[i], True, greedy, p, []) for i, p in enumerate(prompts)]
        outs = [runner.logits(SchedulerOutput(prefill, sum(map(len, prompts)))).cpu()]   # 500-odd rows
        for batch in schedule:
            step = []
            for i in batch:
                tok = tokens[(i + len(seqs[i])) % len(tokens)]
                step.append(ScheduledRequest(f"r{i}", [tok], len(seqs[i]), tables[i], True, greedy, seqs[i], []))
                seqs[i].append(tok)
            outs.append(runner.logits(SchedulerOutput(step, len(step))).cpu())
        return outs

    got, want = run(runners["fused"]), run(runners["unfused"])
    assert runners["fused"].graphs.num_replays == len(schedule)
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"max |diff| {(g - w).abs().max().item()}"

"""The Triton kernels against their PyTorch references on a GPU, in bf16/fp16 at Llama-3-8B shapes
(hidden 4096, 32 query / 8 kv heads, head_dim 128, block_size 16, contexts up to 4k), the
fp8 linear against its CPU reference, and a micro-benchmark (printed with -s, not asserted).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kernel_batches import make_paged_batch  # noqa: E402

from resident.worker.config import RopeConfig  # noqa: E402
from resident.worker.kernels import reference as ref  # noqa: E402
from resident.worker.layers import activation as layer_activation  # noqa: E402
from resident.worker.layers.norm import RMSNorm  # noqa: E402
from resident.worker.layers.rotary import RotaryEmbedding, compute_inv_freq  # noqa: E402

pytestmark = pytest.mark.gpu

HIDDEN, INTER, HQ, HKV, D, BS = 4096, 14336, 32, 8, 128, 16
LLAMA3_ROPE = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192)
DTYPES = [torch.bfloat16, torch.float16]
ATTN_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
ROTARY_TOL = {torch.bfloat16: {"rtol": 2 ** -7, "atol": 2 ** -6}, torch.float16: {"rtol": 2 ** -9, "atol": 2 ** -8}}
#: Elementwise kernels: a couple of ulps of the dtype (sigmoid / rsqrt last-bit differences).
ELEM_TOL = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3}, torch.float16: {"rtol": 2e-3, "atol": 1e-4}}


@pytest.fixture(scope="module")
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernels would run in the CPU interpreter, not on the GPU")
    from resident.worker.kernels.dispatch import get_kernels

    k = get_kernels("cuda")
    assert k.backend == "triton"
    return k


def _attend_ref(batch, q: torch.Tensor, window: int | None = None) -> torch.Tensor:
    return ref.paged_attention(q, batch.kv_cache, batch.meta, D ** -0.5, window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(kernels, dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(333, HIDDEN, device="cuda", generator=g).to(dtype)
    r = torch.randn(333, HIDDEN, device="cuda", generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **ELEM_TOL[dtype])
    out, res = kernels.fused_add_rms_norm(x, r, w, 1e-5)
    want_out, want_res = RMSNorm(w, 1e-5)(x, r)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want_out, **ELEM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernels, dtype) -> None:
    x = (2 * torch.randn(77, 2 * INTER, device="cuda")).to(dtype)
    torch.testing.assert_close(kernels.silu_and_mul(x), layer_activation.silu_and_mul(x), **ELEM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kv_write(kernels, dtype) -> None:
    batch = make_paged_batch([700, 1, 1, 300], [0, 4000, 17, 1500], num_kv_heads=HKV, head_dim=D, block_size=BS,
                             dtype=dtype, device="cuda", seed=1)
    t = batch.meta.num_tokens
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda").to(dtype)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
    table = ref.build_cos_sin_cache(compute_inv_freq(LLAMA3_ROPE, D, "cuda"), 8192, dtype)
    cache = batch.kv_cache.clone()
    q_rot = kernels.rotary_kv_write(batch.positions, q, k, v, table, cache, batch.meta.slot_mapping)
    want_q, want_k = RotaryEmbedding(LLAMA3_ROPE, D, "cuda")(batch.positions, q, k)
    # The kernel rounds once, the reference after each op: about one ulp apart (an earlier kernel
    # measured on an H200: ~1 % of bf16 / 1.7 % of fp16 elements, max 1 ulp).
    tol = ROTARY_TOL[dtype]
    torch.testing.assert_close(q_rot, want_q, **tol)
    slots = batch.meta.slot_mapping
    flat, before = cache.view(2, -1, HKV, D), batch.kv_cache.view(2, -1, HKV, D)
    torch.testing.assert_close(flat[0, slots], want_k, **tol)
    assert torch.equal(flat[1, slots], v), "values must be cached unchanged"
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before[:, untouched]), "slots outside slot_mapping must not be written"
    print(f"\n[rotary {dtype}] elements differing from the reference: "
          f"{float((q_rot != want_q).float().mean()) * 100:.2f} %, max {float((q_rot - want_q).abs().max()):.3g}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_decode_attention(kernels, dtype, batch_size) -> None:
    gen = torch.Generator().manual_seed(batch_size)
    ctx = torch.randint(1, 4096, (batch_size,), generator=gen).tolist()
    ctx[0] = 4095
    batch = make_paged_batch([1] * batch_size, ctx, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=dtype,
                             device="cuda", seed=batch_size, nan_unused=True)
    q = torch.randn(batch_size, HQ, D, device="cuda").to(dtype)
    got = kernels.paged_attention(q, batch.kv_cache, batch.meta, D ** -0.5)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, _attend_ref(batch, q), atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 1024])
def test_mixed_prefill_and_decode(kernels, dtype, window) -> None:
    gen = torch.Generator().manual_seed(5)
    decode_ctx = torch.randint(1, 4096, (32,), generator=gen).tolist()
    q_lens = [512, 256, 100, 1] + [1] * 32
    ctx = [0, 1024, 3000, 2047] + decode_ctx
    batch = make_paged_batch(q_lens, ctx, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=dtype, device="cuda",
                             seed=6, nan_unused=True)
    q = torch.randn(batch.meta.num_tokens, HQ, D, device="cuda").to(dtype)
    got = kernels.paged_attention(q, batch.kv_cache, batch.meta, D ** -0.5, window)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, _attend_ref(batch, q, window), atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


def test_static_decode_replays_in_a_cuda_graph(kernels) -> None:
    """Captured once, replayed with other context lengths and block tables: still the reference."""
    import dataclasses

    from resident.worker.layers.attention import AttentionMetadata

    if "static_decode" not in {f.name for f in dataclasses.fields(AttentionMetadata)}:
        pytest.skip("AttentionMetadata has no static_decode field in this tree")
    dtype, b, width = torch.bfloat16, 8, 256        # block tables span 4096 positions
    first = make_paged_batch([1] * b, [100] * b, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=dtype,
                             device="cuda", seed=7, spare_blocks=2000)
    cache = first.kv_cache
    tables = torch.zeros(b, width, dtype=torch.int64, device="cuda")
    seq_lens = torch.ones(b, dtype=torch.int64, device="cuda")
    slots = torch.zeros(b, dtype=torch.int64, device="cuda")
    q = torch.randn(b, HQ, D, device="cuda").to(dtype)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(b + 1, device="cuda"),
                             seq_lens=seq_lens, block_tables=tables, static_decode=True)
    kernels.paged_attention(q, cache, meta, D ** -0.5)            # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_attention(q, cache, meta, D ** -0.5)
    for seed, lens in ((8, [1, 5, 16, 17, 300, 1000, 2500, 4000]), (9, [4096, 2, 3, 64, 65, 700, 1, 1234])):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = cache.shape[1]
        for i, n in enumerate(lens):
            blocks = torch.randperm(num_blocks, generator=gen)[: -(-n // BS)]
            tables[i].zero_()
            tables[i, : len(blocks)] = blocks.to("cuda")
        seq_lens.copy_(torch.tensor(lens))
        q.copy_(torch.randn(b, HQ, D, generator=gen).to(dtype))
        graph.replay()
        want = _decode_ref(q, cache, tables, lens)
        torch.testing.assert_close(out, want, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_size", [1, 4, 8, 64])
def test_rotation_in_the_decode_attention_is_rotary_then_attention(kernels, dtype, batch_size) -> None:
    """`rotary_paged_attention` (the decode kernel rotating q and this step's keys and caching them,
    the new key read back after a CTA barrier) equals `rotary_kv_write` then `paged_attention` bit
    for bit — output and whole cache — split (1..8 at 1-4k contexts) and unsplit (64), with a
    padded token (slot -1) and a sequence whose only key is the new one; eagerly and replayed in a
    CUDA graph with static decode metadata (new queries and keys each replay); a sliding window;
    its fp8 form equals rotary then paged_attention_fp8; a mixed batch takes the two ops."""
    import dataclasses

    gen = torch.Generator().manual_seed(40 + batch_size)
    ctx = torch.randint(1, 4096, (batch_size,), generator=gen).tolist()
    ctx[0] = 4000
    if batch_size > 1:
        ctx[1] = 0
    batch = make_paged_batch([1] * batch_size, ctx, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=dtype,
                             device="cuda", seed=batch_size)
    table = ref.build_cos_sin_cache(compute_inv_freq(LLAMA3_ROPE, D, "cuda"), 8192, dtype)
    qkv = torch.randn(batch_size, (HQ + 2 * HKV) * D, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(batch_size, HQ, D), k.view(batch_size, HKV, D), v.view(batch_size, HKV, D)
    slots = batch.meta.slot_mapping.clone()
    if batch_size > 2:
        slots[2] = -1                                               # a padded token: not cached
    meta = dataclasses.replace(batch.meta, slot_mapping=slots)

    def two_ops(m, window=None, fp8=False):
        cache = batch.kv_cache.clone()
        q_rot = kernels.rotary_kv_write(batch.positions, q, k, v, table, cache, m.slot_mapping)
        attend = kernels.paged_attention_fp8 if fp8 else kernels.paged_attention
        return attend(q_rot, cache, m, D ** -0.5, window), cache

    def fused(m, cache, window=None, fp8=False):
        attend = kernels.rotary_paged_attention_fp8 if fp8 else kernels.rotary_paged_attention
        return attend(batch.positions, q, k, v, table, cache, m, D ** -0.5, window)

    for window in (None, 1024):
        want, want_cache = two_ops(meta, window)
        cache = batch.kv_cache.clone()
        assert torch.equal(fused(meta, cache, window), want), window
        assert torch.equal(cache, want_cache), window
    (want_q, want_s), want_cache = two_ops(meta, fp8=True)
    cache = batch.kv_cache.clone()
    got_q, got_s = fused(meta, cache, fp8=True)
    assert torch.equal(got_s, want_s) and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(cache, want_cache)
    static = dataclasses.replace(meta, static_decode=True)
    cache = batch.kv_cache.clone()
    fused(static, cache)                                            # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(static, cache)
    for seed in (4, 5):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        cache.copy_(batch.kv_cache)
        graph.replay()
        want, want_cache = two_ops(static)
        assert torch.equal(out, want) and torch.equal(cache, want_cache), seed
    if batch_size == 4:
        mixed = make_paged_batch([5, 1, 3, 1], [0, 9, 30, 2000], num_kv_heads=HKV, head_dim=D, block_size=BS,
                                 dtype=dtype, device="cuda", seed=9)
        t = mixed.meta.num_tokens
        qm = torch.randn(t, HQ, D, device="cuda").to(dtype)
        km, vm = torch.randn(t, HKV, D, device="cuda").to(dtype), torch.randn(t, HKV, D, device="cuda").to(dtype)
        want_cache, cache = mixed.kv_cache.clone(), mixed.kv_cache.clone()
        want = kernels.paged_attention(kernels.rotary_kv_write(mixed.positions, qm, km, vm, table, want_cache,
                                                               mixed.meta.slot_mapping), want_cache, mixed.meta,
                                       D ** -0.5)
        got = kernels.rotary_paged_attention(mixed.positions, qm, km, vm, table, cache, mixed.meta, D ** -0.5)
        assert torch.equal(got, want) and torch.equal(cache, want_cache)


def _decode_ref(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    from resident.worker.layers.attention import decode_attention

    return decode_attention(q, cache, tables, lens, D ** -0.5)


@pytest.mark.parametrize("shape", [(HQ * D + 2 * HKV * D, HIDDEN), (HIDDEN, INTER)])
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_fp8_linear_matches_cpu_reference(kernels, shape, tokens) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(tokens)
    w = 0.02 * torch.randn(n, k, generator=gen)
    scale = (w.abs().amax() / 448.0).to(torch.float32)
    w_q = (w / scale).to(torch.float8_e4m3fn)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if tokens == 64 else None
    got = kernels.fp8_linear(x.cuda(), w_q.cuda(), scale.cuda(), bias.cuda() if bias is not None else None)
    want = ref.fp8_linear(x, w_q, scale, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    # Hopper's fp8 tensor cores accumulate with less than float32 precision: measured on an
    # H200, max |diff| 1.2 % of the output's scale (a few bf16 ulps) in 8 of 3.1M outputs at
    # K = 4096. A wrong scale, layout or quantization step errs by O(scale) everywhere.
    scale_out = want.float().abs().max().item()
    diff = (got.cpu().float() - want.float()).abs()
    assert float(diff.max()) <= 3e-2 * scale_out, f"max |diff| {float(diff.max()):.4g}, output scale {scale_out:.4g}"
    # Mean measured on the H200: up to 2.2e-3 of the scale (a single token, K = 4096).
    assert float(diff.mean()) <= 5e-3 * scale_out, f"mean |diff| {float(diff.mean()):.4g}, output scale {scale_out:.4g}"


# --- micro-benchmark: printed, never asserted -------------------------------------------------
def _bench_us(fn) -> tuple[float, float | None]:
    """(eager us incl. Python launch overhead, GPU us replayed from a CUDA graph or None)."""
    import triton.testing

    eager = float(triton.testing.do_bench(fn, warmup=25, rep=100)) * 1e3
    try:
        graph = float(triton.testing.do_bench_cudagraph(fn, rep=100)) * 1e3
    except Exception:  # noqa: BLE001 - the reference reads host values: not capturable
        graph = None
    return eager, graph


def _fmt(t: tuple[float, float | None]) -> str:
    eager, graph = t
    return f"{eager:.1f} us eager" + (f" / {graph:.1f} us in a CUDA graph" if graph is not None else "")


@pytest.mark.parametrize("batch_size", [1, 64])
def test_bench_decode_attention_1k(kernels, batch_size) -> None:
    dtype, ctx = torch.bfloat16, 1024
    batch = make_paged_batch([1] * batch_size, [ctx - 1] * batch_size, num_kv_heads=HKV, head_dim=D, block_size=BS,
                             dtype=dtype, device="cuda", seed=10)
    q = torch.randn(batch_size, HQ, D, device="cuda").to(dtype)
    fast = _bench_us(lambda: kernels.paged_attention(q, batch.kv_cache, batch.meta, D ** -0.5))
    slow = _bench_us(lambda: _attend_ref(batch, q))
    kv_bytes = batch_size * ctx * HKV * D * 2 * q.element_size()
    best = fast[1] if fast[1] is not None else fast[0]
    print(f"\n[bench] decode attention bf16, batch {batch_size}, context {ctx}: triton {_fmt(fast)} "
          f"({kv_bytes / (best * 1e-6) / 1e12:.2f} TB/s of KV); reference {_fmt(slow)}")


def test_bench_other_kernels(kernels) -> None:
    dtype, t = torch.bfloat16, 64
    x = torch.randn(t, HIDDEN, device="cuda", dtype=dtype)
    r = torch.randn(t, HIDDEN, device="cuda", dtype=dtype)
    w = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    gu = torch.randn(t, 2 * INTER, device="cuda", dtype=dtype)
    batch = make_paged_batch([2048], [0], num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=dtype, device="cuda")
    qp = torch.randn(2048, HQ, D, device="cuda", dtype=dtype)
    w8 = torch.randn(HIDDEN, INTER, device="cuda").to(torch.float8_e4m3fn)
    s8 = torch.tensor(0.01, device="cuda")
    wb = torch.randn(HIDDEN, INTER, device="cuda", dtype=dtype)
    xi = torch.randn(t, INTER, device="cuda", dtype=dtype)
    lines = [
        ("fused add+RMSNorm [64, 4096]", lambda: kernels.fused_add_rms_norm(x, r, w, 1e-5),
         lambda: RMSNorm(w, 1e-5)(x, r)),
        ("SiLU-and-mul [64, 2x14336]", lambda: kernels.silu_and_mul(gu), lambda: layer_activation.silu_and_mul(gu)),
        ("prefill attention 2048 tokens", lambda: kernels.paged_attention(qp, batch.kv_cache, batch.meta, D ** -0.5),
         lambda: _attend_ref(batch, qp)),
        ("fp8 down_proj [64, 14336] (reference: bf16 F.linear)", lambda: kernels.fp8_linear(xi, w8, s8),
         lambda: torch.nn.functional.linear(xi, wb)),
    ]
    for name, fast, slow in lines:
        print(f"\n[bench] {name}: kernel {_fmt(_bench_us(fast))}; reference {_fmt(_bench_us(slow))}")

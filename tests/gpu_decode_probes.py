"""Decode-step probes behind docs/benchmarks.md "Session 10" (issue 4), run on the GPU machine:

    python3 tests/gpu_decode_probes.py l2-prefetch   --json OUT.json   (~20 s)
    python3 tests/gpu_decode_probes.py fp8-gemm      --json OUT.json   (~60-90 s: Triton compiles)
    python3 tests/gpu_decode_probes.py small-kernels --json OUT.json   (~30 s)
    python3 tests/gpu_decode_probes.py attention     --json OUT.json   (~90 s: Triton compiles)
    python3 tests/gpu_decode_probes.py bf16-gemm     --json OUT.json   (~60 s: Triton compiles)
    python3 tests/gpu_decode_probes.py attention-fp8 --json OUT.json   (~40 s)
    python3 tests/gpu_decode_probes.py pdl-chain     --json OUT.json   (~60 s)
    python3 tests/gpu_decode_probes.py gemv-designs  --json OUT.json   (~30 s on the H200)
    python3 tests/gpu_decode_probes.py fp8-row-gemv  --json OUT.json   (~30 s)

- l2-prefetch: does a bulk L2 prefetch (`cp.async.bulk.prefetch.L2`, Hopper) of the next GEMM's
  weights, issued on a side stream while latency-bound kernels run, make a batch-1 decode layer
  faster? 32 layers of four bf16 GEMVs at Llama-3-8B shapes, each after a spin kernel standing
  for the small kernels before it (3 / 10 / 3 / 2.5 us), in one CUDA graph; prefetch sizes are
  the window x copy bandwidth x a factor, capped.
- fp8-gemm: `torch._scaled_mm` (with and without fast accumulation) against `fp8_gemv` (its float16
  upcast at the picked shape, and on the fp8 tensor cores over a sweep of launch shapes) at
  Llama-3-8B's four shapes, M = 1, 16, 64: microseconds, share of the copy bandwidth, and the
  error against the float32 product of the same fp8 operands (relative to max |out|).
- small-kernels: the non-GEMM kernels of a decode step at batch 1 and 64 (argmax over a 128k
  vocabulary, torch vs `kernels/argmax`; add + RMSNorm and SiLU-and-mul, bf16 out and fp8 out on
  each path; per-tensor quantization on each path), microseconds per call in CUDA graphs.
- attention (session 11): the decode attention kernel (`paged_attention._decode`) over a sweep of
  launch shapes (`DecodeConfig`: key tile, warps, stages, splits) at Llama-3-8B's heads (32 query,
  8 kv, dim 128, bf16, blocks of 16) for several (batch, context) points: microseconds, share of the
  copy bandwidth for the keys and values read, session 10's fixed shape (64-key tiles, 4 warps,
  2 stages) and `pick_decode_config`'s.
- attention-fp8 (session 11): the same for the kernel variant that stores max |out| (fp8 o_proj
  input), at batch 64, over tiles, warps and stages.
- pdl-chain (session 12): a batch-1 bf16 decode step of the engine's kernels with and without
  programmatic dependent launch (kernels/pdl.py), cuBLAS or the Triton GEMV for the linears.
- gemv-designs (session 12): a register-tiled GEMV without tensor cores or split-K, swept per
  shape against cuBLAS and kernels/gemv.py, then in the decode chains with and without PDL (and
  with its first weight tile loaded before PDL's wait).
- fp8-row-gemv (session 12, run in session 13): `row_gemv_fp8` per shape over launch shapes
  against `_scaled_mm`, and the same fp8 weights against a bf16 activation (W8A16).
- bf16-gemm (session 11): the LM head's GEMM (128256 x 4096, bf16 in every checkpoint) and a
  layer's four at M = 1, 16, 64 by form: F.linear, W @ x^T, the LM head in N-chunks, the Triton
  GEMV over launch shapes (added after the session-11 run: not run yet).

The session-10 figures were taken with these probes as scratch scripts; this is them cleaned
up, not re-run as committed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from resident.worker.kernels import pdl as _pdl

MiB = 1 << 20
#: (name, N, K) of a Llama-3-8B layer's GEMMs.
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


@triton.jit
def _l2_prefetch_kernel(base, nbytes, chunk):
    """Each of the program's 32 threads asks the TMA unit to pull `chunk` bytes of
    [base, base + nbytes) into L2 (fire and forget)."""
    idx = tl.program_id(0) * 32 + tl.arange(0, 32)
    start = tl.minimum(idx.to(tl.int64) * chunk, nbytes - chunk)   # past the end: the last chunk again
    size = tl.full([32], 0, tl.int32) + chunk
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [base + start, size], dtype=tl.int32, is_pure=False, pack=1)


def _prefetch(t: torch.Tensor, nbytes: int, chunk: int = 64 * 1024) -> None:
    nbytes = min(nbytes, t.numel() * t.element_size()) // chunk * chunk
    if nbytes > 0:
        _l2_prefetch_kernel[(triton.cdiv(nbytes // chunk, 32),)](t.data_ptr(), nbytes, chunk, num_warps=1)


def _copy_bandwidth() -> float:
    from resident.cli.bench_kernels import copy_bandwidth_bytes_per_s

    return copy_bandwidth_bytes_per_s()


def _graph_us(fn: Callable[[], object], reps: int = 30, inner: int = 1) -> float:
    """Microseconds per call of `fn`, captured `inner` times in a row in a CUDA graph replayed
    `reps` times (inner > 1 keeps a replay's own launch cost out of a short kernel's figure)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * inner)


def l2_prefetch() -> dict:
    dev = torch.device("cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {}
    for cycles in (20000, 100000):            # torch.cuda._sleep: cycles -> microseconds
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        times[cycles] = start.elapsed_time(end) * 1000
    cycles_per_us = 80000 / (times[100000] - times[20000])

    def sleep_us(us: float) -> None:
        torch.cuda._sleep(max(1, int(us * cycles_per_us)))

    bw = _copy_bandwidth()
    windows = {"qkv": 3.0, "o": 10.0, "gate_up": 3.0, "down": 2.5}
    x = {name: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for name, _, k in SHAPES}
    layers = [{name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for name, n, k in SHAPES}
              for _ in range(32)]
    side = torch.cuda.Stream()

    def step(factor: float, cap_mib: int) -> None:
        main = torch.cuda.current_stream()
        for layer in layers:
            for name, _, _ in SHAPES:
                if factor:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        _prefetch(layer[name], int(min(cap_mib * MiB, windows[name] * 1e-6 * bw * factor)))
                sleep_us(windows[name])
                F.linear(x[name], layer[name])
        if factor:
            main.wait_stream(side)

    nbytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    out = {"copy_bandwidth_bytes_per_s": bw, "weight_bytes": nbytes, "roofline_us": nbytes / bw * 1e6,
           "gemv_only_us": _graph_us(lambda: [F.linear(x[n], layer[n]) for layer in layers for n, _, _ in SHAPES]),
           "windows_only_us": _graph_us(lambda: [sleep_us(windows[n]) for _ in layers for n, _, _ in SHAPES]),
           "step_us": {}}
    for factor in (0, 0.5, 1.0, 1.5, 2.0, 3.0):
        for cap in (16, 32, 48):
            if factor or cap == 16:
                out["step_us"][f"factor {factor}, cap {cap} MiB"] = _graph_us(lambda: step(factor, cap))
    return out


def fp8_gemm() -> dict:
    from resident.worker.kernels.fp8_gemv import GemvConfig, fp8_gemv, pick_config
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor
    from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX

    bw = _copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        s_w = (w.float().abs().amax() / FP8_MAX).reshape(())
        w_q = (w.float() / s_w).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        del w
        for m in (1, 16, 64):
            x_q, s_a = quantize_fp8_per_tensor(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ref = (x_q.float() @ w_q.float().t()) * (s_a * s_w)
            scale = ref.abs().max().item()
            results = []

            def run(label: str, fn: Callable[[], torch.Tensor]) -> None:
                try:
                    err = (fn().float() - ref).abs().max().item() / scale
                    us = _graph_us(fn, reps=10)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: listed, not fatal
                    results.append({"kernel": label, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    return
                results.append({"kernel": label, "us": us, "of_copy_bandwidth": n * k / (us * 1e-6) / bw,
                                "max_error_of_max_out": err})

            for fast in (False, True):
                run(f"_scaled_mm fast_accum={fast}", lambda fast=fast: torch._scaled_mm(
                    x_q, w_q.t(), scale_a=s_a, scale_b=s_w, out_dtype=torch.bfloat16, use_fast_accum=fast))
            upcast = pick_config(m, n, k, sms)
            run(f"fp8_gemv {upcast}",
                lambda cfg=upcast: fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16, config=cfg))
            sweep = [GemvConfig(block_n=bn, split_k=split, native_fp8=True)
                     for bn in (64, 128) for split in (1, 2, 4, 8)]
            for cfg in sweep:
                run(f"fp8_gemv {cfg}", lambda cfg=cfg: fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16, config=cfg))
            timed = [(r["us"], c) for r, c in zip(results[-len(sweep):], sweep) if "us" in r]
            if timed:
                best = min(timed, key=lambda t: t[0])[1]
                for variant in ({"num_stages": 3}, {"num_stages": 6}, {"block_k": 128},
                                {"block_k": 512, "num_stages": 3}, {"num_warps": 8}, {"imprecise_acc": 32}):
                    cfg = dataclasses.replace(best, **variant)
                    run(f"fp8_gemv {cfg}", lambda cfg=cfg: fp8_gemv(x_q, s_a, w_q, s_w, None, torch.bfloat16,
                                                                   config=cfg))
            rows.append({"linear": name, "n": n, "k": k, "m": m, "roofline_us": n * k / bw * 1e6,
                         "results": results})
    return {"copy_bandwidth_bytes_per_s": bw, "rows": rows}


def small_kernels() -> dict:
    from resident.worker.kernels import activation, fp8_quant, rmsnorm
    from resident.worker.kernels.argmax import argmax_rows

    def timed(fn: Callable[[], object]) -> float | str:
        try:
            return _graph_us(fn, reps=20, inner=20)
        except ValueError as e:        # a path that cannot run at this size (named by the kernel)
            return f"ValueError: {e}"

    out = {}
    for m in (1, 64):
        logits = torch.randn(m, 128256, device="cuda")
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        r, w = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        x8 = torch.empty(m, 4096, device="cuda", dtype=torch.float8_e4m3fn)
        g = torch.randn(m, 28672, device="cuda", dtype=torch.bfloat16)
        g8 = torch.empty(m, 14336, device="cuda", dtype=torch.float8_e4m3fn)
        row = {"argmax torch": timed(lambda: logits.argmax(dim=-1)),
               "argmax triton": timed(lambda: argmax_rows(logits)),
               "add+rmsnorm bf16": timed(lambda: rmsnorm.fused_add_rms_norm(x, r, w, 1e-5)),
               "silu_and_mul bf16": timed(lambda: activation.silu_and_mul(g))}
        for path in ("coop", "two", "unfused"):
            row[f"add+rmsnorm fp8 {path}"] = timed(
                lambda p=path: rmsnorm.add_rms_norm_fp8_into(x, r, w, 1e-5, x8, path=p))
        for path in ("coop", "two"):
            row[f"silu_and_mul fp8 {path}"] = timed(lambda p=path: activation.silu_and_mul_fp8_into(g, g8, path=p))
        for path in ("small", "coop", "two"):
            row[f"quantize {path}"] = timed(lambda p=path: fp8_quant.quantize_fp8_into(x, x8, path=p))
        out[f"batch {m}"] = row
    return out


#: Llama-3-8B's attention heads (query, kv), head dim; KV blocks of 16 tokens.
ATTN_SHAPE = (32, 8, 128, 16)


def _decode_case(batch: int, ctx: int, min_bytes: int = 0):
    """(q, kv cache, block tables, seq lens, bytes of keys and values a call reads) for `batch`
    sequences of `ctx` tokens at ATTN_SHAPE, bf16. The tables index disjoint copies of the batch's
    cache, >= `min_bytes` in all (one at least)."""
    n_qh, n_kh, head_dim, block = ATTN_SHAPE
    blocks_per_seq = ctx // block
    nbytes = 2 * batch * ctx * n_kh * head_dim * 2
    copies = max(1, -(-min_bytes // nbytes))
    n = batch * blocks_per_seq
    kv = torch.randn(2, copies * n + 1, block, n_kh, head_dim, device="cuda", dtype=torch.bfloat16)
    tables = [torch.arange(i * n, (i + 1) * n, device="cuda", dtype=torch.int64).view(batch, blocks_per_seq)
              for i in range(copies)]
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
    q = torch.randn(batch, n_qh, head_dim, device="cuda", dtype=torch.bfloat16)
    return q, kv, tables, seq_lens, nbytes


def attention() -> dict:
    from resident.worker.kernels import paged_attention as pa

    bw = _copy_bandwidth()
    n_kh, head_dim = ATTN_SHAPE[1:3]
    rows = []
    for batch, ctx in ((1, 1024), (1, 8192), (8, 1024), (64, 1024), (64, 4096)):
        # One call per copy of the cache, >= 256 MiB in all: keys and values come from HBM as in a
        # decode step (the weights in between evict them), not from the 50 MB L2.
        q, kv, tables, seq_lens, nbytes = _decode_case(batch, ctx, 256 * MiB)
        copies = len(tables)
        ref = pa._decode(q, kv, tables[0], seq_lens, head_dim ** -0.5, None, ctx, None)[0]
        default_splits = pa.default_num_splits(batch, n_kh, ctx, q.device)
        picked = pa.pick_decode_config(batch, n_kh, ctx, q.device)
        splits = {default_splits, picked.num_splits}
        splits = sorted(splits | ({1, 2, 3, 4, 6, 8} if batch >= 8 else {2, 4, 8, 12, 16, 32}))
        results = []
        for bn in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    for sp in splits:
                        if sp > triton.cdiv(ctx, bn):
                            continue
                        cfg = pa.DecodeConfig(block_n=bn, num_warps=warps, num_stages=stages, num_splits=sp)

                        def call(c=cfg):
                            return [pa._decode(q, kv, t, seq_lens, head_dim ** -0.5, None, ctx, None, config=c)[0]
                                    for t in tables]
                        try:
                            err = (call()[0].float() - ref.float()).abs().max().item()
                            us = _graph_us(call, reps=10) / copies
                        except Exception as e:   # a shape Triton cannot build (shared memory, registers)
                            results.append([None, dataclasses.asdict(cfg), f"{type(e).__name__}: {str(e)[:120]}"])
                            continue
                        results.append([us, dataclasses.asdict(cfg), err])
        amax = {}   # paged_attention_fp8's variant (stores max |out| per program), unsplit shapes
        for stages in (2, 3, 4) if picked.num_splits == 1 else ():
            cfg = pa.DecodeConfig(num_stages=stages, num_splits=1)
            amax[stages] = _graph_us(lambda c=cfg: [pa._decode(q, kv, t, seq_lens, head_dim ** -0.5, None, ctx, None,
                                                              amax=True, config=c) for t in tables], reps=10) / copies
        ok = sorted((r for r in results if r[0] is not None), key=lambda r: r[0])
        default = next(r for r in ok if r[1] == dataclasses.asdict(pa.DecodeConfig(num_splits=default_splits)))
        chosen = next(r for r in ok if r[1] == dataclasses.asdict(picked))
        rows.append({"batch": batch, "context": ctx, "kv_bytes": nbytes, "cache_copies": copies,
                     "default": default, "default_fraction": nbytes / (default[0] * 1e-6) / bw,
                     "picked": chosen, "picked_fraction": nbytes / (chosen[0] * 1e-6) / bw,
                     "best": ok[:12], "best_fraction": nbytes / (ok[0][0] * 1e-6) / bw,
                     "failed": [r for r in results if r[0] is None][:5], "amax_us_by_stages": amax, "all": results})
        print(f"batch {batch} ctx {ctx}: session 10's {default[0]:.1f} us ({rows[-1]['default_fraction']:.0%}), "
              f"picked {chosen[0]:.1f} us {chosen[1]}, "
              f"best {ok[0][0]:.1f} us ({rows[-1]['best_fraction']:.0%}) {ok[0][1]}"
              + (f"; with maxima by stages: {', '.join(f'{k}: {v:.1f}' for k, v in amax.items())} us" if amax else ""),
              file=sys.stderr)
    return {"copy_bw": bw, "rows": rows}


def attention_fp8() -> dict:
    """paged_attention_fp8's decode kernel (stores max |out| per program) over launch shapes, at
    the unsplit (batch 64) points, against the plain kernel's picked shape."""
    from resident.worker.kernels import paged_attention as pa

    bw = _copy_bandwidth()
    n_kh, head_dim = ATTN_SHAPE[1:3]
    rows = []
    for batch, ctx in ((64, 1024), (64, 4096)):
        q, kv, (tables,), seq_lens, nbytes = _decode_case(batch, ctx)   # >= 256 MiB of keys and values already
        picked = pa.pick_decode_config(batch, n_kh, ctx, q.device)
        plain = _graph_us(lambda: pa._decode(q, kv, tables, seq_lens, head_dim ** -0.5, None, ctx, None,
                                             config=picked), reps=10)
        results = []
        for bn in (32, 64):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    cfg = pa.DecodeConfig(block_n=bn, num_warps=warps, num_stages=stages, num_splits=1)
                    us = _graph_us(lambda c=cfg: pa._decode(q, kv, tables, seq_lens, head_dim ** -0.5, None, ctx,
                                                            None, amax=True, config=c), reps=10)
                    results.append([us, dataclasses.asdict(cfg)])
        results.sort(key=lambda r: r[0])
        rows.append({"batch": batch, "context": ctx, "plain_picked_us": plain, "amax": results,
                     "best_fraction": nbytes / (results[0][0] * 1e-6) / bw})
        print(f"batch {batch} ctx {ctx}: plain picked {plain:.1f} us; with maxima best "
              + ", ".join(f"{us:.1f} {cfg}" for us, cfg in results[:4]), file=sys.stderr)
    return {"copy_bw": bw, "rows": rows}


def bf16_gemm() -> dict:
    """bf16 GEMMs of a decode step (the LM head, and a layer's four for bf16 checkpoints) by form:
    F.linear as the model calls it, the transposed product W @ x^T, the LM head in N-chunks, and
    the Triton GEMV (`kernels/gemv.py`, opt-in `RESIDENT_GEMV=on`) at its picked launch shape and
    over a few others (M up to its limit, MAX_SUPPORTED_TOKENS)."""
    from resident.worker.kernels.fp8_gemv import MAX_SUPPORTED_TOKENS
    from resident.worker.kernels.gemv import gemv, pick_config

    bw = _copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, n, k in (("lm_head", 128256, 4096),) + SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            forms = {"F.linear": lambda: F.linear(x, w), "mm(W, x^T)": lambda: torch.mm(w, x.t())}
            if name == "lm_head":
                for chunks in (2, 4, 8):
                    parts = w.chunk(chunks)
                    out = torch.empty(chunks, m, parts[0].shape[0], device="cuda", dtype=torch.bfloat16)
                    forms[f"{chunks} chunks"] = lambda parts=parts, out=out: [
                        torch.mm(x, p.t(), out=out[i]) for i, p in enumerate(parts)]
            if m <= MAX_SUPPORTED_TOKENS:
                picked = pick_config(m, n, k, sms)
                shapes = {f"gemv picked {picked}": picked}
                for block_n in (64, 128):
                    for split in (1, 2, 4):
                        for stages in (3, 4):
                            cfg = dataclasses.replace(picked, block_n=block_n, split_k=split, num_stages=stages)
                            shapes.setdefault(f"gemv {cfg}", cfg)
                for label, cfg in shapes.items():
                    forms[label] = lambda cfg=cfg: gemv(x, w, config=cfg)
            row = {"name": name, "n": n, "k": k, "m": m}
            ref = F.linear(x.float(), w.float())
            for label, fn in forms.items():
                try:
                    got = fn()
                    if isinstance(got, torch.Tensor):
                        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                    us = _graph_us(fn, reps=10)
                except Exception as e:  # noqa: BLE001 - a launch shape that does not build here: listed
                    row[label] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                    continue
                row[label] = {"us": us, "of_copy_bandwidth": n * k * 2 / (us * 1e-6) / bw}
                if isinstance(got, torch.Tensor):
                    row[label]["max_error_of_max_out"] = err
            rows.append(row)
            timed = {lbl: v for lbl, v in row.items() if isinstance(v, dict) and "us" in v}
            best_gemv = _fastest(timed, "gemv ")
            shown = [lbl for lbl in timed if not lbl.startswith("gemv ")] + [
                lbl for lbl in timed if lbl.startswith("gemv picked")] + ([best_gemv] if best_gemv else [])
            print(f"{name} m={m}: " + ", ".join(f"{lbl} {timed[lbl]['us']:.1f} us "
                                                f"({timed[lbl]['of_copy_bandwidth']:.0%})"
                                                for lbl in dict.fromkeys(shown)), file=sys.stderr)
    return {"copy_bw": bw, "rows": rows}


@dataclasses.dataclass
class _Chain:
    """A batch-1 bf16 decode step of the engine's kernels at Llama-3-8B shapes, 32 layers, each its
    own weights and KV cache (all read from HBM): `full(linear)` the layer (add + RMSNorm, qkv,
    rotary + KV write, decode attention over 1k keys, o, add + RMSNorm, gate_up, SiLU-and-mul,
    down), `gemms(linear)` the four linears alone, each output the next one's input."""
    full: Callable[[Callable], torch.Tensor]
    gemms: Callable[[Callable], torch.Tensor]
    weights: list[dict[str, torch.Tensor]]
    weight_bytes: int
    kv_bytes: int
    layers: int
    context: int


def _decode_chain(layers: int = 32, ctx: int = 1024) -> _Chain:
    from resident.worker.kernels import activation, paged_attention as pa, rmsnorm, rotary
    from resident.worker.kernels.reference import build_cos_sin_cache

    hidden, eps = 4096, 1e-5
    n_qh, n_kh, head_dim, block = ATTN_SHAPE
    dev = torch.device("cuda")

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(0, k ** -0.5)
    ws = [{name: weight(n, k) for name, n, k in SHAPES} for _ in range(layers)]
    norms = torch.ones(layers, 2, hidden, device=dev, dtype=torch.bfloat16)
    _, kv, tables, seq_lens, kv_bytes = _decode_case(1, ctx, layers * 4 * MiB)
    slots = [t[0, -1:] * block + (ctx - 1) % block for t in tables]
    positions = torch.full((1,), ctx - 1, device=dev, dtype=torch.int64)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, 4 * ctx, torch.bfloat16)
    x0 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)

    def full(linear: Callable) -> torch.Tensor:
        h, res = x0, torch.zeros_like(x0)
        for i in range(layers):
            w, table = ws[i], tables[i % len(tables)]
            normed, res = rmsnorm.fused_add_rms_norm(h, res, norms[i, 0], eps)
            qkv = linear(normed, w["qkv"]).view(1, n_qh + 2 * n_kh, head_dim)
            q = rotary.rotary_kv_write(positions, qkv[:, :n_qh], qkv[:, n_qh:n_qh + n_kh], qkv[:, n_qh + n_kh:],
                                       cos_sin, kv, slots[i % len(slots)])
            attn = pa._decode(q, kv, table, seq_lens, head_dim ** -0.5, None, ctx, None)[0]
            normed, res = rmsnorm.fused_add_rms_norm(linear(attn.view(1, hidden), w["o"]), res, norms[i, 1], eps)
            h = linear(activation.silu_and_mul(linear(normed, w["gate_up"])), w["down"])
        return h

    def gemms(linear: Callable) -> torch.Tensor:
        h = x0
        for i in range(layers):
            w = ws[i]
            h = linear(linear(h, w["qkv"])[:, :hidden], w["o"])
            h = linear(linear(h, w["gate_up"])[:, :14336], w["down"])
        return h

    return _Chain(full, gemms, ws, sum(n * k * 2 for _, n, k in SHAPES) * layers, layers * kv_bytes, layers, ctx)


def _time_chains(chain: _Chain, forms: list[tuple[str, str, Callable, bool]], bw: float) -> list[dict]:
    """forms: (kind "full" | "gemms", label, linear, PDL on); each step captured in a CUDA graph.
    Outputs are compared with the first of the same (kind, label without its " pdl..." suffix)."""
    from resident.worker.kernels import pdl

    rows, firsts = [], {}
    for kind, label, linear, use_pdl in forms:
        step = chain.full if kind == "full" else chain.gemms
        nbytes = chain.weight_bytes + (chain.kv_bytes if kind == "full" else 0)
        name = f"{kind} {label}" + (" pdl" if use_pdl else "")
        pdl.PDL_MODE = "all" if use_pdl else "off"
        fn = lambda step=step, lin=linear: step(lin)   # noqa: E731
        try:
            out = fn().float()
            us = _graph_us(fn, reps=20)
        except Exception as e:  # noqa: BLE001 - a form that does not build or capture here: listed
            rows.append({"form": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"{name}: {rows[-1]['error']}", file=sys.stderr)
            continue
        finally:
            pdl.PDL_MODE = "off"
        first = firsts.setdefault((kind, label.split(" prefetch")[0]), out)
        same = bool(torch.equal(out, first)) or bool(torch.isnan(out).all() and torch.isnan(first).all())
        rows.append({"form": name, "us": us, "of_copy_bandwidth": nbytes / (us * 1e-6) / bw, "bytes": nbytes,
                     "same_as_first": same})
        print(f"{name}: {us:.0f} us a step ({rows[-1]['of_copy_bandwidth']:.1%}), same output as the first of "
              f"its form: {same}", file=sys.stderr)
    return rows


def pdl_chain() -> dict:
    """Programmatic dependent launch (kernels/pdl.py) on a batch-1 bf16 decode (`_decode_chain`),
    per form: cuBLAS or the Triton GEMV for the linears, with and without PDL, the GEMV with each
    program asking its first tiles into L2 before its wait; and the four GEMMs alone, chained.
    Microseconds a step and the share of the copy bandwidth for the bytes read (weights, keys and
    values); each form's output against the first's of its kind (PDL must not change a bit)."""
    from resident.worker.kernels import gemv as gemv_mod

    bw = _copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chain = _decode_chain()

    def gemv_with(prefetch: int) -> Callable:
        def lin(x, w):
            cfg = dataclasses.replace(gemv_mod.pick_config(x.shape[0], w.shape[0], w.shape[1], sms),
                                      prefetch_tiles=prefetch)
            return gemv_mod.gemv(x, w, config=cfg)
        return lin

    forms = []
    for kind in ("full", "gemms"):
        forms += [(kind, "cublas", F.linear, False)] + ([(kind, "cublas", F.linear, True)] if kind == "full" else [])
        forms += [(kind, "gemv", gemv_with(0), False)] + [
            (kind, f"gemv prefetch {p}" if p else "gemv", gemv_with(p), True) for p in (0, 1, 2, 4)]
    rows = _time_chains(chain, forms, bw)
    return {"copy_bw": bw, "layers": chain.layers, "context": chain.context, "rows": rows}


def _time_forms(row: dict, forms: dict[str, Callable], ws: list[torch.Tensor], ref: torch.Tensor, nbytes: int,
                bw: float) -> dict[str, dict]:
    """Time each form (a function of one weight) over all of `ws` in a CUDA graph into `row`
    (µs per call, share of the copy bandwidth for `nbytes`, max error against `ref` relative to its
    largest value; a form that does not build: its error); returns the timed ones."""
    for label, f in forms.items():
        try:
            err = ((f(ws[0]).double() - ref.double()).abs().max() / ref.abs().max()).item()
            us = _graph_us(lambda f=f: [f(w) for w in ws], reps=10) / len(ws)
        except Exception as e:  # noqa: BLE001 - a shape that does not build here: listed
            row[label] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            continue
        row[label] = {"us": us, "of_copy_bandwidth": nbytes / (us * 1e-6) / bw, "max_error_of_max_out": err}
    return {lbl: v for lbl, v in row.items() if isinstance(v, dict) and "us" in v}


def _fastest(timed: dict[str, dict], prefix: str) -> str | None:
    """The label of the fastest timed form whose label starts with `prefix` (None: none)."""
    return min((lbl for lbl in timed if lbl.startswith(prefix)), key=lambda lbl: timed[lbl]["us"], default=None)


@triton.jit
def _fma_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn,
                     ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """out[0, rows] = w[rows, :] . x[0, :] for one program's ROWS rows (M = 1, K % BLOCK_K == 0):
    [ROWS, BLOCK_K] weight tiles in registers (16-byte loads), float32 products summed per tile.
    EARLY (with PDL): the first tile is loaded before the wait for the kernel before (the weight is
    never written), the activation after it."""
    pid = tl.program_id(0)
    offs = pid * ROWS + tl.arange(0, ROWS)
    rows = tl.minimum(offs, N - 1)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    _pdl.launch_next(PDL)
    if EARLY:
        w = tl.load(w_ptrs)
        _pdl.wait_previous(PDL)
        acc = tl.sum(w.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :], axis=1)
        start = BLOCK_K
    else:
        _pdl.wait_previous(PDL)
        acc = tl.zeros([ROWS], dtype=tl.float32)
        start = 0
    for k0 in range(start, K, BLOCK_K):
        w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptr + k0 + cols)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < N)


def _fma_gemv(x: torch.Tensor, w: torch.Tensor, rows: int, block_k: int, warps: int, early: bool = False):
    n, k = w.shape
    assert x.shape[0] == 1 and k % block_k == 0 and x.stride(-1) == 1 and w.stride(-1) == 1
    pdl_opts = _pdl.launch(x.device, 1)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _fma_gemv_kernel[(triton.cdiv(n, rows),)](x, w, out, n, k, w.stride(0), ROWS=rows, BLOCK_K=block_k,
                                              EARLY=early and pdl_opts["PDL"], num_warps=warps, **pdl_opts)
    return out


def gemv_designs() -> dict:
    """A GEMV of another design for batch-1 bf16 decode (`_fma_gemv_kernel`: no tensor cores, no
    split-K, the weight in registers): per Llama-3-8B shape over ROWS x BLOCK_K x warps against
    cuBLAS and `kernels/gemv.py` (each over copies of the weight totalling >= 256 MiB, so it comes
    from HBM); then the best per shape in the 32-layer chains (`_decode_chain`): without PDL, with
    it, with the first weight tile loaded before the wait — against cuBLAS with and without PDL on
    the other kernels (the engine's default)."""
    from resident.worker.kernels import gemv as gemv_mod

    bw = _copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes, best = [], {}
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        ws = [torch.empty(n, k, device="cuda", dtype=torch.bfloat16).normal_(0, k ** -0.5)
              for _ in range(max(1, -(-256 * MiB // nbytes)))]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        forms = {"cublas": lambda w: F.linear(x, w),
                 "gemv picked": lambda w: gemv_mod.gemv(x, w, config=gemv_mod.pick_config(1, n, k, sms))}
        for rows in (8, 16, 32):
            for block_k in (512, 1024, 2048):
                for warps in (4, 8):
                    if rows * block_k // (32 * warps) > 256:          # > 256 weight elements a thread
                        continue
                    forms[f"fma {rows}x{block_k} w{warps}"] = (
                        lambda w, r=rows, b=block_k, wp=warps: _fma_gemv(x, w, r, b, wp))
        row = {"name": name, "n": n, "k": k, "copies": len(ws)}
        timed = _time_forms(row, forms, ws, ref, nbytes, bw)
        top = _fastest(timed, "fma")
        best[(n, k)] = tuple(int(v) for v in top.split()[1].split("x")) + (int(top.split()[2][1:]),)
        row["best_fma"] = top
        shapes.append(row)
        print(f"{name}: cublas {timed['cublas']['us']:.1f} us ({timed['cublas']['of_copy_bandwidth']:.0%}), "
              f"gemv {timed['gemv picked']['us']:.1f}, best {top} {timed[top]['us']:.1f} us "
              f"({timed[top]['of_copy_bandwidth']:.0%})", file=sys.stderr)
        del ws

    def fma(early: bool) -> Callable:
        return lambda x, w: _fma_gemv(x, w, *best[tuple(w.shape)], early=early)

    chain = _decode_chain()
    forms = []
    for kind in ("gemms", "full"):
        forms += [(kind, "cublas", F.linear, False), (kind, "cublas", F.linear, True),
                  (kind, "fma", fma(False), False), (kind, "fma", fma(False), True),
                  (kind, "fma prefetch early", fma(True), True)]
    rows = _time_chains(chain, forms, bw)
    return {"copy_bw": bw, "shapes": shapes, "best": {f"{n}x{k}": v for (n, k), v in best.items()}, "chains": rows}


def fp8_row_gemv() -> dict:
    """The one-row GEMV over fp8 weights (`row_gemv.row_gemv_fp8`, opt-in under RESIDENT_GEMV=on)
    per Llama-3-8B shape over ROWS x BLOCK_K x warps against `torch._scaled_mm` (what the engine
    runs), each over copies of the weight totalling >= 256 MiB: microseconds, share of the copy
    bandwidth, error against the float64 product of the same fp8 operands."""
    from resident.worker.kernels import row_gemv
    from resident.worker.layers.linear import fp8_fast_accum

    bw = _copy_bandwidth()
    f8 = torch.float8_e4m3fn
    rows_out = []
    for name, n, k in SHAPES:
        nbytes = n * k
        ws = [(torch.randn(n, k, device="cuda") * 100).clamp(-440, 440).to(f8)
              for _ in range(max(1, -(-256 * MiB // nbytes)))]
        x_q = (torch.randn(1, k, device="cuda") * 100).clamp(-440, 440).to(f8)
        s_a, s_w = torch.tensor(0.013, device="cuda"), torch.tensor(0.0007, device="cuda")
        ref = (x_q.double() @ ws[0].double().T) * (0.013 * 0.0007)
        forms = {"scaled_mm": lambda w: torch._scaled_mm(x_q, w.t(), scale_a=s_a, scale_b=s_w, out_dtype=torch.bfloat16,
                                                         use_fast_accum=fp8_fast_accum(1)),
                 f"row picked {row_gemv.pick_config(n, k, fp8=True)}":
                     lambda w: row_gemv.row_gemv_fp8(x_q, s_a, w, s_w, None, torch.bfloat16)}
        for rows in (2, 4, 8, 16, 32):     # (2 and 4: session 14)
            for block_k in (1024, 2048, 4096):
                for warps in (2, 4, 8):
                    if k % block_k or rows * block_k // (32 * warps) > 512 or block_k < 256 * warps:
                        continue
                    cfg = row_gemv.RowConfig(rows, block_k, warps)
                    forms[f"row {rows}x{block_k} w{warps}"] = (
                        lambda w, cfg=cfg: row_gemv.row_gemv_fp8(x_q, s_a, w, s_w, None, torch.bfloat16, config=cfg))
        # W8A16: the same fp8 weights against a bf16 activation (x_q's values exactly, so the same
        # reference): no activation quantization at all; `_launch` takes any x dtype
        x16 = x_q.to(torch.bfloat16).reshape(-1)
        for rows, block_k, warps in ((8, 1024, 8), (8, 2048, 8), (16, 1024, 4), (16, 2048, 8), (32, 1024, 8)):
            if k % block_k == 0:
                cfg = row_gemv.RowConfig(rows, block_k, warps)

                def w8a16(w, cfg=cfg):
                    out = torch.empty((1, w.shape[0]), dtype=torch.bfloat16, device="cuda")
                    row_gemv._launch(x16, w, None, out, s_a.reshape(1), s_w.reshape(1), cfg)
                    return out
                forms[f"w8a16 {rows}x{block_k} w{warps}"] = w8a16
        row = {"name": name, "n": n, "k": k, "copies": len(ws)}
        timed = _time_forms(row, forms, ws, ref, nbytes, bw)
        best16 = _fastest(timed, "w8a16 ")
        if best16:
            print(f"{name}: best {best16} {timed[best16]['us']:.1f} us", file=sys.stderr)
        top = _fastest(timed, "row ")
        rows_out.append(row)
        print(f"{name}: scaled_mm {timed['scaled_mm']['us']:.1f} us ({timed['scaled_mm']['of_copy_bandwidth']:.0%}), "
              f"best {top} {timed[top]['us']:.1f} us ({timed[top]['of_copy_bandwidth']:.0%})", file=sys.stderr)
        del ws
    return {"copy_bw": bw, "shapes": rows_out}


PROBES = {"l2-prefetch": l2_prefetch, "fp8-gemm": fp8_gemm, "small-kernels": small_kernels, "attention": attention,
          "bf16-gemm": bf16_gemm, "attention-fp8": attention_fp8,
          "pdl-chain": pdl_chain, "gemv-designs": gemv_designs, "fp8-row-gemv": fp8_row_gemv}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("these probes need a CUDA GPU")
    result = {"probe": args.probe, "gpu": torch.cuda.get_device_name(0), **PROBES[args.probe]()}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

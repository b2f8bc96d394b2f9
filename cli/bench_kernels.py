"""`resident bench kernels`: the fp8 linear's parts on one GPU, at Llama-3-8B shapes.

For each token count M (decode batches and a prefill chunk) and each projection of a
Llama-3-8B layer (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) it
times, in microseconds per call:

- `quant ref`: the reference activation quantization (eager torch ops: cast, abs, amax,
  divide, clamp, divide, clamp, cast) — what fp8 decode paid before the fused kernel;
- `quant fused`: the Triton kernel (`kernels/fp8_quant.py`), on the path it picks;
- `quant two` / `quant coop`: the same forced onto its two-kernel path and onto its one-launch
  cooperative kernel (`-` at sizes of the one-program path, and for coop where the grid has more
  programs than the GPU has SMs);
- `fp8 linear`: the whole fp8 GEMM as the engine runs it (fused quantization + `_scaled_mm`;
  at M <= `fp8_gemv.MAX_TOKENS` the GEMV kernel instead);
- `bf16 linear`: `F.linear` on bf16 weights of the same shape;
- `weight roofline`: the weight bytes (1 per fp8 element) over the device's copy bandwidth
  (a 2 GiB device-to-device copy: read + written bytes per second), the GEMM's lower bound
  at decode sizes, and its fraction of the measured fp8 linear time.

A second table compares, at `--gemv-tokens` (decode batch sizes), the decode GEMV kernel
(`kernels/fp8_gemv.py`: after the quantize kernel, and with the quantization fused in) with
the quantize kernel + `_scaled_mm`: microseconds, weight bytes read per second (GB/s) and
that rate's share of the copy bandwidth, with the split-K factor the GEMV picked.

A third table does the same for bf16 weights (2 bytes per element): the split-K 16-bit GEMV
(`kernels/gemv.py`, taken at 2..16 tokens when RESIDENT_GEMV=on) and, at one token, the row
GEMV (`kernels/row_gemv.py`, what RESIDENT_GEMV=auto, the default, runs there on Hopper and
later) against `torch.matmul` (cuBLAS, what `F.linear` runs), at the four shapes and the LM
head (128256x4096; left to cuBLAS by the engine), to decide whether they beat cuBLAS on this GPU.

Calls are captured `--reps` at a time in a CUDA graph (as decode steps run in the engine)
and replayed `--iters` times between CUDA events; `--eager` times plain launches instead.
Random N(0, 1) activations, fp8 weights quantized per tensor from N(0, 0.02).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from resident.cli.bench_common import output_file
from resident.cli.common import format_table


#: (name, out_features N, in_features K) of one Llama-3-8B decoder layer's GEMMs.
LLAMA3_8B_LINEARS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
#: The LM head of Llama-3-8B, added to the bf16 GEMV comparison.
LLAMA3_8B_LM_HEAD = ("lm_head", 128256, 4096)
#: Token counts of the GEMV vs _scaled_mm comparison (decode batch sizes).
GEMV_TOKENS = (1, 8, 16, 64)
#: `fp8_gemv.MAX_SUPPORTED_TOKENS`, repeated so that parsing options imports neither torch nor triton.
GEMV_MAX_TOKENS = 64


def _parse_counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return counts


def _parse_gemv_counts(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    counts = _parse_counts(ctx, param, value)
    if max(counts) > GEMV_MAX_TOKENS:
        raise click.BadParameter(f"the GEMV kernel takes at most {GEMV_MAX_TOKENS} tokens, got {max(counts)}")
    return counts


def _time_us(fn: Callable[[], Any], reps: int, iters: int, graph: bool) -> float:
    """Microseconds per call of fn (CUDA events around graph replays or eager loops)."""
    import torch

    for _ in range(3):
        fn()                                  # compile / autotune / allocate outside the timing
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
    else:
        start.record()
        for _ in range(iters * reps):
            fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (iters * reps)


def _quant_path_us(x: Any, path: str, reps: int, iters: int, graph: bool) -> float | None:
    """Microseconds of the fused quantization forced onto `path` (two | coop); None where it does
    not apply."""
    import torch

    from resident.worker.kernels.fp8_quant import choose_path, coop_unsupported_reason, quantize_fp8_into
    from resident.worker.layers.linear import FP8_DTYPE

    if choose_path(x) == "small" or path == "coop" and coop_unsupported_reason(x) is not None:
        return None
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return _time_us(lambda: quantize_fp8_into(x, out, path=path), reps, iters, graph)


def copy_bandwidth_bytes_per_s() -> float:
    """Device-to-device copy rate of 2 GiB (read + written bytes per second)."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint16, device="cuda")
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), reps=1, iters=10, graph=False)
    return 2 * src.numel() * src.element_size() / (us / 1e6)


def _time_into(row: dict[str, Any], fns: Any, weight_bytes: int, bw: float, reps: int, iters: int,
               graph: bool) -> None:
    """Time each (key, fn) of `fns` into `row`: `<key>_us`, and the weight bytes read per second
    (`<key>_gb_s`) and as a share of the copy bandwidth (`<key>_of_copy`)."""
    for key, fn in fns:
        us = _time_us(fn, reps, iters, graph)
        row[f"{key}_us"] = us
        row[f"{key}_gb_s"] = weight_bytes / (us * 1e-6) / 1e9
        row[f"{key}_of_copy"] = weight_bytes / (us * 1e-6) / bw


def _gemv_rows(name: str, w_q: Any, w_scale: Any, token_counts: list[int], bw: float, reps: int, iters: int,
               graph: bool) -> list[dict[str, Any]]:
    """The GEMV (unfused, fused) vs quantize + `_scaled_mm` at each token count, for one weight."""
    import torch

    from resident.worker.kernels.fp8_gemv import MAX_SUPPORTED_TOKENS, fp8_gemv, pick_config
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor

    def scaled_mm(x: torch.Tensor) -> torch.Tensor:
        x_q, s_a = quantize_fp8_per_tensor(x)
        return torch._scaled_mm(x_q, w_q.t(), scale_a=s_a, scale_b=w_scale, out_dtype=x.dtype)

    def gemv(x: torch.Tensor) -> torch.Tensor:
        x_q, s_a = quantize_fp8_per_tensor(x)
        return fp8_gemv(x_q, s_a, w_q, w_scale, None, x.dtype)

    n, k = w_q.shape
    sms = torch.cuda.get_device_properties(w_q.device).multi_processor_count
    rows = []
    for m in token_counts:
        if m > MAX_SUPPORTED_TOKENS:
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row: dict[str, Any] = {"linear": name, "n": n, "k": k, "tokens": m,
                               "split_k": pick_config(m, n, k, sms).split_k}
        _time_into(row, (("scaled_mm", lambda: scaled_mm(x)), ("gemv", lambda: gemv(x)),
                         ("gemv_fused", lambda: fp8_gemv(x, None, w_q, w_scale, None, x.dtype, fuse_quant=True))),
                   n * k, bw, reps, iters, graph)
        rows.append(row)
    return rows


def _gemv16_rows(name: str, w: Any, token_counts: list[int], bw: float, reps: int, iters: int,
                 graph: bool) -> list[dict[str, Any]]:
    """The 16-bit GEMV vs `torch.matmul` at each token count, for one bf16 weight."""
    import torch

    from resident.worker.kernels import row_gemv
    from resident.worker.kernels.fp8_gemv import MAX_SUPPORTED_TOKENS
    from resident.worker.kernels.gemv import gemv, pick_config

    n, k = w.shape
    nbytes = n * k * w.element_size()
    sms = torch.cuda.get_device_properties(w.device).multi_processor_count
    rows = []
    for m in token_counts:
        if m > MAX_SUPPORTED_TOKENS:
            continue
        x = torch.randn(m, k, device="cuda", dtype=w.dtype)
        row: dict[str, Any] = {"linear": name, "n": n, "k": k, "tokens": m,
                               "split_k": pick_config(m, n, k, sms).split_k}
        fns = [("matmul", lambda: torch.matmul(x, w.t())), ("gemv", lambda: gemv(x, w))]
        if m == 1 and row_gemv.pick_config(n, k) is not None:
            fns.append(("row_gemv", lambda: row_gemv.row_gemv(x, w)))
        _time_into(row, fns, nbytes, bw, reps, iters, graph)
        rows.append(row)
    return rows


def _linear_rows(name: str, n: int, k: int, token_counts: list[int], gemv_counts: list[int], bw: float, reps: int,
                 iters: int, graph: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One linear's rows, fp8 GEMV rows and bf16 GEMV rows; its weights are freed on return."""
    import torch
    import torch.nn.functional as F

    from resident.worker.kernels.fp8 import fp8_linear
    from resident.worker.kernels.fp8_quant import quantize_fp8_per_tensor
    from resident.worker.layers.linear import FP8_DTYPE, FP8_MAX, quantize_fp8_per_tensor_dynamic

    rows = []
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w_scale = (w.float().abs().amax() / FP8_MAX).reshape(())
    w_q = (w.float() / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    for m in token_counts:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"linear": name, "n": n, "k": k, "tokens": m,
               "quant_ref_us": _time_us(lambda: quantize_fp8_per_tensor_dynamic(x), reps, iters, graph),
               "quant_fused_us": _time_us(lambda: quantize_fp8_per_tensor(x), reps, iters, graph),
               "quant_two_us": _quant_path_us(x, "two", reps, iters, graph),
               "quant_coop_us": _quant_path_us(x, "coop", reps, iters, graph),
               "fp8_linear_us": _time_us(lambda: fp8_linear(x, w_q, w_scale), reps, iters, graph),
               "bf16_linear_us": _time_us(lambda: F.linear(x, w), reps, iters, graph),
               "weight_roofline_us": n * k / bw * 1e6}
        row["fp8_of_roofline"] = row["weight_roofline_us"] / row["fp8_linear_us"]
        rows.append(row)
    gemv_rows = _gemv_rows(name, w_q, w_scale, gemv_counts, bw, reps, iters, graph)
    gemv16_rows = _gemv16_rows(name, w, gemv_counts, bw, reps, iters, graph)
    return rows, gemv_rows, gemv16_rows


def run_kernel_bench(token_counts: list[int], reps: int, iters: int, graph: bool,
                     gemv_tokens: list[int] | None = None) -> dict[str, Any]:
    """Rows per (linear, token count); `gemv_rows` (fp8) and `gemv16_rows` (bf16, + the LM head)
    per (linear, gemv token count) (None: GEMV_TOKENS; counts above the GEMV's
    MAX_SUPPORTED_TOKENS are left out)."""
    import torch

    bw = copy_bandwidth_bytes_per_s()
    rows = []
    gemv_rows = []
    gemv16_rows = []
    gemv_counts = list(GEMV_TOKENS if gemv_tokens is None else gemv_tokens)
    for name, n, k in LLAMA3_8B_LINEARS:
        linear_rows, linear_gemv_rows, linear_gemv16_rows = _linear_rows(name, n, k, token_counts, gemv_counts, bw,
                                                                         reps, iters, graph)
        rows += linear_rows
        gemv_rows += linear_gemv_rows
        gemv16_rows += linear_gemv16_rows
        torch.cuda.empty_cache()   # this linear's weights are gone with _linear_rows' frame
    name, n, k = LLAMA3_8B_LM_HEAD
    gemv16_rows += _gemv16_rows(name, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, gemv_counts,
                                bw, reps, iters, graph)
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_gb_s": bw / 1e9,
            "graph": graph, "reps": reps, "iters": iters, "rows": rows, "gemv_rows": gemv_rows,
            "gemv16_rows": gemv16_rows}


@click.command("kernels")
@click.option("--tokens", "token_counts", default="1,64,2048", show_default=True, callback=_parse_counts,
              help="Comma-separated token counts (decode batch sizes, prefill chunk).")
@click.option("--gemv-tokens", "gemv_tokens", default=",".join(map(str, GEMV_TOKENS)), show_default=True,
              callback=_parse_gemv_counts,
              help="Token counts of the GEMV comparisons (fp8 vs _scaled_mm, bf16 vs torch.matmul; at most 64).")
@click.option("--reps", default=20, show_default=True, type=click.IntRange(min=1),
              help="Calls per captured graph (or per eager timing loop).")
@click.option("--iters", default=20, show_default=True, type=click.IntRange(min=1), help="Timed replays.")
@click.option("--eager", is_flag=True, help="Time eager launches instead of CUDA-graph replays.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Write results here.")
def bench_kernels(token_counts: list[int], gemv_tokens: list[int], reps: int, iters: int, eager: bool,
                  json_path: Path | None) -> None:
    """fp8 activation quantization (reference vs fused), fp8 vs bf16 linears, decode GEMVs at Llama-3-8B shapes."""
    import torch

    if not torch.cuda.is_available():
        raise click.UsageError("bench kernels needs a CUDA GPU (the kernels it times are GPU kernels)")
    doc = run_kernel_bench(token_counts, reps, iters, graph=not eager, gemv_tokens=gemv_tokens)
    click.echo(f"{doc['gpu']}, torch {doc['torch']}; copy bandwidth {doc['copy_bandwidth_gb_s']:.0f} GB/s; "
               f"{'CUDA-graph replays' if doc['graph'] else 'eager launches'}; microseconds per call")
    click.echo(format_table(
        ["LINEAR", "N x K", "TOKENS", "QUANT REF", "QUANT FUSED", "QUANT TWO", "QUANT COOP", "FP8 LINEAR",
         "BF16 LINEAR", "ROOFLINE", "FP8 OF ROOFLINE"],
        [[r["linear"], f"{r['n']}x{r['k']}", r["tokens"], f"{r['quant_ref_us']:.1f}", f"{r['quant_fused_us']:.1f}",
          *("-" if r[key] is None else f"{r[key]:.1f}" for key in ("quant_two_us", "quant_coop_us")),
          f"{r['fp8_linear_us']:.1f}", f"{r['bf16_linear_us']:.1f}", f"{r['weight_roofline_us']:.1f}",
          f"{100 * r['fp8_of_roofline']:.0f} %"] for r in doc["rows"]]))
    click.echo("\nfp8 decode GEMV vs quantize + _scaled_mm: microseconds per call, weight GB/s, % of copy bandwidth")
    click.echo(format_table(
        ["LINEAR", "N x K", "TOKENS", "SCALED_MM", "GB/S", "OF COPY", "GEMV", "GB/S", "OF COPY", "GEMV FUSED",
         "GB/S", "OF COPY", "SPLIT K"],
        [[r["linear"], f"{r['n']}x{r['k']}", r["tokens"],
          *(v for key in ("scaled_mm", "gemv", "gemv_fused")
            for v in (f"{r[key + '_us']:.1f}", f"{r[key + '_gb_s']:.0f}", f"{100 * r[key + '_of_copy']:.0f} %")),
          r["split_k"]] for r in doc["gemv_rows"]]))
    click.echo("\nbf16 decode GEMVs vs torch.matmul: microseconds per call, weight GB/s, % of copy bandwidth "
               "(row GEMV: one token)")
    click.echo(format_table(
        ["LINEAR", "N x K", "TOKENS", "MATMUL", "GB/S", "OF COPY", "GEMV", "GB/S", "OF COPY", "SPLIT K", "ROW GEMV",
         "GB/S", "OF COPY"],
        [[r["linear"], f"{r['n']}x{r['k']}", r["tokens"],
          *(v for key in ("matmul", "gemv")
            for v in (f"{r[key + '_us']:.1f}", f"{r[key + '_gb_s']:.0f}", f"{100 * r[key + '_of_copy']:.0f} %")),
          r["split_k"],
          *((f"{r['row_gemv_us']:.1f}", f"{r['row_gemv_gb_s']:.0f}", f"{100 * r['row_gemv_of_copy']:.0f} %")
            if "row_gemv_us" in r else ("-", "-", "-"))] for r in doc["gemv16_rows"]]))
    if json_path:
        json_path.write_text(json.dumps(doc, indent=2))
        click.echo(f"wrote {json_path}")

"""`resident bench restart`'s report on the terminal: the run's header (model, device, the
floor, the daemon's preload), then one row per variant with its median exec -> ready, exec ->
first token, attach time and phases, and below each row what its runs add (ready minus the
paired floor, the daemon's share of attach, the last run's breakdown lines, the TP group).
"""
from __future__ import annotations

import click

LABELS = {"hf": "(a) HF transformers", "cold": "(b) resident --preload off", "warm": "(c) resident + daemon",
          "warm-fe": "(d) (c) + --frontend process"}


def report(results: dict, variants: list[str]) -> None:
    """Print the header, then a row per variant (in `variants`' order) and its notes."""
    _echo_header(results)
    keys = list(dict.fromkeys(k for v in variants for k in results.get(v, {}).get("phases", {}) if k != "total"))
    click.echo(f"{'variant':<28}{'exec->ready':>12}{'exec->1st tok':>15}{'attach':>9}  "
               + "".join(f"{k:>12}" for k in keys))
    for v in variants:
        _echo_variant(v, results.get(v, {}), keys)


def _echo_header(results: dict) -> None:
    """Model, device and GPU, TP ranks, runs, the floor's measures, and the daemon's preload."""
    floor = results.get("floor", {})
    tp = results.get("tensor_parallel_size", 1)
    click.echo(f"model {results['model']} on {' '.join(x for x in (results['device'], results.get('gpu')) if x)}"
               + (f"; tensor parallel: {tp} ranks" if tp > 1 else "") + f"; median of "
               f"{results['runs']}; floor: import torch {floor.get('import_torch_s', 0):.2f} s"
               + (f", + CUDA init {floor['import_torch_cuda_init_s']:.2f} s" if "import_torch_cuda_init_s" in floor
                  else "")
               + (f"; on the worker's clock (process start -> torch imported) "
                  f"{floor['import_torch_from_start_s']:.2f} s" if "import_torch_from_start_s" in floor else "")
               + (f", CUDA context after it {floor['cuda_context_after_import_s']:.2f} s"
                  if "cuda_context_after_import_s" in floor else ""))
    pre = results.get("preload")
    if pre and "error" not in pre:
        click.echo(f"preload: {pre['bytes_read'] / 1e9:.2f} GB read in {pre['load_s']:.2f} s "
                   f"({pre['gb_s']:.2f} GB/s); {pre['resident_bytes'] / 1e9:.2f} GB resident")
    elif pre:
        click.echo(f"preload failed: {pre['error']}")


def _echo_variant(v: str, r: dict, keys: list[str]) -> None:
    """Variant `v`'s row (its medians over `keys`' phases), or why it has none, and its notes."""
    if "ready_s" not in r:
        click.echo(f"{LABELS[v]:<28}  failed: {r.get('error', 'not run')}")
        return
    attach = f"{r['attach_s'] * 1e3:.1f}ms" if "attach_s" in r else "-"
    click.echo(f"{LABELS[v]:<28}{r['ready_s']:>11.2f}s{r['first_token_s']:>14.2f}s{attach:>9}  "
               + "".join(f"{r['phases'][k]:>11.2f}s" if k in r["phases"] else f"{'-':>12}" for k in keys))
    if "error" in r:
        click.echo(f"{'':<28}  (later runs failed: {r['error']})")
    if "above_floor_s" in r:
        per_run = ", ".join(f"{x['above_floor_s']:.2f}" for x in r["runs"] if "above_floor_s" in x)
        after = ", ".join(f"{x['after_imports_s']:.2f}" for x in r["runs"] if "after_imports_s" in x)
        click.echo(f"{'':<28}  ready - floor (a floor process right before each run): {r['above_floor_s']:.2f} s "
                   f"median (per run {per_run}); after the imports {r.get('after_imports_s', 0):.2f} s "
                   f"(per run {after})")
    if "daemon_attach_s" in r:
        click.echo(f"{'':<28}  attach: the daemon's Attach handler took {r['daemon_attach_s'] * 1e3:.2f} ms of it "
                   "on average; the rest is the client (RPC transport, fds, mapping, table)")
    last = r["runs"][-1] if r.get("runs") else {}
    for key in ("import_breakdown", "weights_breakdown", "attach_breakdown", "kv_alloc_breakdown",
                "warmup_breakdown", "cpu_breakdown", "cuda_preinit", "triton_prefetch", "gemm_prefetch"):
        if key in last:
            click.echo(f"{'':<28}  {key.replace('_', ' ')} (last run): {last[key]}")
    if "tp_group_s" in r:
        ranks = "; ".join(f"rank {x['rank']}: import {x['import_s']:.2f} s, group {x['group_s']:.2f} s, shard "
                          f"{x['shard_s']:.2f} s ({x['source']})" for x in last.get("tp_ranks", []))
        attach = ", ".join(f"{a * 1e3:.1f}" for a in last.get("attach_s_per_rank", []))
        click.echo(f"{'':<28}  TP group formed in {r['tp_group_s']:.2f} s (in rank 0's weights phase)"
                   + (f"; {ranks}" if ranks else "") + (f"; attach per rank (ms): {attach}" if attach else ""))

"""`resident bench throughput --profile`: where a decode step's time goes, by kernel category.

After a batch size's timed steps, a few more decode steps of the same batch run under
`torch.profiler`: first with the decode graph's forward run *eagerly* (the captured graph's
own Python forward, `DecodeGraphs.eager_logits`, so the kernels are those the graph
recorded, each visible on its own), then a few as graph replays. Device time is summed per
kernel name and the names are sorted into categories by `PATTERNS`; per category the
report gives µs per step and the share of the step time the timed replays measured. The
GEMM category also gets the GB/s it achieves over the weight bytes the GEMMs read.

"step − kernels" (the gap) is the timed graph step time minus the eager kernel sum. It
assumes the graph runs the same kernels as the eager forward (true by construction here:
the graph was captured from that forward) and that kernel durations are the same in both
modes; it then counts every moment the GPU is idle within a step: launch gaps inside the
graph and the host's work between graph replays (scheduling, input staging, the sampler's
host side, reading the sampled tokens back). The graph-mode pass reports the kernels the
profiler saw during replays, a check of that assumption (CUPTI reports a replayed graph's
kernels on recent drivers; where it does not, only the kernels outside the graph appear).

The gap is then split in two by timing the graph the last step replayed (its bucket size)
replayed back to back, with no host work between replays (`time_replays`, CUDA events):
`gap_inside_graph_us` = that replay time − the eager kernel sum (the GPU idling inside the
graph), `gap_between_replays_us` = the timed step − that replay time (the host's work between
replays). Both are as measured, so noise can make one slightly negative. The eager kernel sum
also holds the kernels a step runs outside the graph (`DecodeGraphs.load`'s input copies, the
sampler's, the logits copy), which the back-to-back replays do not: the inside figure is low
by their time and the between figure high by it (the sampling and copies rows bound them).

On CPU there are no kernels: the same report covers the PyTorch ops' self CPU time (the
reference kernels), each classified by the innermost function of worker/kernels or
worker/layers it ran in (the profiler records Python frames there), else by its own name.

Classification and aggregation (`classify`, `summarize`) are pure functions over
`KernelTime` lists; only `profile_decode` needs torch.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

log = logging.getLogger(__name__)

#: Report order of the categories, and the label each prints with.
CATEGORIES: dict[str, str] = {
    "gemm": "GEMM/GEMV",
    "attention": "attention",          # on CUDA decode also the rotation and the KV write (one kernel)
    "norm": "norm/residual",
    "rotary_kv": "rotary+KV write",
    "activation": "activation (silu-mul)",
    "quantization": "quantization (fp8 act)",
    "sampling": "sampling/logits",
    "copies": "copies/memsets",
    "other": "other",
}

#: (category, regular expression) searched case-insensitively in a kernel or op name; the
#: first match wins, so the specific names come before the generic ones. Unmatched names are
#: "other" and the biggest are listed by name: add a row here when one shows up.
PATTERNS: tuple[tuple[str, str], ...] = (
    # Our Triton kernels, by function name (worker/kernels/*.py, worker/custom_allreduce.py).
    ("attention", r"_decode_kernel|_merge_splits_kernel|_prefill_kernel"),
    ("quantization", r"_quantize_small_kernel|_quantize_kernel|_absmax_kernel"),
    ("gemm", r"_fp8_gemv_kernel"),
    ("norm", r"_rms_norm_kernel|_ar_add_rms_norm_kernel"),
    ("rotary_kv", r"_rotary_kv_kernel"),
    ("activation", r"_silu_and_mul_kernel"),
    ("sampling", r"_argmax_chunk_kernel|_argmax_merge_kernel"),
    # cuBLAS / cuBLASLt / CUTLASS (torch.mm, F.linear, torch._scaled_mm): sm90_xmma_gemm_*,
    # nvjet_*, cutlass3x_*, gemv2T_kernel, gemvx, gemmSN_*, splitKreduce_kernel; on CPU the
    # reference fp8 GEMM (linear.fp8_scaled_mm_reference).
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|splitkreduce|cublas|scaled_mm"),
    ("rotary_kv", r"rotary|reshape_and_cache|write_kv"),   # before attention: layers/attention.write_kv
    ("attention", r"flash|fmha|paged_attention|attention"),
    # PyTorch's elementwise/reduce kernels (elementwise_kernel, vectorized_elementwise_kernel,
    # reduce_kernel) carry their functor in the name; sort by that.
    ("activation", r"silu|gelu|swiglu"),
    ("norm", r"rms_?norm|layer_?norm|rsqrt"),
    ("quantization", r"quantize|scaled_fp8_quant"),
    ("sampling", r"argmax|argmin|softmax|topk|top_k|sort|multinomial|exponential|cumsum|sampler|compute_logits"),
    # Runtime copies (Memcpy HtoD/DtoH/DtoD, Memset), PyTorch's copy/fill kernels, gathers of
    # embedding rows (indexSelect*).
    ("copies", r"memcpy|memset|copy|fill|catarraybatchedcopy|indexselect|index_select"),
    # CPU ops of the reference path (aten::*), when the kernel name itself said nothing.
    ("gemm", r"^aten::(mm|addmm|bmm|matmul|linear|_scaled_mm)$"),
    ("attention", r"^aten::_?scaled_dot_product"),
    ("quantization", r"^aten::amax$"),
    ("copies", r"^aten::(clone|to|_to_copy|contiguous|cat|embedding|zero_|zeros|full|index_put_|scatter_?)$"),
)

_COMPILED = tuple((cat, re.compile(rx, re.IGNORECASE)) for cat, rx in PATTERNS)
#: A Python frame of our kernels or layers as the profiler names it:
#: "…/worker/kernels/reference.py(45): rotary_kv_write".
_OUR_FRAME = re.compile(r"worker/(?:kernels|layers)/(\w+)\.py\(\d+\): (\w+)")

#: Decode steps each profiled pass runs (eager, then graph replays), after one unprofiled
#: eager step that absorbs first-use work.
NUM_PROFILE_STEPS = 3
#: Decode steps the profile adds to a request beyond the timed ones (at most).
EXTRA_STEPS = 1 + 2 * NUM_PROFILE_STEPS
#: Back-to-back graph replays timed to split the gap, after NUM_REPLAY_WARMUP untimed ones.
NUM_TIMED_REPLAYS = 20
NUM_REPLAY_WARMUP = 2

ASSUMPTION = ("gap = timed graph step time - eager kernel sum; assumes the graph runs the same kernels as the "
              "eager forward, with the same durations; it counts launch gaps inside the graph and host work "
              "between replays")


@dataclass(frozen=True)
class KernelTime:
    """One kernel (or, on CPU, one op's self time) seen by the profiler.

    `scopes`: the functions of worker/kernels and worker/layers it ran in, innermost first
    ("reference.rotary_kv_write"; CPU only), which decide before the name does.
    `ancestors`: the ops it ran under, innermost first (a kernel's launching op and that op's
    parents), which decide when the name says nothing."""

    name: str
    us: float
    ancestors: tuple[str, ...] = ()
    scopes: tuple[str, ...] = ()


def classify(name: str, ancestors: Sequence[str] = (), scopes: Sequence[str] = ()) -> str:
    """The category (a key of CATEGORIES): of the innermost scope that has one, else of the name,
    else of the nearest ancestor op that has one, else "other"."""
    for n in (*scopes, name, *ancestors):
        for cat, rx in _COMPILED:
            if rx.search(n):
                return cat
    return "other"


def summarize(events: Sequence[KernelTime], *, num_steps: int, step_s: float, gemm_weight_bytes: int,
              copy_bandwidth: float, time_source: str = "device", top: int = 5) -> dict[str, Any]:
    """Per-category µs per step and share of `step_s`, the gap, GEMM GB/s and the top "other" names.

    `events` cover `num_steps` steps; `step_s` is the timed step time; `gemm_weight_bytes`
    the bytes of weights the GEMMs of one step read; `copy_bandwidth` the device's measured
    copy bandwidth (read + write bytes per second), for comparison."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    step_us = step_s * 1e6
    us = dict.fromkeys(CATEGORIES, 0.0)
    calls = dict.fromkeys(CATEGORIES, 0)
    other: dict[str, list[float]] = {}
    for e in events:
        cat = classify(e.name, e.ancestors, e.scopes)
        us[cat] += e.us
        calls[cat] += 1
        if cat == "other":
            o = other.setdefault(e.name, [0.0, 0])
            o[0] += e.us
            o[1] += 1
    kernel_us = sum(us.values()) / num_steps
    categories = {c: {"us_per_step": us[c] / num_steps, "fraction_of_step": us[c] / num_steps / step_us,
                      "calls_per_step": calls[c] / num_steps} for c in CATEGORIES}
    gemm_s = us["gemm"] / num_steps * 1e-6
    gemm_bps = gemm_weight_bytes / gemm_s if gemm_s > 0 else None
    top_other = [{"name": n, "us_per_step": t / num_steps, "calls_per_step": k / num_steps}
                 for n, (t, k) in sorted(other.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"mode": "eager", "time_source": time_source, "num_steps": num_steps, "step_us": step_us,
            "kernel_us_per_step": kernel_us, "calls_per_step": sum(calls.values()) / num_steps,
            "gap_us_per_step": step_us - kernel_us, "gap_fraction": (step_us - kernel_us) / step_us,
            "categories": categories, "gemm_weight_bytes": gemm_weight_bytes, "gemm_bytes_per_s": gemm_bps,
            "copy_bandwidth_bytes_per_s": copy_bandwidth,
            "gemm_fraction_of_copy_bandwidth": gemm_bps / copy_bandwidth if gemm_bps and copy_bandwidth else None,
            "top_other": top_other, "assumption": ASSUMPTION}


def gemm_weight_bytes(tensors: dict) -> int:
    """Bytes of the matrices a decode step's GEMMs read: every 2-D weight, the embedding table
    only when it is the (tied) LM head."""
    total = 0
    for name, t in tensors.items():
        if t.dim() != 2 or (name == "model.embed_tokens.weight" and "lm_head.weight" in tensors):
            continue
        total += t.numel() * t.element_size()
    return total


# --- collection (torch) ---------------------------------------------------------------------
def kernel_times(events: Sequence[Any], on_gpu: bool) -> list[KernelTime]:
    """KernelTimes from `torch.profiler` FunctionEvents: device kernels/copies on a GPU (with
    their launching op as ancestors), ops' self CPU time on CPU (with the Python frames of our
    kernels and layers as scopes, when profiled with_stack)."""
    from torch.autograd import DeviceType

    def chain(e: Any) -> tuple[str, ...]:
        names = []
        while e is not None:
            if not getattr(e, "is_python_function", False):
                names.append(e.name)
            e = e.cpu_parent
        return tuple(names)

    def scopes(e: Any) -> tuple[str, ...]:
        names = []
        while e is not None:
            m = _OUR_FRAME.search(e.name) if getattr(e, "is_python_function", False) else None
            if m:
                names.append(f"{m[1]}.{m[2]}")
            e = e.cpu_parent
        return tuple(names)

    if not on_gpu:
        return [KernelTime(e.name, e.self_cpu_time_total, chain(e.cpu_parent), scopes(e.cpu_parent)) for e in events
                if e.device_type == DeviceType.CPU and not e.is_async and not getattr(e, "is_python_function", False)]
    # Ops (frontend events: linked to nothing) by correlation id; a kernel links to the op that launched it.
    launchers = {e.id: e for e in events if e.device_type == DeviceType.CPU and not e.is_async
                 and not getattr(e, "linked_correlation_id", 0)}
    out = []
    for e in events:
        if e.device_type == DeviceType.CPU:
            continue
        launcher = launchers.get(getattr(e, "linked_correlation_id", 0) or -1)
        out.append(KernelTime(e.name, e.time_range.elapsed_us(), chain(launcher)))
    return out


def _profiled(step: Callable[[], int], num_steps: int, on_gpu: bool, num_tokens: int) -> list[KernelTime]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    # Python frames only on CPU, where op names alone cannot tell the reference kernels apart.
    with profile(activities=activities, with_stack=not on_gpu) as prof:
        decoded = [step() for _ in range(num_steps)]
    if any(n != num_tokens for n in decoded):
        raise RuntimeError(f"the batch changed while profiling (tokens per step {decoded}, expected {num_tokens})")
    return kernel_times(prof.events(), on_gpu)


@contextlib.contextmanager
def graph_forward_eagerly(runner: Any) -> Iterator[None]:
    """While inside, decode batches that would replay a captured graph run that graph's
    forward eagerly instead (same inputs through the static buffers, same kernels)."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        yield
        return

    def run(size: int, staged: Any, staged_tables: Any) -> Any:
        graphs.load(size, staged, staged_tables)
        return graphs.eager_logits(size)

    graphs.run = run  # shadows the method on this instance only
    try:
        yield
    finally:
        del graphs.run


@contextlib.contextmanager
def recording_replay_sizes(runner: Any) -> Iterator[list[int]]:
    """While inside, the batch size of every decode graph run (`DecodeGraphs.run`) is appended to
    the list yielded (which stays empty without graphs)."""
    sizes: list[int] = []
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        yield sizes
        return
    run = graphs.run

    def recorded(size: int, staged: Any, staged_tables: Any) -> Any:
        sizes.append(size)
        return run(size, staged, staged_tables)

    graphs.run = recorded  # shadows the method on this instance only
    try:
        yield sizes
    finally:
        del graphs.run


def time_replays(replay: Callable[[], Any], *, num_timed: int = NUM_TIMED_REPLAYS,
                 num_warmup: int = NUM_REPLAY_WARMUP, event: Callable[[], Any] | None = None,
                 synchronize: Callable[[], Any] | None = None) -> float:
    """µs per call of `replay` (a graph replay), called `num_timed` times back to back between two
    CUDA events after `num_warmup` untimed calls. Nothing of the host's runs between the replays,
    and the host queues them faster than the GPU runs them, so the GPU idles only where the graph
    itself leaves gaps. `event` and `synchronize` default to torch.cuda's."""
    if num_timed < 1:
        raise ValueError(f"num_timed must be >= 1, got {num_timed}")
    if event is None or synchronize is None:
        import torch

        event = event or partial(torch.cuda.Event, enable_timing=True)
        synchronize = synchronize or torch.cuda.synchronize
    for _ in range(num_warmup):
        replay()
    start, end = event(), event()
    start.record()
    for _ in range(num_timed):
        replay()
    end.record()
    synchronize()
    return start.elapsed_time(end) * 1e3 / num_timed  # elapsed_time is in ms


def replay_split(graphs: Any, sizes: Sequence[int], kernel_us: float, step_us: float,
                 **timing: Any) -> dict[str, Any]:
    """The gap split by back-to-back replays of the graph of the last size in `sizes` (see the
    module doc); a failure is logged and returned as {"replay_error": ...}, the rest of the
    profile stands. `timing`: keywords for `time_replays`."""
    try:
        if not sizes:
            raise RuntimeError("the graph-mode steps replayed no decode graph")
        size = sizes[-1]
        # DecodeGraphs keeps its captured (graph, logits) pairs private; this diagnostic reads
        # them rather than widen that class. The static inputs still hold the last step's batch:
        # replaying recomputes the same tokens at the same positions and rewrites the same KV
        # entries with the same values (and the logits buffer, already sampled), which is harmless.
        graph = graphs._graphs[size][0]
        replay_us = time_replays(graph.replay, **timing)
    except Exception as e:  # noqa: BLE001 - the profile without the split is still worth having
        log.warning("--profile: timing back-to-back graph replays failed (%s: %s); the gap is left unsplit",
                    type(e).__name__, e)
        return {"replay_error": f"{type(e).__name__}: {e}"}
    return {"replay_graph_size": size, "replay_us_per_step": replay_us,
            "gap_inside_graph_us": replay_us - kernel_us, "gap_between_replays_us": step_us - replay_us}


def profile_decode(step: Callable[[], int], step_s: float, *, runner: Any, on_gpu: bool, gemm_bytes: int,
                   copy_bandwidth: float) -> dict[str, Any]:
    """Profile decode steps of the running batch (`step` runs one engine step and returns the
    tokens it decoded, `step_s` is the timed step time); see the module doc. Runs at most EXTRA_STEPS steps.

    A failure of the profiler is logged and returned as {"error": ...}: the timed figures,
    already measured, are what the run is for."""
    try:
        return _profile_decode(step, step_s, runner=runner, on_gpu=on_gpu, gemm_bytes=gemm_bytes,
                               copy_bandwidth=copy_bandwidth)
    except Exception as e:  # noqa: BLE001 - any profiler failure; the benchmark's own figures stand
        log.warning("--profile failed (%s: %s); the throughput figures are unaffected, the profile is left out",
                    type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}


def _profile_decode(step: Callable[[], int], step_s: float, *, runner: Any, on_gpu: bool, gemm_bytes: int,
                    copy_bandwidth: float) -> dict[str, Any]:
    with graph_forward_eagerly(runner):
        num_tokens = step()  # first-use work (allocations of the eager forward) stays out of the profile
        eager = _profiled(step, NUM_PROFILE_STEPS, on_gpu, num_tokens)
    if not eager:
        raise RuntimeError("the profiler recorded no " + ("CUDA kernels (is CUPTI usable here?)" if on_gpu else "ops"))
    out = summarize(eager, num_steps=NUM_PROFILE_STEPS, step_s=step_s, gemm_weight_bytes=gemm_bytes,
                    copy_bandwidth=copy_bandwidth, time_source="device kernels" if on_gpu else "cpu op self time")
    graph = None
    if on_gpu and getattr(runner, "graphs", None) is not None:
        with recording_replay_sizes(runner) as sizes:
            seen = _profiled(step, NUM_PROFILE_STEPS, on_gpu, num_tokens)
        graph = {"kernel_us_per_step": sum(k.us for k in seen) / NUM_PROFILE_STEPS,
                 "calls_per_step": len(seen) / NUM_PROFILE_STEPS}
        out.update(replay_split(runner.graphs, sizes, out["kernel_us_per_step"], out["step_us"]))
    out["graph_mode"] = graph
    return out


# --- report ---------------------------------------------------------------------------------
def format_profile(title: str, p: dict[str, Any]) -> str:
    """The per-category table of one profiled row, with the gap, GEMM GB/s and top "other" names."""
    from resident.cli.common import format_table

    if "error" in p:
        return f"{title}: no profile ({p['error']})"
    rows = [[CATEGORIES[c], f"{v['us_per_step']:.1f}", f"{100 * v['fraction_of_step']:.1f}%",
             f"{v['calls_per_step']:.0f}"] for c, v in p["categories"].items()]
    rows.append(["kernels total", f"{p['kernel_us_per_step']:.1f}",
                 f"{100 * p['kernel_us_per_step'] / p['step_us']:.1f}%", f"{p['calls_per_step']:.0f}"])
    rows.append(["gap (step - kernels)", f"{p['gap_us_per_step']:.1f}", f"{100 * p['gap_fraction']:.1f}%", ""])
    lines = [f"{title}: {p['time_source']} over {p['num_steps']} eager steps; step {p['step_us']:.1f} us "
             f"(the timed steps)", format_table(["CATEGORY", "US/STEP", "OF STEP", "CALLS/STEP"], rows)]
    if p["gemm_bytes_per_s"]:
        lines.append(f"GEMM: {p['gemm_weight_bytes'] / 1e9:.3f} GB of weights at {p['gemm_bytes_per_s'] / 1e9:.0f} "
                     f"GB/s ({100 * p['gemm_fraction_of_copy_bandwidth']:.0f}% of the copy bandwidth, "
                     f"{p['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s read+write)")
    for o in p["top_other"]:
        lines.append(f"  other: {o['us_per_step']:8.1f} us/step  {o['calls_per_step']:4.0f}x  {o['name'][:140]}")
    g = p.get("graph_mode")
    if g is not None:
        lines.append(f"graph replays: the profiler saw {g['calls_per_step']:.0f} kernels/copies per step, "
                     f"{g['kernel_us_per_step']:.1f} us (eager: {p['calls_per_step']:.0f}, "
                     f"{p['kernel_us_per_step']:.1f} us)")
    if p.get("replay_us_per_step") is not None:
        lines.append(f"gap split: {p['gap_inside_graph_us']:.1f} us inside the graph (back-to-back replays of the "
                     f"size-{p['replay_graph_size']} graph {p['replay_us_per_step']:.1f} us/step - kernels) + "
                     f"{p['gap_between_replays_us']:.1f} us between replays (step - replays: host work)")
    elif "replay_error" in p:
        lines.append(f"gap split: not measured ({p['replay_error']})")
    lines.append(f"({p['assumption']})")
    return "\n".join(lines)

"""`resident bench throughput MODEL`: steady-state decode tokens/s per batch size, as a
fraction of the memory-bandwidth roofline.

The engine runs in this process, built as `resident serve` builds it (the loader into
slabs — cuda_vmm on a GPU, host_shm on CPU — then ModelConfig, EngineConfig, ModelRunner
with its warm-up, LLMEngine). For each batch size B: B requests of `--context` random
prompt tokens (ignore_eos, greedy, no prefix caching) are prefilled, `--warmup-steps`
decode steps run untimed (lazy graph capture, allocator warm-up), then `--steps` decode
steps are timed. Only steps in which every request decodes one token count.
With `--profile` (cli/bench_profile.py) a few more decode steps of the same batch then run
under torch.profiler, after the timed ones, so they leave the timed figures alone.

Roofline: a decode step must read every weight once (the embedding table only for the B
looked-up rows, unless tied as the LM head) plus the KV cache of every sequence so far;
that many bytes divided by the measured copy bandwidth of the device (a large
device-to-device copy: bytes read + bytes written per second) is the step's lower bound.
The reported fraction is that bound over the measured step time.
"""
from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click

from resident.cli.bench_common import check_weight_options, model_source, output_file
from resident.cli.common import format_table

log = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
#: Environment switches that choose decode kernels (kernels/gemv.py, kernels/pdl.py), recorded in the JSON.
KERNEL_SWITCHES = ("RESIDENT_GEMV", "RESIDENT_PDL")


def copy_bandwidth(device, nbytes: int, repeats: int) -> float:
    """Bytes per second moved by dst.copy_(src) (read + write), best of a few timed loops."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(3):
        dst.copy_(src)
        _sync(device)
        t = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        _sync(device)
        best = max(best, 2 * nbytes * repeats / (time.perf_counter() - t))
    return best


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_per_step(tensors: dict, batch: int) -> int:
    """Bytes of weights a decode step of `batch` tokens reads."""
    total = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if name == EMBED and "lm_head.weight" in tensors:
            n = batch * t.shape[-1] * t.element_size()  # only the looked-up rows
        total += n
    return total


def kv_bytes_per_token(model_config, dtype) -> int:
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * itemsize


def prefill_steps_bound(batch: int, context: int, max_num_batched_tokens: int) -> int:
    """Engine steps the prefill of `batch` prompts of `context` tokens can take at most."""
    return -(-(batch * (context + 1)) // max_num_batched_tokens) + 1


def _measure(engine, batch: int, context: int, warmup: int, steps: int, vocab: int, device,
             after_timing: Callable[[Callable[[], int], float], dict] | None = None, extra_steps: int = 0) -> dict:
    """Prefill `batch` requests, decode `warmup` steps, time `steps`; then `after_timing(step, step_s)`
    (the profile) may run up to `extra_steps` more decode steps of the same batch, its result kept
    under "profile"."""
    from resident.worker.sampling_params import SamplingParams

    rng = random.Random(batch)
    # Requests whose prefill finishes early decode while the others still prefill: give
    # every request room for those tokens too, so none leaves the batch during timed steps.
    prefill_bound = prefill_steps_bound(batch, context, engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=warmup + steps + 4 + prefill_bound + extra_steps, ignore_eos=True,
                            temperature=0.0)
    ids = [f"bench-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(context)], params)
    generated = dict.fromkeys(ids, 0)

    def step() -> int:
        outs = engine.step()
        for o in outs:
            generated[o.request_id] += len(o.new_token_ids)
        return sum(len(o.new_token_ids) for o in outs)

    t0 = time.perf_counter()
    prefill_steps = 0
    while min(generated.values()) < 1:
        step()
        prefill_steps += 1
    prefill_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    preempted = engine.stats().num_preemptions
    _sync(device)
    t = time.perf_counter()
    decoded = [step() for _ in range(steps)]
    _sync(device)
    elapsed = time.perf_counter() - t
    clean = all(n == batch for n in decoded) and engine.stats().num_preemptions == preempted
    profile = after_timing(step, elapsed / steps) if after_timing is not None else None
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "prefill_steps": prefill_steps, "prefill_s": prefill_s, "steps": steps,
            "step_s": elapsed / steps, "tokens_per_s": sum(decoded) / elapsed, "all_decode_steps": clean,
            "mean_seq_len": context + 1 + warmup + (steps - 1) / 2, **({"profile": profile} if profile else {})}


def engine_config_for(batch_sizes: list[int], context: int, warmup: int, steps: int, block_size: int,
                      device: str):
    """The EngineConfig a throughput run needs: every batch size's sequences fit at once, prefill included."""
    from resident.worker.engine_config import EngineConfig

    budget = 8192 if device == "cuda" else 2048
    max_model_len = (context + warmup + steps + 4 + prefill_steps_bound(max(batch_sizes), context, budget)
                     + 2 * block_size)
    per_seq = -(-max_model_len // block_size)
    return EngineConfig(
        block_size=block_size, num_kv_blocks=per_seq * max(batch_sizes), max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=budget, max_model_len=max_model_len, enable_prefix_caching=False)


def add_roofline(r: dict, tensors: dict, batch: int, model_config, kv_dtype, bandwidth: float) -> dict:
    """Adds to a _measure row the bytes a step must read and its fraction of the roofline."""
    w = weight_bytes_per_step(tensors, batch)
    kv = int(batch * r["mean_seq_len"] * kv_bytes_per_token(model_config, kv_dtype))
    r.update(weight_bytes=w, kv_bytes=kv, bytes_per_step=w + kv, roofline_step_s=(w + kv) / bandwidth)
    r["roofline_fraction"] = r["roofline_step_s"] / r["step_s"]
    return r


def run_throughput(model: str, device: str, dtype: str, quantization: str, batch_sizes: list[int], context: int,
                   warmup: int, steps: int, bandwidth: float, block_size: int = 16, profile: bool = False,
                   async_modes: tuple[str, ...] = ("on",)) -> dict:
    """One weight variant: load, build the engine, measure every batch size (and profile it after
    its timed steps when `profile`: cli/bench_profile.py), once per async scheduling mode
    ("on"/"off": an engine of each over the same runner, one after the other)."""
    from resident.cli.bench_common import loaded_variant
    from resident.worker.config import ModelConfig
    from resident.worker.engine import LLMEngine
    from resident.worker.model_runner import ModelRunner

    with loaded_variant(model, dtype, quantization, device) as v:
        model_config = ModelConfig.from_hf(v.loaded.config)
        engine_config = engine_config_for(batch_sizes, context, warmup, steps, block_size, device)
        v.runner = ModelRunner(model_config, engine_config, v.tensors, device=device)
        v.runner.warmup()
        if hasattr(v.runner, "capture_graphs"):  # decode CUDA graphs, as `resident serve` does
            v.runner.capture_graphs()
        # In v, so that closing the variant drops them (and their views) before the slabs go.
        v.engine = {mode: LLMEngine(engine_config, v.runner, async_scheduling=mode == "on") for mode in async_modes}
        kv_dtype = v.tensors[EMBED].dtype
        rows = []
        after, extra = None, 0
        if profile:
            from resident.cli.bench_profile import EXTRA_STEPS, gemm_weight_bytes, profile_decode

            after, extra = partial(profile_decode, runner=v.runner, on_gpu=device == "cuda",
                                   gemm_bytes=gemm_weight_bytes(v.tensors), copy_bandwidth=bandwidth), EXTRA_STEPS
        for b in batch_sizes:
            for mode, engine in v.engine.items():
                r = add_roofline(_measure(engine, b, context, warmup, steps, model_config.vocab_size, device,
                                          after_timing=after, extra_steps=extra),
                                 v.tensors, b, model_config, kv_dtype, bandwidth)
                r["async_scheduling"] = engine.async_scheduling
                rows.append(r)
                log.info("%s batch %d, async scheduling %s: %.1f tokens/s, %.2f ms/step, %.0f%% of the roofline",
                         quantization, b, mode, r["tokens_per_s"], r["step_s"] * 1e3, 100 * r["roofline_fraction"])
        return {"quantization": quantization, "dtype": v.loaded.dtype, "load_s": v.loaded.load_s,
                "load_gb_s": v.loaded.bytes_read / 1e9 / max(v.loaded.load_s, 1e-9),
                "resident_bytes": v.loaded.nbytes, "results": rows}


def _csv_ints(value: str, flag: str = "--batch-sizes") -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=flag) from None
    if not out or any(x < 1 for x in out):
        raise click.BadParameter(f"expected positive integers, got {value!r}", param_hint=flag)
    return out


def _check_positions(model: str, context: int, decode_steps: int) -> None:
    """Refuse a --context the model cannot hold: its prompt and the decode steps past
    max_position_embeddings would be timed, but no server would run them."""
    from resident.daemon.source import resolve_model

    max_pos = resolve_model(model).config.get("max_position_embeddings")
    if isinstance(max_pos, int) and context + decode_steps > max_pos:
        raise click.BadParameter(f"{context} prompt tokens + {decode_steps} decode steps (warm-up and timed) exceed "
                                 f"the model's {max_pos} positions (max_position_embeddings); lower it",
                                 param_hint="--context")


@click.command("throughput")
@click.argument("model", callback=model_source)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--batch-sizes", default="1,64", show_default=True, help="Comma-separated decode batch sizes.")
@click.option("--context", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens per request.")
@click.option("--quantization", default="none", show_default=True,
              help="none, fp8_per_tensor, or both comma-separated (loaded one after the other).")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--steps", default=32, show_default=True, type=click.IntRange(min=1), help="Timed decode steps.")
@click.option("--warmup-steps", default=8, show_default=True, type=click.IntRange(min=0))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Write results here.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Measure a TP group of N ranks (cli/bench_tp.py) instead of one device.")
@click.option("--profile", is_flag=True,
              help="After each row's timed steps, profile a few decode steps (torch.profiler): time per kernel "
                   "category, GEMM GB/s, and the gap between the step time and the kernels (cli/bench_profile.py).")
@click.option("--async-scheduling", "async_scheduling", default="on", show_default=True,
              help="on, off, or both comma-separated (each batch size measured in each mode): whether the "
                   "engine launches a step before reading the previous one's tokens (`resident serve "
                   "--async-scheduling`; auto there means on for a GPU).")
def bench_throughput(model: str, device: str, batch_sizes: str, context: int, quantization: str, dtype: str,
                     steps: int, warmup_steps: int, json_path: Path | None, tensor_parallel_size: int,
                     profile: bool, async_scheduling: str) -> None:
    """Decode tokens/s per batch size, as a fraction of the memory-bandwidth roofline."""
    sizes = _csv_ints(batch_sizes)
    quants = [q.strip() for q in quantization.split(",") if q.strip()]
    check_weight_options(quants, dtype, device)
    modes = tuple(dict.fromkeys(m.strip() for m in async_scheduling.split(",") if m.strip()))
    if not modes or any(m not in ("on", "off") for m in modes):
        raise click.UsageError(f"--async-scheduling takes on, off or on,off; got {async_scheduling!r}")
    if profile and tensor_parallel_size > 1:
        raise click.UsageError("--profile profiles one device; drop --tensor-parallel-size or --profile")
    _check_positions(model, context, warmup_steps + steps)
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    bw = copy_bandwidth(dev, (2 << 30) if device == "cuda" else (64 << 20), 10 if device == "cuda" else 3)
    doc = {"benchmark": "throughput", "model": model, "device": device,
           "gpu": torch.cuda.get_device_name(dev) if device == "cuda" else "", "context": context,
           "copy_bandwidth_bytes_per_s": bw, "variants": [],
           # the kernel switches this run saw (None: unset, the default), so results say what ran
           "kernel_switches": {k: os.environ.get(k) for k in KERNEL_SWITCHES}}
    run = partial(run_throughput, profile=profile, async_modes=modes)
    if tensor_parallel_size > 1:
        from resident.cli.bench_tp import run_tp_throughput

        run = partial(run_tp_throughput, tensor_parallel_size=tensor_parallel_size, async_modes=modes)
    from resident.worker.config import ModelConfigError

    doc["tensor_parallel_size"] = tensor_parallel_size
    for q in quants:
        try:
            doc["variants"].append(run(model, device, dtype, q, sizes, context, warmup_steps, steps, bw))
        except MemoryError as e:
            raise click.ClickException(f"{e}; here: lower --context or the largest --batch-sizes") from None
        except ModelConfigError as e:   # e.g. a --tensor-parallel-size that does not divide the heads
            raise click.UsageError(str(e)) from None
    switches = ", ".join(f"{k}={v}" for k, v in doc["kernel_switches"].items() if v is not None)
    click.echo(f"{model} on {doc['gpu'] or device}; copy bandwidth {bw / 1e9:.0f} GB/s; context {context}; "
               f"{steps} timed decode steps after {warmup_steps}" + (f"; {switches}" if switches else ""))
    rows = []
    for v in doc["variants"]:
        for r in v["results"]:
            rows.append([v["quantization"], v["dtype"], r["batch"],
                         {True: "on", False: "off"}.get(r.get("async_scheduling"), "-"), f"{r['tokens_per_s']:.1f}",
                         f"{r['step_s'] * 1e3:.2f}", f"{r['bytes_per_step'] / 1e9:.2f}",
                         f"{r['roofline_step_s'] * 1e3:.2f}", f"{100 * r['roofline_fraction']:.0f}%",
                         "" if r["all_decode_steps"] else "mixed steps"])
    click.echo(format_table(["QUANT", "DTYPE", "BATCH", "ASYNC", "TOK/S", "STEP MS", "GB/STEP", "ROOFLINE MS",
                             "OF ROOFLINE", "NOTE"], rows))
    if profile:
        from resident.cli.bench_profile import format_profile

        for v in doc["variants"]:
            for r in v["results"]:
                mode = {True: ", async scheduling", False: ", synchronous steps"}.get(r.get("async_scheduling"), "")
                click.echo("\n" + format_profile(f"profile {v['quantization']} batch {r['batch']}{mode}", r["profile"]))
        click.echo("")
    for v in doc["variants"]:
        click.echo(f"{v['quantization']}: loaded in {v['load_s']:.2f} s ({v['load_gb_s']:.2f} GB/s)")
    if json_path:
        json_path.write_text(json.dumps(doc, indent=2))
        click.echo(f"wrote {json_path}")

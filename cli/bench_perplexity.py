"""`resident bench perplexity MODEL`: teacher-forced perplexity of each weight variant
(bf16 / fp8_per_tensor, ...) over the same text, through the engine's own model runner.

The text (`--text FILE`, or by default the docstrings of a fixed list of standard-library
modules: real English technical prose that needs no download) is tokenized with the
model's tokenizer, cut to `--max-tokens`, and run as one request in prefill chunks of
`--chunk` tokens (`ModelRunner.logits`: the same batch preparation, kernels and paged KV
cache as serving). Perplexity = exp(mean negative log-likelihood of every next token).
Every variant sees the same token ids, so the variants compare directly; the table gives
each one's change against the first.
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import time
from pathlib import Path

import click

from resident.cli.bench_common import check_weight_options, model_source, output_file
from resident.cli.common import format_table

log = logging.getLogger(__name__)

#: Standard-library modules whose docstrings make the default text.
DEFAULT_TEXT_MODULES = ("argparse", "json", "collections", "heapq", "difflib", "textwrap", "string", "csv",
                        "logging", "unittest", "asyncio", "email", "sqlite3", "functools", "itertools")


def default_text() -> str:
    parts = []
    for name in DEFAULT_TEXT_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            parts.append(doc)
    return "\n\n".join(parts)


def perplexity(runner, token_ids: list[int], chunk: int, block_size: int) -> dict:
    """Teacher-forced NLL of token_ids[1:] given the prefix, one request in chunks."""
    import torch

    from resident.worker.outputs import ScheduledRequest, SchedulerOutput
    from resident.worker.sampling_params import SamplingParams

    n = len(token_ids)
    blocks = list(range(-(-n // block_size)))
    params = SamplingParams(temperature=0.0)
    nll = 0.0
    top1 = 0
    start = 0
    t0 = time.perf_counter()
    while start < n - 1:
        end = min(start + chunk, n - 1)
        ids = token_ids[start:end]
        sched = ScheduledRequest("ppl", ids, start, blocks[:-(-end // block_size)], False, params, token_ids, [])
        logits = runner.logits(SchedulerOutput([sched], len(ids)))
        targets = torch.tensor(token_ids[start + 1:end + 1], device=logits.device)
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll -= float(logp.gather(1, targets[:, None]).sum())
        top1 += int((logits.argmax(dim=-1) == targets).sum())
        start = end
    scored = n - 1
    return {"tokens": scored, "nll": nll / scored, "perplexity": math.exp(nll / scored),
            "top1_accuracy": top1 / scored, "seconds": time.perf_counter() - t0}


def run_variant(model: str, device: str, dtype: str, quantization: str, token_ids: list[int], chunk: int) -> dict:
    from resident.cli.bench_common import loaded_variant
    from resident.worker.config import ModelConfig
    from resident.worker.engine_config import EngineConfig
    from resident.worker.model_runner import ModelRunner

    with loaded_variant(model, dtype, quantization, device) as v:
        model_config = ModelConfig.from_hf(v.loaded.config)
        block_size = 16
        max_len = len(token_ids) + block_size
        engine_config = EngineConfig(block_size=block_size, num_kv_blocks=-(-max_len // block_size),
                                     max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=max_len,
                                     enable_prefix_caching=False)
        v.runner = ModelRunner(model_config, engine_config, v.tensors, device=device, cuda_graphs="off")
        result = perplexity(v.runner, token_ids, chunk, block_size)
        result.update(quantization=quantization, dtype=v.loaded.dtype, resident_bytes=v.loaded.nbytes)
        log.info("%s: perplexity %.4f over %d tokens (top-1 %.1f%%)", quantization, result["perplexity"],
                 result["tokens"], 100 * result["top1_accuracy"])
        return result


@click.command("perplexity")
@click.argument("model", callback=model_source)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--dtype", default="auto", show_default=True, help="Activation dtype of the weights (auto: checkpoint's; "
              "on cuda auto means bfloat16).")
@click.option("--quantization", "quantizations", default="none,fp8_per_tensor", show_default=True,
              help="Comma-separated weight variants; the first is the reference.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Text to score (default: standard-library docstrings).")
@click.option("--max-tokens", default=4096, show_default=True, type=click.IntRange(min=16))
@click.option("--chunk", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prefill chunk (tokens per forward pass).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), callback=output_file, default=None)
def bench_perplexity(model: str, device: str, dtype: str, quantizations: str, text_file: str | None,
                     max_tokens: int, chunk: int, json_out: str | None) -> None:
    """Teacher-forced perplexity of MODEL per weight variant (fp8 vs bf16), same text, same tokens."""
    from resident.daemon.source import resolve_model
    from resident.worker.tokenizer import Tokenizer, TokenizerError

    variants = [q.strip() for q in quantizations.split(",") if q.strip()]
    if not variants:
        raise click.BadParameter("name at least one variant", param_hint="--quantization")
    check_weight_options(variants, dtype, device)
    if device == "cuda" and dtype == "auto":
        dtype = "bfloat16"
    folder = resolve_model(model).folder
    try:
        text = Path(text_file).read_text() if text_file else default_text()
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"{text_file} is not UTF-8 text ({e.reason} at byte {e.start}); give a text file",
                                 param_hint="--text") from None
    try:
        token_ids = Tokenizer.from_folder(folder).encode(text)[:max_tokens]
    except TokenizerError as e:
        raise click.UsageError(str(e)) from None
    if len(token_ids) < 16:
        raise click.UsageError(f"the text has only {len(token_ids)} tokens; give a longer --text")
    results = [run_variant(model, device, dtype, q, token_ids, chunk) for q in variants]
    base = results[0]["perplexity"]
    rows = [(r["quantization"], r["dtype"], r["tokens"], f"{r['perplexity']:.4f}",
             f"{100 * (r['perplexity'] / base - 1):+.2f}%", f"{100 * r['top1_accuracy']:.1f}%",
             f"{r['resident_bytes'] / 1e6:.1f}") for r in results]
    click.echo(format_table(["variant", "dtype", "tokens", "perplexity", "vs first", "top-1", "MB"], rows))
    if json_out:
        Path(json_out).write_text(json.dumps({"model": str(folder), "device": device, "text": text_file or "stdlib",
                                              "results": results}, indent=2))

"""`resident bench speculative [MODEL]`: tokens/s and acceptance with and without
speculative decoding, per workload and batch size.

The engine runs in this process, built as `resident serve` builds it (the loader into
slabs, ModelRunner with its warm-up, LLMEngine; speculation through
`spec_decode.build_spec_runner`). Modes: `plain`; `draft` — a draft model, by default
MODEL's first `--draft-layers` layers written to a temporary folder
(`spec_decode.truncate`); `ngram` — prompt lookup. Workloads: `chat` (short questions in
the chat template) and `repetitive` (prompts whose answer copies from the prompt: repeat a
paragraph, rename a variable in code). Each run: B greedy requests (`--max-tokens`,
ignore_eos) from submission to the last token, untimed warm-up run first; tokens/s =
generated tokens / wall time. Greedy speculative output must equal the plain run's
(`same_output` counts the requests that do; near-tied logits may legitimately differ).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import click

from resident.cli.bench_common import model_source, output_file
from resident.cli.common import format_table

log = logging.getLogger(__name__)

CHAT = ["What is the capital of France?", "Explain photosynthesis in simple terms.",
        "Write a short poem about the sea.", "Give three tips for staying productive at work."]
PARAGRAPH = ("The river runs through the old town, past the market square and the stone bridge. "
             "In the morning the fishermen bring their boats to the harbour, and by noon the stalls "
             "are full of bread, cheese, apples and fresh fish.")
CODE = ("def total_price(items, x):\n    result = 0\n    for item in items:\n        result += item.price * x\n"
        "    if result > 100:\n        result = result * 0.9\n    return result\n")
REPETITIVE = [f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
              f"Here is a Python function:\n\n{CODE}\nRewrite the whole function with the parameter `x` "
              "renamed to `quantity`.",
              "Copy this list: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears.",
              f"Repeat this code unchanged:\n\n{CODE}"]
WORKLOADS = {"chat": CHAT, "repetitive": REPETITIVE}
MODES = ("plain", "draft", "ngram")


def _load(model: str, device: str):
    from resident.cli.bench_common import load_into_slabs

    return load_into_slabs(model, "auto", "none", device)


def _engine(mode: str, target, draft, k: int, ngram_max: int, batch: int, device: str, max_model_len: int):
    from resident.worker.config import ModelConfig
    from resident.worker.engine import LLMEngine
    from resident.worker.engine_config import EngineConfig
    from resident.worker.model_runner import ModelRunner
    from resident.worker.spec_decode.build import build_spec_runner
    from resident.worker.spec_decode.config import SpecConfig

    loaded, tensors = target
    per_seq = -(-max_model_len // 16)
    config = EngineConfig(block_size=16, num_kv_blocks=per_seq * batch, max_num_seqs=batch,
                          max_num_batched_tokens=2048, max_model_len=max_model_len, enable_prefix_caching=False)
    runner = ModelRunner(ModelConfig.from_hf(loaded.config), config, tensors, device=device)
    if mode == "plain":
        runner.warmup()
        runner.capture_graphs()
        return LLMEngine(config, runner)
    spec = (SpecConfig(method="ngram", num_speculative_tokens=k, ngram_prompt_lookup_max=ngram_max)
            if mode == "ngram" else SpecConfig(method="draft", num_speculative_tokens=k, draft_model="bench-draft"))
    spec_runner = build_spec_runner(spec, runner, draft[0].config if mode == "draft" else None,
                                    draft[1] if mode == "draft" else None, seed=0)
    spec_runner.warmup()
    spec_runner.capture_graphs()
    return LLMEngine(config, spec_runner, num_speculative_tokens=k)


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, dict[str, list[int]]]:
    from resident.worker.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        out[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return time.perf_counter() - t0, out


def run_case(mode: str, workload: str, prompts: list[list[int]], batch: int, target, draft, k: int,
             ngram_max: int, max_tokens: int, device: str, plain_tokens: dict | None) -> dict:
    max_model_len = max(len(p) for p in prompts) + max_tokens + k + 16
    engine = _engine(mode, target, draft, k, ngram_max, batch, device, max_model_len)
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    # Untimed, the whole batch: first-use allocations and the kernels this batch's prefill
    # shapes compile (on the H200 a batch-1 warm-up left them in the timed run of the first mode).
    _generate(engine, batch_prompts, 8)
    base = engine.stats()
    counts = getattr(engine.runner, "verify_counts", None)   # speculative verification passes: graphed / eager
    base_counts = dict(counts) if counts is not None else None
    elapsed, tokens = _generate(engine, batch_prompts, max_tokens)
    st = engine.stats()
    drafts, proposed, accepted = (st.spec_num_drafts - base.spec_num_drafts, st.spec_num_proposed -
                                  base.spec_num_proposed, st.spec_num_accepted - base.spec_num_accepted)
    generated = sum(len(t) for t in tokens.values())
    row = {"mode": mode, "workload": workload, "batch": batch, "k": k if mode != "plain" else 0,
           "generated_tokens": generated, "seconds": elapsed, "tokens_per_s": generated / elapsed,
           "num_drafts": drafts, "num_proposed": proposed, "num_accepted": accepted,
           "acceptance_rate": accepted / proposed if proposed else 0.0,
           "mean_accepted_length": accepted / drafts if drafts else 0.0,
           "verify_passes": ({k: counts[k] - base_counts[k] for k in counts} if counts is not None else None),
           "same_output": (sum(tokens[r] == plain_tokens[r] for r in tokens) if plain_tokens is not None
                           else len(tokens)), "tokens": tokens}
    close = getattr(engine.runner, "close", None)
    if close is not None:
        close()
    return row


@click.command("speculative")
@click.argument("model", required=False, callback=model_source)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--draft", "draft_model", default=None, callback=model_source,
              help="Draft model folder [default: MODEL's first --draft-layers layers, written to a temp folder].")
@click.option("--draft-layers", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--num-speculative-tokens", "k", default=4, show_default=True, type=click.IntRange(1, 32))
@click.option("--ngram-prompt-lookup-max", "ngram_max", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-sizes", default="1,4", show_default=True, help="Comma-separated numbers of requests.")
@click.option("--max-tokens", default=96, show_default=True, type=click.IntRange(min=1))
@click.option("--modes", default=",".join(MODES), show_default=True)
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True)
@click.option("--cpu-threads", type=click.IntRange(min=1), default=None, help="torch intra-op threads (CPU).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=output_file,
              help="Write results here.")
def bench_speculative(model: str | None, device: str, draft_model: str | None, draft_layers: int, k: int,
                      ngram_max: int, batch_sizes: str, max_tokens: int, modes: str, workloads: str,
                      cpu_threads: int | None, json_path: Path | None) -> None:
    """Tokens/s and acceptance with and without speculative decoding (draft model, n-gram)."""
    from resident.cli.bench_throughput import _csv_ints

    sizes = _csv_ints(batch_sizes)
    chosen_modes = [m.strip() for m in modes.split(",") if m.strip()]
    chosen_loads = [w.strip() for w in workloads.split(",") if w.strip()]
    if not set(chosen_modes) <= set(MODES) or not chosen_modes:
        raise click.UsageError(f"--modes: valid are {', '.join(MODES)}")
    if not set(chosen_loads) <= set(WORKLOADS) or not chosen_loads:
        raise click.UsageError(f"--workloads: valid are {', '.join(WORKLOADS)}")
    import torch

    from resident.worker.spec_decode.truncate import write_truncated_checkpoint
    from resident.worker.tokenizer import Tokenizer, TokenizerError

    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA GPU is usable here")
    if model is None:
        from resident.cli.prepare import default_cache_dir, prepare_default_model

        model = str(prepare_default_model(default_cache_dir(dict(os.environ))))
    tmp = Path(tempfile.mkdtemp(prefix="resident-bench-spec-"))
    target = draft = None
    try:
        if "draft" in chosen_modes and draft_model is None:
            try:
                draft_model = str(write_truncated_checkpoint(model, tmp / "draft", draft_layers))
            except ValueError as e:   # more --draft-layers than MODEL has
                raise click.BadParameter(f"{e}; lower it or give a --draft model", param_hint="--draft-layers") from None
        try:
            tokenizer = Tokenizer.from_folder(model)
        except TokenizerError as e:
            raise click.UsageError(str(e)) from None
        target = _load(model, device)
        draft = _load(draft_model, device) if "draft" in chosen_modes else None
        doc = {"benchmark": "speculative", "model": model, "device": device,
               "draft": draft_model if draft else None, "draft_layers": draft_layers if draft else None,
               "num_speculative_tokens": k, "ngram_prompt_lookup_max": ngram_max, "max_tokens": max_tokens,
               "torch_threads": torch.get_num_threads(), "results": []}
        for workload in chosen_loads:
            prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                        add_special_tokens=False) for q in WORKLOADS[workload]]
            for batch in sizes:
                plain_tokens = None
                for mode in ["plain"] + [m for m in chosen_modes if m != "plain"]:
                    row = run_case(mode, workload, prompts, batch, target, draft, k, ngram_max, max_tokens,
                                   device, plain_tokens)
                    if mode == "plain":
                        plain_tokens = row["tokens"]
                    row.pop("tokens")
                    if mode in chosen_modes:
                        doc["results"].append(row)
                    log.info("%s %s batch %d: %.1f tokens/s, acceptance %.2f", workload, mode, batch,
                             row["tokens_per_s"], row["acceptance_rate"])
        _report(doc)
        if json_path:
            json_path.write_text(json.dumps(doc, indent=2))
            click.echo(f"wrote {json_path}")
    finally:
        for loaded in (target, draft):
            if loaded is not None:
                loaded[1].clear()
        gc.collect()
        for loaded in (target, draft):
            if loaded is not None:
                for s in loaded[0].slabs:
                    s.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _report(doc: dict) -> None:
    click.echo(f"{doc['model']} on {doc['device']} ({doc['torch_threads']} threads); K={doc['num_speculative_tokens']}; "
               f"draft: {doc['draft_layers']} layers" if doc["draft"] else f"{doc['model']} on {doc['device']}")
    plain = {(r["workload"], r["batch"]): r["tokens_per_s"] for r in doc["results"] if r["mode"] == "plain"}
    rows = []
    for r in doc["results"]:
        base = plain.get((r["workload"], r["batch"]))
        rows.append([r["workload"], r["mode"], r["batch"], f"{r['tokens_per_s']:.1f}",
                     f"{r['tokens_per_s'] / base:.2f}x" if base else "",
                     f"{r['acceptance_rate']:.2f}" if r["mode"] != "plain" else "",
                     f"{r['mean_accepted_length']:.2f}" if r["mode"] != "plain" else "",
                     f"{r['same_output']}/{r['batch']}", _graphed(r.get("verify_passes"))])
    click.echo(format_table(["WORKLOAD", "MODE", "BATCH", "TOK/S", "VS PLAIN", "ACCEPT", "ACC/STEP", "SAME OUT",
                             "VERIFY GRAPHED"], rows))


def _graphed(passes: dict | None) -> str:
    """Verification passes replayed from CUDA graphs, of all (prefill steps verify eagerly)."""
    if not passes:
        return ""
    return f"{passes['graphed']}/{passes['graphed'] + passes['eager']}"

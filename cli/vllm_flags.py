"""vLLM's names for `resident serve` flags, so a `vllm serve` command line (a systemd unit, a
Kubernetes manifest) runs with its flags unchanged where resident does the same thing.

- `--enforce-eager`: `--cuda-graphs off`.
- `--enable-prefix-caching` / `--no-enable-prefix-caching`: the prefix cache on (the default) or off
  (`--no-prefix-caching`).
- `--kv-cache-dtype auto`: the KV cache in the model's dtype, as resident stores it; any other
  value (fp8 KV caches are not built; the dtype follows --dtype) is a usage error naming the flag.
- `--trust-remote-code`, `--disable-log-requests`, `--disable-log-stats`: accepted and change
  nothing: resident runs no code from a model folder (its architectures are built in), and logs
  neither a line per request nor periodic throughput lines.

A vLLM flag that contradicts resident's own one given beside it (`--enforce-eager` with
`--cuda-graphs eager`, `--enable-prefix-caching` with `--no-prefix-caching`) is a usage error.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")

_OPTIONS = (
    click.option("--enforce-eager", is_flag=True, help="vLLM's name for --cuda-graphs off."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", "enable_prefix_caching", default=None,
                 help="vLLM's names: the prefix cache on (the default) or off (--no-prefix-caching)."),
    click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
                 help="vLLM's flag: auto (the model's dtype) is what resident stores; fp8 KV caches are not built."),
    click.option("--trust-remote-code", is_flag=True,
                 help="vLLM's flag, accepted: resident runs no code from model folders (architectures are built in)."),
    click.option("--disable-log-requests", is_flag=True,
                 help="vLLM's flag, accepted: resident logs no line per request."),
    click.option("--disable-log-stats", is_flag=True,
                 help="vLLM's flag, accepted: resident logs no periodic throughput lines (see /metrics)."),
)


def _given(name: str) -> bool:
    return click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE


def apply(kw: dict[str, Any]) -> dict[str, Any]:
    """`serve`'s keyword arguments with the vLLM flags taken out and turned into resident's own."""
    enforce_eager = kw.pop("enforce_eager")
    prefix = kw.pop("enable_prefix_caching")
    kv_dtype = kw.pop("kv_cache_dtype")
    trust = kw.pop("trust_remote_code")
    kw.pop("disable_log_requests")
    kw.pop("disable_log_stats")
    if enforce_eager:
        if _given("cuda_graphs") and kw["cuda_graphs"] != "off":
            raise click.UsageError(f"--enforce-eager means --cuda-graphs off, but --cuda-graphs {kw['cuda_graphs']} "
                                   "was given too; pass one of them")
        kw["cuda_graphs"] = "off"
    if prefix is not None:
        if prefix and kw["no_prefix_caching"]:
            raise click.UsageError("--enable-prefix-caching and --no-prefix-caching contradict each other; "
                                   "pass one of them")
        kw["no_prefix_caching"] = kw["no_prefix_caching"] or not prefix
    if kv_dtype != "auto":
        raise click.UsageError(f"--kv-cache-dtype {kv_dtype}: resident keeps the KV cache in the model's dtype "
                               "(--dtype) and builds no fp8 KV cache; leave the flag out or pass auto")
    if trust:
        logger.info("--trust-remote-code changes nothing here: resident runs no code from model folders")
    return kw


def vllm_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `serve` (below its other options) with vLLM's flags (see the module doc)."""
    @functools.wraps(command)
    def serve(**kw: Any) -> Any:
        return command(**apply(kw))

    for option in reversed(_OPTIONS):
        serve = option(serve)
    return serve

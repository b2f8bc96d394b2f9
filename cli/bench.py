"""`resident bench …`: benchmarks, each in its own module, imported only when run."""
from __future__ import annotations

import importlib

import click

# name -> ("module:attribute" of a click command, one-line help)
_BENCHES = {
    "attach": ("resident.cli.bench_attach:bench_attach",
               "Attach latency vs model size (host_shm) and load throughput in GB/s."),
    "restart": ("resident.cli.bench_restart:bench_restart",
                "Exec -> /ready and -> first token: HF transformers, cold, attached to a daemon."),
    "checkpoint": ("resident.cli.bench_checkpoint:bench_checkpoint",
                   "Write a random-weight Llama checkpoint (Llama-3-8B shape, or tiny)."),
    "perplexity": ("resident.cli.bench_perplexity:bench_perplexity",
                   "Teacher-forced perplexity per weight variant (fp8 vs bf16) over the same text."),
    "kernels": ("resident.cli.bench_kernels:bench_kernels",
                "fp8 activation quantization (reference vs fused) and fp8 vs bf16 linears, GPU."),
    "throughput": ("resident.cli.bench_throughput:bench_throughput",
                   "Decode tokens/s per batch size, as a fraction of the memory-bandwidth roofline."),
    "speculative": ("resident.cli.bench_spec:bench_speculative",
                    "Tokens/s and acceptance with and without speculative decoding (draft model, n-gram)."),
    "rollout": ("resident.cli.bench_rollout:bench_rollout",
                "Rolling restart under load: req/s, failures, p99, replica ready and standby switch-over."),
    "handover": ("resident.cli.bench_handover:bench_handover",
                 "Daemon hand-over (--takeover) and fd-store restart: time to serving, disk reads, re-attach."),
}


class _LazyBenches(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_BENCHES)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _BENCHES:
            return None
        module_name, _, attr = _BENCHES[name][0].partition(":")
        return getattr(importlib.import_module(module_name), attr)

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in _BENCHES and not args[0].startswith("-"):
            from resident.cli.common import no_such_command

            no_such_command(ctx, args[0], list(_BENCHES))
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(n, _BENCHES[n][1]) for n in self.list_commands(ctx)])


@click.group(cls=_LazyBenches)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmarks (attach latency, load throughput, restart time). See docs/benchmarks.md."""
    from resident.cli.common import exit_cleanly_on_sigterm

    exit_cleanly_on_sigterm(ctx)   # a `timeout` around a bench leaves no daemon or worker behind

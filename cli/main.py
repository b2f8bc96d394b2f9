"""The `resident` command. Subcommands live in their own modules and are imported lazily,
so `resident --help` and `resident preload status` never import torch."""
from __future__ import annotations

import importlib
import logging

import click

# name -> "module:attribute" of a click command or group
_COMMANDS = {
    "preload": "resident.cli.preload:preload",
    "serve": "resident.cli.serve:serve",
    "bench": "resident.cli.bench:bench",
    "prepare-model": "resident.cli.prepare:prepare_model",
    "demo": "resident.cli.demo:demo",
    "rollout": "resident.cli.rollout:rollout",
    "snapshot": "resident.cli.snapshot:snapshot",
}
_HELP = {
    "preload": "Run and manage the preload daemon that keeps weights resident.",
    "serve": "Serve a model with an OpenAI-compatible engine worker.",
    "bench": "Benchmarks (attach latency, load throughput, restart time).",
    "prepare-model": "Prepare the default model (SmolLM2-135M-Instruct) as an HF folder.",
    "demo": "Daemon + engine + a real request + a worker restart, on the default model.",
    "rollout": "Rolling restart of the replicas serving a port, without failing requests.",
    "snapshot": "Freeze a worker with CRIU and thaw it in seconds (doctor, install-criu, create, restore).",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _COMMANDS.get(name)
        if target is None:
            return None
        module_name, _, attr = target.partition(":")
        return getattr(importlib.import_module(module_name), attr)

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in _COMMANDS and not args[0].startswith("-"):
            from resident.cli.common import no_such_command

            no_such_command(ctx, args[0], list(_COMMANDS))
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # List commands from _HELP so --help imports no subcommand module.
        with formatter.section("Commands"):
            formatter.write_dl([(n, _HELP[n]) for n in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.version_option(package_name="resident")
def cli(log_level: str) -> None:
    """resident: LLM inference engines that restart in seconds."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

"""`resident preload …`: start, load, list, status, unload and stop the preload daemon.

This module is the click group; its commands live by concern: the daemon's life (`start`,
`stop`) in preload_lifecycle.py, the models it holds (`load`, `list`, `status`, `unload`) in
preload_models.py. Only `start --foreground` and `load` may import torch (through the
daemon); `status`, `list`, `unload` and `stop` talk to the daemon with the client alone, so
they answer fast.
"""
from __future__ import annotations

import click

from resident.cli.preload_lifecycle import BACKENDS, start, stop
from resident.cli.preload_models import DTYPES, QUANTIZATIONS, list_models, load, status, unload

# The choices offered without importing torch, kept importable from here.
__all__ = ["BACKENDS", "DTYPES", "QUANTIZATIONS", "preload"]


@click.group()
def preload() -> None:
    """Run and manage the preload daemon that keeps weights resident."""


for _command in (start, load, list_models, status, unload, stop):
    preload.add_command(_command)

"""Model paths as the daemon must receive them: it resolves a path against its own working
directory, not its client's, so a relative path naming a local folder is made absolute by
the caller (the client library, the worker). Torch-free, so the client stays light."""
from __future__ import annotations

import os


def absolute_model_path(model: str) -> str:
    """`model` made absolute when it is a relative path to an existing local folder; anything
    else (a hub id, an absolute path, a path that does not exist here) unchanged."""
    return os.path.abspath(model) if os.path.isdir(model) and not os.path.isabs(model) else model

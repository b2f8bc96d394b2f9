"""The installed resident version, for hello messages and the state a daemon hands over.

Its own tiny module: a client says hello with it, and must not import the daemon's server
(and everything that pulls in) to get it.
"""
from __future__ import annotations

import functools


@functools.cache
def daemon_version() -> str:
    """The version of the installed `resident` distribution ("0+unknown" when not installed).
    Cached: a process's installed version does not change while it runs."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("resident")
    except PackageNotFoundError:
        return "0+unknown"

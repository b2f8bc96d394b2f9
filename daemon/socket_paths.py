"""Checks that a fresh daemon may put its sockets on the paths it was given.

The lock file guards `--socket`'s own path only: the paths the daemon's sockets are renamed
onto must not be a live socket of another daemon (its fd socket, say) or any other file, and
the fd socket's folder must exist and be writable. Each refusal is a ValueError naming the
option to change, so `preload start` can say what to do instead of showing a bare errno.
"""
from __future__ import annotations

import errno
import os
import socket
import stat


def check_path_free(path: str, option: str) -> None:
    """Raise ValueError unless a fresh daemon may rename its socket onto `path`: it does not
    exist, or it is a stale socket nothing listens on any more."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"{option} {path} exists and is not a socket; choose another {option} (the daemon "
                         "replaces only stale sockets there)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: left behind by a process that is gone
    except OSError as e:
        raise ValueError(f"cannot tell whether {option} {path} is in use ({e.strerror or e}); choose another "
                         f"{option}") from None
    finally:
        probe.close()
    raise ValueError(f"{option} {path} is in use: a process listens on it (another resident daemon's socket?); "
                     f"choose another {option}, or stop what listens there")


def check_socket_folder(path: str, option: str) -> None:
    """Make the folder of a socket the daemon binds (`--fd-socket`'s: the lock file makes
    --socket's), and refuse one it cannot create or write with the option to change (the bind
    failed with a bare errno)."""
    folder = os.path.dirname(path)
    try:
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise NotADirectoryError(errno.ENOTDIR, f"{folder} is not a folder")
        os.makedirs(folder, mode=0o755, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"{folder} is not writable")
    except OSError as e:
        raise ValueError(f"cannot create the {option} {path} ({e.strerror}): the daemon needs a folder it can "
                         f"write for it; choose an {option} in such a folder (e.g. leave it out: <socket>.fd) or "
                         "make that one writable") from None

"""One-line messages for a server that cannot listen or write its port file (`resident serve`
and the replica supervisor): the address, the reason, and the fix — never a traceback; and
the port file itself (`write_port_file`)."""
from __future__ import annotations

import atexit
import errno
import os
import signal
import socket
import threading


def cannot_listen(host: str, port: int, e: OSError) -> str:
    """Why binding `host`:`port` failed (`e` from socket.create_server or loop.create_server,
    which re-raise a failed bind with their own wording around the reason), and the fix."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    why = str(e.strerror or e)
    if why.startswith("error while attempting"):   # asyncio's: "error while attempting to bind on address (...): why"
        why = why.rsplit(": ", 1)[-1]
    else:                                          # socket.create_server's: "Why (while attempting to bind ...)"
        why = why.split(" (while attempting", 1)[0]
    if isinstance(e, socket.gaierror) or (e.errno or 0) < 0:  # getaddrinfo's EAI_* codes are negative
        fix = f"--host {host!r} is not an address or name of this machine; use e.g. 127.0.0.1, 0.0.0.0 or ::"
    elif e.errno == errno.EADDRINUSE:
        fix = "another process listens there; stop it, or pick another --port (0 picks a free one)"
    elif e.errno == errno.EADDRNOTAVAIL:
        fix = f"--host {host!r} is not an address of this machine; use e.g. 127.0.0.1, 0.0.0.0 or ::"
    elif e.errno == errno.EACCES:
        fix = "ports below 1024 need root or CAP_NET_BIND_SERVICE; pick a --port of 1024 or more"
    else:
        fix = "check --host and --port"
    return f"cannot listen on {where}: {why}; {fix}"


def cannot_write_port_file(path: str, e: OSError) -> str:
    return (f"cannot write the port to --port-file {path}: {e.strerror or e}; point --port-file at a writable "
            "folder that exists")


#: (path, port) of the port files this process wrote (removed at exit, or on a SIGTERM that
#: arrives before the server has its own handler).
_PORT_FILES: list[tuple[str, int]] = []


def write_port_file(path: str, port: int) -> None:
    """Write `port` to --port-file `path` (OSError as writing raises it), and remove the file
    when this process exits — unless it then names another port: a newer server's, which
    wrote it meanwhile. A port file left behind would name a port nobody listens on.

    `--frontend process` writes it before the engine imports torch (seconds); a SIGTERM then
    (systemd stopping a unit that is still starting) would end the process by the default
    action, atexit skipped: so until the server installs its own handler, SIGTERM removes the
    file and then ends the process by the default action still (killed by SIGTERM, as systemd
    expects of a stop)."""
    with open(path, "w") as f:
        f.write(f"{port}\n")
    _PORT_FILES.append((path, port))
    atexit.register(_remove_port_file, path, port)
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _remove_port_files_and_end)


def _remove_port_files_and_end(signum: int, frame: object) -> None:
    for path, port in _PORT_FILES:
        _remove_port_file(path, port)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _remove_port_file(path: str, port: int) -> None:
    try:
        with open(path) as f:
            ours = f.read().strip() == str(port)
        if ours:
            os.unlink(path)
    except OSError:
        pass


__all__ = ["cannot_listen", "cannot_write_port_file", "write_port_file"]

"""One-line messages for a server that cannot listen or write its port file (`resident serve`
and the replica supervisor): the address, the reason, and the fix — never a traceback."""
from __future__ import annotations

import errno
import socket


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


__all__ = ["cannot_listen", "cannot_write_port_file"]

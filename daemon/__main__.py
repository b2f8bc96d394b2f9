"""`python -m resident.daemon`: run the preload daemon in the foreground.

The same options as `resident preload start --foreground`, without click (tests and
supervisors use this directly). Exit code 0 after a graceful stop, 1 when it cannot start.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from resident.daemon.config import DEFAULT_HTTP, DaemonConfig, default_socket_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resident.daemon", description=__doc__.splitlines()[0])
    p.add_argument("--socket", help="gRPC Unix socket (default: $RESIDENT_SOCKET, else /run/resident/"
                                    "preload.sock if it exists or when root, else $XDG_RUNTIME_DIR/resident/preload.sock)")
    p.add_argument("--fd-socket", default="", help="fd socket (default <socket>.fd)")
    p.add_argument("--http", default=DEFAULT_HTTP, help=f"HOST:PORT for /health /ready /metrics "
                                                        f"(default {DEFAULT_HTTP}; port 0 = any free; 'off' disables)")
    p.add_argument("--tcp", default="", help="also serve gRPC on HOST:PORT (off unless given)")
    p.add_argument("--backend", default="", help="memory backend (default: cuda_vmm with a GPU, else host_shm)")
    p.add_argument("--max-bytes", type=int, default=0, help="cap on resident bytes (0 = unlimited)")
    p.add_argument("--socket-mode", type=lambda s: int(s, 8), default=0o660, help="socket permissions (octal)")
    p.add_argument("--socket-group", default=None, help="group owning the sockets (name or gid)")
    p.add_argument("--allow-uid", dest="allow_uids", type=int, action="append", default=[])
    p.add_argument("--allow-gid", dest="allow_gids", type=int, action="append", default=[])
    p.add_argument("--admin-uid", dest="admin_uids", type=int, action="append", default=[])
    p.add_argument("--hub-cache", default=None, help="Hugging Face hub cache to resolve hub ids in")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = DaemonConfig(
            socket=default_socket_path(os.environ, args.socket), fd_socket=args.fd_socket,
            http="" if args.http in ("off", "") else args.http, tcp=args.tcp, backend=args.backend,
            max_bytes=args.max_bytes, socket_mode=args.socket_mode, socket_group=args.socket_group,
            allow_uids=tuple(args.allow_uids), allow_gids=tuple(args.allow_gids),
            admin_uids=tuple(args.admin_uids), hub_cache=args.hub_cache,
        )
    except ValueError as e:
        logging.getLogger("resident.daemon").error("%s", e)
        return 1
    from resident.daemon.server import run_daemon

    return run_daemon(config)


if __name__ == "__main__":
    sys.exit(main())

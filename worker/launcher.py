"""A pre-imported launcher: a fork server that starts replicas without paying for imports.

`python -m resident.worker.launcher SOCKET LIFELINE_FD` imports Python's heavy modules once — torch,
the engine, the model runner, the tokenizer, the daemon client, aiohttp — but never touches
CUDA and starts no thread, so `fork()` is safe. It then listens on the Unix socket SOCKET.
The supervisor connects once per replica and sends one JSON line (the replica's
environment) with the listening socket and the lifeline pipe attached (SCM_RIGHTS). The
launcher forks; the child adopts that environment, initializes CUDA itself if it uses a
GPU (a CUDA context never crosses a fork), and runs the replica; the launcher answers
`{"pid": N}`, and later `{"exit": code}` when it reaps the child, then closes the connection.

The launcher is restarted at every rollout (fresh imports = the new code). SIGTERM retires
it: it stops accepting spawns and exits once its last child has exited, so the replicas it
forked keep being reaped and reported while they drain. It retires the same way when the
supervisor dies (EOF on the lifeline pipe, whose write end only the supervisor holds).

The supervisor watches a forked replica through a pidfd (it is not the replica's parent),
so a replica's exit is noticed even if its launcher was killed; the exit code then comes
from the launcher's report, or is unknown (-1).
"""
from __future__ import annotations

import array
import asyncio
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence

logger = logging.getLogger(__name__)

_MAX_FDS = 4
_MAX_REQUEST_BYTES = 1 << 20
#: The modules a replica imports, loaded ahead by preimport (only for their side effect: sys.modules holds them).
_PREIMPORTED = ("aiohttp", "torch", "resident.daemon.client", "resident.worker.engine", "resident.worker.model_runner",
                "resident.worker.openai_serving", "resident.worker.replica", "resident.worker.tokenizer",
                "resident.worker.weight_store")


def preimport() -> float:
    """Import what a replica imports (without touching CUDA); returns the seconds it took."""
    t = time.monotonic()
    for name in _PREIMPORTED:
        importlib.import_module(name)
    return time.monotonic() - t


def _child(env: dict[str, str], fds: list[int], server: socket.socket, conn: socket.socket) -> int:
    """In the forked child: become the replica described by env."""
    from resident.worker.replica import run_replica
    from resident.worker.replica_options import ENV_PAYLOAD, configure_logging, decode_payload

    t0 = time.time()
    server.close()
    conn.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    config, options = decode_payload(env[ENV_PAYLOAD])
    # The fds arrived with new numbers: point the options at them.
    from dataclasses import replace

    options = replace(options, listen_fd=fds[0], lifeline_fd=fds[1] if len(fds) > 1 else None)
    configure_logging(options)
    return run_replica(config, options, t0)


class Launcher:
    def __init__(self, path: str, lifeline_fd: int | None = None) -> None:
        self.path = path
        self.lifeline_fd = lifeline_fd    # EOF: the supervisor is gone, retire
        self.children: dict[int, socket.socket | None] = {}   # pid -> the connection to report its exit on
        self.retiring = False
        self._selector: selectors.BaseSelector | None = None
        self._wake: tuple[int, int] = (-1, -1)

    def close_in_child(self) -> None:
        """What a forked child must not keep: the launcher's loop and other replicas' connections."""
        if self._selector is not None:
            self._selector.close()
        for fd in self._wake:
            os.close(fd)
        if self.lifeline_fd is not None:
            os.close(self.lifeline_fd)  # the child gets its own copy with the spawn request
        for conn in self.children.values():
            if conn is not None:
                conn.close()

    def serve(self) -> int:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = self.path + ".new"  # renamed into place once listening: the path means "ready"
        if os.path.exists(staging):
            os.unlink(staging)
        server.bind(staging)
        os.chmod(staging, 0o600)
        server.listen(64)
        os.rename(staging, self.path)
        sel = self._selector = selectors.DefaultSelector()
        wake_r, wake_w = self._wake = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        # A terminal's hangup or a `kill -HUP` meant for a rollout must not end the launcher (the
        # supervisor would start another, but the replicas' next spawn would wait for it).
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        sel.register(server, selectors.EVENT_READ, "accept")
        sel.register(wake_r, selectors.EVENT_READ, "signal")
        if self.lifeline_fd is not None:
            sel.register(self.lifeline_fd, selectors.EVENT_READ, "lifeline")
        logger.info("launcher ready on %s", self.path)
        while not (self.retiring and not self.children):
            for key, _ in sel.select():
                if key.data == "accept" and not self.retiring:
                    conn, _ = server.accept()
                    self._spawn(conn, server)
                elif key.data == "lifeline" and not os.read(self.lifeline_fd, 64):
                    sel.unregister(self.lifeline_fd)
                    self._retire(sel, server, "the supervisor is gone")
                elif key.data == "signal":
                    if signal.SIGTERM in os.read(wake_r, 64):
                        self._retire(sel, server, "SIGTERM")
                    self._reap()
        return 0

    def _retire(self, sel: selectors.BaseSelector, server: socket.socket, reason: str) -> None:
        """Take no more spawns; exit once the last forked replica has exited (and been reported)."""
        if self.retiring:
            return
        logger.info("launcher retiring (%s): %d replica(s) still running", reason, len(self.children))
        self.retiring = True
        sel.unregister(server)
        server.close()
        os.unlink(self.path)

    def _spawn(self, conn: socket.socket, server: socket.socket) -> None:
        conn.settimeout(10)
        try:
            data, fds = _recv_request(conn)
            env = json.loads(data)["env"]
        except (OSError, ValueError, KeyError) as e:
            logger.error("launcher: a bad spawn request: %s", e)
            conn.close()
            return
        pid = os.fork()
        if pid == 0:  # the child never returns into the launcher's loop
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                self.close_in_child()
                code = _child(env, fds, server, conn)
            except BaseException:  # noqa: BLE001 - report and leave without running the parent's cleanup
                logging.getLogger(__name__).exception("replica failed in the forked child")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def _recv_request(conn: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(_MAX_REQUEST_BYTES, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    buf = data
    while not buf.endswith(b"\n"):  # the JSON line may span several reads (the fds come with the first)
        more = conn.recv(_MAX_REQUEST_BYTES)
        if not more:
            raise ValueError("the request ended before its newline")
        buf += more
    return buf, list(fds)


# --- the supervisor's side ---------------------------------------------------------------

class LaunchedReplica:
    """A replica forked by the launcher, watched through a pidfd (implements ReplicaProcess)."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self._conn = conn
        self._pidfd = os.pidfd_open(pid)
        self._exit_code: int | None = None

    def send_signal(self, sig: int) -> None:
        signal.pidfd_send_signal(self._pidfd, sig)

    async def wait(self) -> int:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self._pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
        try:  # the launcher's report carries the code; it comes right after the exit
            line = await asyncio.wait_for(_read_line(self._conn), 2.0)
            self._exit_code = int(json.loads(line)["exit"])
        except (asyncio.TimeoutError, OSError, ValueError, KeyError):
            self._exit_code = -1  # the launcher is gone: the code is unknown
        finally:
            self._conn.close()
        return self._exit_code


async def _read_line(conn: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk:
            raise ConnectionError("the launcher closed the connection")
        buf += chunk
    return buf


class LauncherClient:
    """Starts a launcher process and asks it for replicas."""

    def __init__(self, port: int, env: Mapping[str, str], lifeline_fd: int) -> None:
        from resident.worker.control import runtime_dir

        self.lifeline_fd = lifeline_fd
        self.env = {k: v for k, v in env.items() if not k.startswith(("NOTIFY_", "LISTEN_", "WATCHDOG_"))}
        base = os.path.join(runtime_dir(env), f"engine-{port}")
        os.makedirs(base, mode=0o700, exist_ok=True)
        self.path = os.path.join(base, f"launcher-{os.getpid()}-{time.monotonic_ns() % 10**9}.sock")
        self.process: asyncio.subprocess.Process | None = None
        self.ready_s: float | None = None

    async def start(self, timeout_s: float) -> None:
        t = time.monotonic()
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "resident.worker.launcher", self.path, str(self.lifeline_fd), env=self.env,
            pass_fds=(self.lifeline_fd,), stdin=asyncio.subprocess.DEVNULL)
        while time.monotonic() - t < timeout_s:
            if self.process.returncode is not None:
                raise RuntimeError(f"the launcher exited with code {self.process.returncode} while importing")
            if os.path.exists(self.path):
                self.ready_s = time.monotonic() - t
                logger.info("launcher ready in %.2f s (pid %d)", self.ready_s, self.process.pid)
                return
            await asyncio.sleep(0.05)
        await self.stop()
        raise RuntimeError(f"the launcher was not ready within {timeout_s:.0f} s")

    async def spawn(self, env: Mapping[str, str], fds: Sequence[int]) -> LaunchedReplica:
        loop = asyncio.get_running_loop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.setblocking(False)
        try:
            await loop.sock_connect(conn, self.path)
            message = json.dumps({"env": dict(env)}).encode() + b"\n"
            conn.setblocking(True)
            conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
            conn.setblocking(False)
            reply = json.loads(await asyncio.wait_for(_read_line(conn), 30.0))
            return LaunchedReplica(int(reply["pid"]), conn)
        except BaseException:
            conn.close()
            raise

    async def stop(self) -> None:
        """Retire the launcher: it exits once the replicas it forked have exited."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 2 or not argv[1].isdigit():
        raise SystemExit("usage: python -m resident.worker.launcher SOCKET LIFELINE_FD (started by the supervisor)")
    logging.basicConfig(level=os.environ.get("RESIDENT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s launcher %(name)s: %(message)s")
    seconds = preimport()
    logger.info("pre-imported torch and the engine in %.2f s", seconds)
    return Launcher(argv[0], int(argv[1])).serve()


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["LaunchedReplica", "Launcher", "LauncherClient", "main", "preimport"]

"""Rolling restart of a supervisor's replicas, and the control socket that asks for one.

One replica at a time: start a new replica (new code: a fresh interpreter, or a fork of a
freshly started launcher), wait for *its* /ready on its admin socket, then drain an old one
(graceful.py: stop accepting, hand connections back, finish in-flight requests, exit).
With warm standbys the standbys are renewed first, and each step then promotes a new-code
standby (milliseconds) before draining the old replica, and warms the next standby.
Replicas with a reduced KV share (kv_budget.py) are restarted last.

A new replica that does not become ready ends the rollout: it is stopped, the old replicas
keep serving, the rollout reports failure. systemd hears RELOADING=1 at the start and
READY=1 at the end either way (the service keeps serving).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from resident.daemon import sd_notify
from resident.worker.control import ROLLOUT_PATH, STATUS_PATH, control_socket_path
from resident.worker.replica_handle import ReplicaFailed, ReplicaHandle, Role

if TYPE_CHECKING:
    from resident.worker.supervisor import Supervisor

logger = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]


class _Steps:
    def __init__(self, emit: Emit) -> None:
        self.emit = emit

    def __call__(self, step: str, message: str, **extra: Any) -> None:
        (logger.error if step == "error" else logger.info)("rollout: %s", message)
        self.emit({"step": step, "message": message, **extra})


async def rollout(sup: Supervisor, emit: Emit, ready_timeout_s: float | None = None) -> tuple[bool, str]:
    """Roll every replica once; returns (ok, summary)."""
    step = _Steps(emit)
    if not sup.started or sup.stopping:
        step("error", "the supervisor is still starting or already stopping; retry once it is ready")
        return False, "the supervisor is not ready for a rollout"
    if sup.rollout_lock.locked():
        step("error", "a rollout is already in progress; wait for it to finish")
        return False, "a rollout is already in progress"
    async with sup.rollout_lock:
        sd_notify.reloading(sup.status_line(), env=sup.env)
        t0 = time.monotonic()
        try:
            ok, summary = await _roll(sup, step, ready_timeout_s or sup.config.ready_timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the caller; the service keeps serving
            logger.exception("rollout failed")
            ok, summary = False, f"rollout failed: {e}"
        if not ok and sup.stopping:
            summary = "the supervisor is stopping (SIGTERM or SIGINT): the rollout ended with it; no replica serves"
    summary += f" ({time.monotonic() - t0:.1f} s)"
    (logger.info if ok else logger.error)("rollout: %s", summary)
    if not sup.stopping:   # after STOPPING=1, READY=1 would tell systemd the service serves again
        sd_notify.ready(f"{sup.status_line()}; last rollout {'ok' if ok else 'FAILED'}", env=sup.env)
    return ok, summary


async def _start_ready(sup: Supervisor, role: Role, timeout_s: float, step: _Steps, tag: str) -> ReplicaHandle | None:
    try:
        new = await sup.spawn(role)
    except RuntimeError as e:  # no KV budget left
        step("error", f"{tag} cannot start a new {role.value} replica: {e}")
        return None
    step("start", f"{tag} started {role.value} replica {new.replica_id} (pid {new.pid}, KV {new.kv_share:.0%})",
         replica_id=new.replica_id)
    try:
        await new.wait_ready(timeout_s)
    except ReplicaFailed as e:
        # SIGTERM to the supervisor mid-rollout stops the new replica too: the old ones then do not serve on.
        after = ("the supervisor is stopping, its replicas with it" if sup.stopping else
                 "stopping it — the old replicas keep serving")
        step("error", f"{tag} {e}; {after}", replica_id=new.replica_id)
        await new.stop()
        return None
    step("ready", f"{tag} replica {new.replica_id} ready in {new.ready_s:.2f} s", replica_id=new.replica_id,
         ready_s=new.ready_s)
    return new


async def _drain(sup: Supervisor, old: ReplicaHandle, step: _Steps, tag: str) -> None:
    step("drain", f"{tag} draining replica {old.replica_id} (pid {old.pid})", replica_id=old.replica_id)
    t = time.monotonic()
    code = await old.drain(sup.config.replica_drain_timeout_s)
    step("exited", f"{tag} replica {old.replica_id} exited with code {code} after {time.monotonic() - t:.2f} s",
         replica_id=old.replica_id, exit_code=code)


async def _roll(sup: Supervisor, step: _Steps, timeout_s: float) -> tuple[bool, str]:
    old_serving = sorted(sup.serving(), key=lambda h: -h.kv_share)  # reduced KV shares last
    old_standby = [h for h in sup.replicas.values() if h.role is Role.STANDBY and not h.leaving]
    n = len(old_serving)
    step("begin", f"rolling restart of {n} replica(s) on port {sup.port}"
         + (f" with {len(old_standby)} standby" if old_standby else ""))
    if sup.config.use_launcher:
        t = time.monotonic()
        await sup.start_launcher()
        seconds = time.monotonic() - t
        step("launcher", f"fresh launcher (new code imported) in {seconds:.2f} s", launcher_s=seconds)
    for old in old_standby:
        if await _start_ready(sup, Role.STANDBY, timeout_s, step, "[standby]") is None:
            return False, "a new standby replica did not become ready"
        await _drain(sup, old, step, "[standby]")
    for i, old in enumerate(old_serving, 1):
        tag = f"[{i}/{n}]"
        if old.replica_id not in sup.replicas or old.leaving:
            step("skip", f"{tag} replica {old.replica_id} is already gone (replaced after a crash)")
            continue
        standby = sup.ready_standby()
        if standby is not None:
            seconds = await standby.promote()
            step("promote", f"{tag} promoted standby replica {standby.replica_id} ({seconds * 1e3:.1f} ms)",
                 replica_id=standby.replica_id, promote_s=seconds)
        elif await _start_ready(sup, Role.SERVING, timeout_s, step, tag) is None:
            return False, f"replica {i} of {n} did not become ready; {n - i + 1} old replica(s) keep serving"
        await _drain(sup, old, step, tag)
        if standby is not None and await _start_ready(sup, Role.STANDBY, timeout_s, step, tag) is None:
            return False, "a new standby replica did not become ready"
    return True, f"rolled {n} replica(s) on port {sup.port}"


class ControlServer:
    """The supervisor's control socket (see control.py for the API)."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.path = sup.config.control_socket or control_socket_path(sup.port, sup.env)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        if os.path.exists(self.path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(self.path)
                except OSError:
                    os.unlink(self.path)  # stale: its supervisor is gone
                else:
                    raise RuntimeError(f"another resident supervisor answers on {self.path}; stop it first")
        app = web.Application()
        app.router.add_get(STATUS_PATH, self.status)
        app.router.add_post(ROLLOUT_PATH, self.rollout)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, self.path).start()
        os.chmod(self.path, 0o600)
        logger.info("control socket: %s", self.path)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.sup.describe())

    async def rollout(self, request: web.Request) -> web.StreamResponse:
        try:
            timeout = float(request.query["ready_timeout"]) if "ready_timeout" in request.query else None
        except ValueError:
            timeout = math.nan
        if timeout is not None and not 0 < timeout < math.inf:   # NaN compares false both ways
            return web.json_response({"error": "ready_timeout must be a positive, finite number of seconds, got "
                                               f"{request.query['ready_timeout']!r}"}, status=400)
        queue: asyncio.Queue = asyncio.Queue()
        # The rollout goes on if the client goes away: it is shielded from the handler.
        task = self.sup.background(rollout(self.sup, queue.put_nowait, timeout))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await resp.prepare(request)
            while (event := await queue.get()) is not None:
                await resp.write(_line(event))
            ok, summary = task.result()
            await resp.write(_line({"done": True, "ok": ok, "message": summary}))
            await resp.write_eof()
        except ConnectionResetError:   # the caller went away (Ctrl-C): the rollout goes on, its log says how
            logger.info("the rollout's caller went away; the rollout goes on (its steps are in this log)")
        return resp


def _line(event: dict[str, Any]) -> bytes:
    import json

    return (json.dumps(event) + "\n").encode()


__all__ = ["ControlServer", "rollout"]

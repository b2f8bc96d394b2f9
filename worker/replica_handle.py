"""The supervisor's view of one replica process: its role, state, KV share, and the calls
it makes on the replica's private admin socket (/ready, /promote, /drain)."""
from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from resident.worker.replica_options import failure_note_path

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class ReplicaFailed(RuntimeError):
    """A replica did not become ready (exited, or not ready within the timeout)."""


def _take_failure_note(admin_socket: str) -> str | None:
    path = failure_note_path(admin_socket)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            reason = f.read().strip()
        os.unlink(path)
    except OSError:
        return None
    return reason or None


class Role(str, enum.Enum):
    SERVING = "serving"
    STANDBY = "standby"


class Phase(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"          # warm: serving, or a standby waiting for promotion
    DRAINING = "draining"
    EXITED = "exited"


class ReplicaProcess(Protocol):
    """A started replica: an asyncio subprocess, or a child forked by the launcher."""

    pid: int

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass
class ReplicaHandle:
    replica_id: int
    role: Role
    admin_socket: str
    kv_share: float
    process: ReplicaProcess
    started_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.STARTING
    leaving: bool = False              # its exit is expected (drained, stopped, failed rollout)
    ready_s: float | None = None       # spawn -> admin /ready 200
    exit_code: int | None = None
    exit_task: asyncio.Task | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "pid": self.pid, "role": self.role.value, "phase": self.phase.value,
                "kv_share": self.kv_share, "ready_s": self.ready_s, "admin_socket": self.admin_socket}

    async def admin(self, method: str, path: str, timeout_s: float = 10.0) -> tuple[int, dict]:
        connector = aiohttp.UnixConnector(path=self.admin_socket)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async with session.request(method, "http://replica" + path) as resp:
                return resp.status, await resp.json(content_type=None)

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the replica's own /ready answers 200; raises ReplicaFailed on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exit_task is not None and self.exit_task.done():
                reason = _take_failure_note(self.admin_socket)
                raise ReplicaFailed(f"replica {self.replica_id} (pid {self.pid}) exited with code "
                                    f"{self.exit_task.result()} before it was ready: "
                                    + (reason or "see its log lines in the supervisor's log"))
            try:
                status, _ = await self.admin("GET", "/ready", timeout_s=2.0)
                if status == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    self.phase = Phase.READY
                    return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass  # the admin socket is not up yet
            await asyncio.sleep(_POLL_S)
        raise ReplicaFailed(f"replica {self.replica_id} (pid {self.pid}) was not ready within {timeout_s:.0f} s; "
                            "raise the ready timeout if start-up is legitimately slow")

    async def promote(self) -> float:
        status, body = await self.admin("POST", "/promote")
        if status != 200:
            raise ReplicaFailed(f"replica {self.replica_id} refused promotion: {body}")
        self.role = Role.SERVING
        return float(body["promote_s"])

    async def wait_exit(self, timeout_s: float) -> int | None:
        assert self.exit_task is not None
        try:
            return await asyncio.wait_for(asyncio.shield(self.exit_task), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def drain(self, timeout_s: float) -> int:
        """Hand the replica's connections back and let it exit; kill it after timeout_s."""
        self.leaving = True
        self.phase = Phase.DRAINING
        try:
            status, _ = await self.admin("POST", "/drain")
            asked = status == 202
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            asked = False
        if not asked:
            self.signal(signal.SIGTERM)  # the same graceful path
        code = await self.wait_exit(timeout_s)
        if code is None:
            logger.warning("replica %d did not exit within %.0f s of its drain; killing it",
                           self.replica_id, timeout_s)
            self.signal(signal.SIGKILL)
            code = await self.wait_exit(30.0)
        return -9 if code is None else code

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop a replica that is not serving (a failed rollout's new one): SIGTERM, then SIGKILL."""
        self.leaving = True
        self.signal(signal.SIGTERM)
        if await self.wait_exit(timeout_s) is None:
            self.signal(signal.SIGKILL)
            await self.wait_exit(30.0)

    def signal(self, sig: int) -> None:
        if self.exit_task is not None and self.exit_task.done():
            return
        try:
            self.process.send_signal(sig)
        except ProcessLookupError:
            pass


__all__ = ["Phase", "ReplicaFailed", "ReplicaHandle", "ReplicaProcess", "Role"]

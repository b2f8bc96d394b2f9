"""What the supervisor does when a replica exits: the restart policy.

A replica that exits while ready, neither asked to leave nor during shutdown, has crashed:
a ready standby is promoted in its place when there is one (and the replacement starts as a
standby), else a new serving replica starts. Crashes and failed starts in the last
CRASH_WINDOW_S seconds delay the next start: not at all after the first, then the initial
backoff doubling up to the maximum (`SupervisorConfig.restart_backoff_s`,
`max_restart_backoff_s`). A replica that exits before it was ready is not replaced here:
whoever waits for its /ready reports it (the supervisor's start, a rollout, a replacement).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from resident.worker.replica_handle import Phase, ReplicaFailed, ReplicaHandle, Role

if TYPE_CHECKING:
    from resident.worker.supervisor import Supervisor

logger = logging.getLogger(__name__)

CRASH_WINDOW_S = 60.0


class CrashHistory:
    """Recent crashes and failed starts (the last `window_s` seconds), and the delay they
    impose before the next start. Its length is the number of recent ones."""

    def __init__(self, backoff_s: float, max_backoff_s: float, window_s: float = CRASH_WINDOW_S) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def __len__(self) -> int:
        return len(self._times)

    def record(self) -> None:
        self._times.append(time.monotonic())

    def restart_delay(self) -> float:
        """Seconds to wait before the next start (forgetting crashes older than the window)."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        recent = len(self._times)
        if recent <= 1:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (recent - 2))


async def watch_replica(sup: Supervisor, handle: ReplicaHandle) -> None:
    """Wait for `handle`'s process to exit, forget the replica, and replace it if it crashed."""
    assert handle.exit_task is not None
    code = await handle.exit_task
    was_ready = handle.phase is Phase.READY
    handle.exit_code, handle.phase = code, Phase.EXITED
    sup.forget(handle)
    if code == 0 and not handle.leaving and not sup.stopping:
        # A clean exit nobody here asked for: a signal to the whole process group (Ctrl-C,
        # KillMode=control-group) reaches the supervisor a moment later. Give it that moment.
        await sup.wait_for_stop(1.0)
    if handle.leaving or sup.stopping or not was_ready:
        # Expected, or a start-up failure that whoever waits for its /ready reports.
        logger.info("replica %d (pid %d) exited with code %s", handle.replica_id, handle.pid, code)
        sup.report_status()
        return
    logger.warning("replica %d (pid %d, %s) exited unexpectedly with code %s; replacing it",
                   handle.replica_id, handle.pid, handle.role.value, code)
    sup.crashes.record()
    role = handle.role
    if role is Role.SERVING and (standby := sup.ready_standby()) is not None:
        try:
            seconds = await standby.promote()
        except (ReplicaFailed, aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            logger.error("could not promote standby replica %d (%s); starting a serving replica instead",
                         standby.replica_id, e)
        else:
            logger.info("promoted standby replica %d in %.1f ms", standby.replica_id, seconds * 1e3)
            role = Role.STANDBY
    sup.report_status()
    await replace_replica(sup, role)


async def replace_replica(sup: Supervisor, role: Role) -> None:
    """Start a `role` replica and wait for its /ready, backing off and retrying until one is
    ready or the supervisor stops."""
    while not sup.stopping:
        delay = sup.crashes.restart_delay()
        if delay:
            logger.warning("%d crashes in the last %.0f s: waiting %.1f s before the next start",
                           len(sup.crashes), sup.crashes.window_s, delay)
            await asyncio.sleep(delay)
        if sup.stopping:
            return
        try:
            handle = await sup.spawn(role)
        except (OSError, RuntimeError, asyncio.TimeoutError) as e:
            # Counted as a crash (the next try backs off); the task must not die with it.
            logger.error("could not start a replacement %s replica: %s", role.value, e)
            sup.crashes.record()
            continue
        try:
            await handle.wait_ready(sup.config.ready_timeout_s)
            logger.info("replacement replica %d ready in %.2f s", handle.replica_id, handle.ready_s)
            sup.report_status()
            return
        except ReplicaFailed as e:
            if handle.leaving:
                # A rollout drained this replacement while it was starting (it was among the
                # replicas to roll) and started its own in its place: starting yet another one
                # would leave more replicas than --data-parallel-size.
                logger.info("replacement replica %d was drained by a rollout before it was ready; the "
                            "rollout's new replica takes its place", handle.replica_id)
                return
            logger.error("%s", e)
            await handle.stop()
            sup.crashes.record()


__all__ = ["CRASH_WINDOW_S", "CrashHistory", "replace_replica", "watch_replica"]

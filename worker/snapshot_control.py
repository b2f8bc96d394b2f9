"""The worker's side of a snapshot: quiesce, detach from the daemon, and come back.

`resident snapshot create` (cli/snapshot.py) asks a serving worker, over its admin socket,
to `prepare`: stop admitting (new HTTP requests and /ready answer 503), wait for running
requests, record a canary (a fixed prompt, the greedy next token and its logprob, through
the engine), then detach: the weights are unmapped with their addresses kept reserved
(`memory.SlabMapping.unmap`: a PROT_NONE placeholder for host_shm memfds, the kept VA
reservation for cuda_vmm), the KV cache likewise (`KVCache.unmap`), the lease is released
and the daemon connection closed — gRPC's threads end with the last channel, so what CRIU
dumps holds neither weight pages nor sockets to the daemon. `resume` reverses it: a new
daemon session, the same model key (loaded first from the stored LoadSpec with
`load_if_missing`), the slabs mapped at the same addresses, sampled checksums verified, a
zeroed KV cache at the same addresses (the prefix cache forgotten), the lease watch
restarted; then the canary is replayed (same token, logprob within CANARY_TOLERANCE) and
only then the worker accepts requests again. A failure before the canary leaves the worker
cleanly detached (resume can be retried); a canary mismatch marks it failed (not ready).

Speculative decoding: a draft paired with its target in the daemon (`WeightStore.draft`, one
model key, one attach) lives in the target's slabs, so detaching the store unmaps its weights
too and `attach_again` maps them back; the draft runner's KV cache is unmapped and re-mapped
beside the target's (`runner.kv_caches`; the manifest lists both ranges). Prompt lookup
(n-gram) has neither weights nor a KV cache. The canary decodes one token, so it never
speculates: it checks the target, and the draft's weights are covered by `WeightStore.verify`
(their checksums are in the same table).

Weights a worker loaded itself (`--preload off`, or no daemon: LocalStore) are not
detachable: they would have to go into the image. prepare refuses such workers (409), as it
refuses tensor-parallel groups, a draft held in a store of its own (not paired with the
target in the daemon), cuda_ipc weights and a KV cache still growing in the background.

The steps live beside it: snapshot_detach.py (what may detach, the detach, the manifest),
snapshot_reattach.py (the re-attach), snapshot_canary.py (the canary), snapshot_error.py.
Imports nothing heavy at module level (nor do they): the CLI imports `admin_socket_for_pid`
from here.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from resident.worker.snapshot_canary import CANARY_PROMPT, CANARY_TOLERANCE, Canary, run_canary
from resident.worker.snapshot_detach import build_manifest, check_detachable, detach, thread_names
from resident.worker.snapshot_error import SnapshotError
from resident.worker.snapshot_reattach import reattach

logger = logging.getLogger(__name__)

PAUSED_MESSAGE = ("this worker is being snapshotted and accepts no requests until it resumes; retry shortly "
                  "(or send requests to another replica)")
#: Unix socket paths longer than this do not fit sockaddr_un.
MAX_SOCKET_PATH_BYTES = 107


def admin_socket_for_pid(pid: int, env: Mapping[str, str] | None = None) -> str:
    """Where `resident serve` (pid `pid`) listens for admin requests unless --admin-socket says
    otherwise: `<runtime dir>/worker-<pid>.sock` ($RESIDENT_RUNTIME_DIR, /run/resident when
    writable, $XDG_RUNTIME_DIR/resident, else /tmp/resident-<uid>; see worker/control.py)."""
    from resident.worker.control import runtime_dir

    if pid <= 0:
        raise ValueError(f"a worker pid must be positive, got {pid}")
    return os.path.join(runtime_dir(env), f"worker-{pid}.sock")


class SnapshotState(str, enum.Enum):
    SERVING = "serving"
    PREPARING = "preparing"
    DETACHED = "detached"
    RESUMING = "resuming"
    FAILED = "failed"


class SnapshotControl:
    """prepare / resume / status for one serving worker (see the module doc).

    `server_state` is the HTTP server's ServerState (its `paused` gates requests), `worker`
    the built startup.Worker, `config` the ServeConfig. Coroutines run on the event loop;
    the blocking parts run in a thread while the loop keeps answering probes.

    `listener`, when given (a replica on its supervisor's shared socket), is told to stop
    accepting connections when prepare begins and to accept again once the worker serves
    (a prepare that gave up, a resume that passed its canary): meanwhile the other replicas
    take every new connection instead of this one answering a share of them 503. It has
    `async stop_accepting()` and `async start_accepting()`."""

    def __init__(self, server_state: Any, worker: Any, config: Any, listener: Any = None) -> None:
        self.server_state = server_state
        self.worker = worker
        self.config = config
        self.listener = listener
        self.state = SnapshotState.SERVING
        self.error: str | None = None
        self.canary: Canary | None = None
        self.manifest: dict[str, Any] | None = None
        self.last_resume: dict[str, float] | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()

    # --- queries ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state.value, "pid": os.getpid()}
        if self.error:
            out["error"] = self.error
        if self.state is SnapshotState.DETACHED and self.manifest is not None:
            out["manifest"] = self.manifest
        if self.last_resume is not None:
            out["last_resume"] = self.last_resume
        return out

    @property
    def device_type(self) -> str:
        return str(self.worker.runner.device).split(":")[0]

    # --- prepare ---------------------------------------------------------------------------
    async def prepare(self, timeout_s: float) -> dict[str, Any]:
        if not 0 <= timeout_s < math.inf:  # NaN too: it would never time out
            raise SnapshotError(400, f"timeout_s must be a finite number of seconds >= 0, got {timeout_s}")
        if self._lock.locked():
            raise SnapshotError(409, f"a snapshot step is already running (state {self.state.value})")
        async with self._lock:
            if self.state is not SnapshotState.SERVING:
                raise SnapshotError(409, f"the worker is {self.state.value}, not serving: nothing to prepare")
            check_detachable(self.worker, self.config)
            self.state, self.error = SnapshotState.PREPARING, None
            self.server_state.paused = PAUSED_MESSAGE
            t0 = time.monotonic()
            try:
                if self.listener is not None:
                    await self.listener.stop_accepting()
                await self._quiesce(timeout_s)
                t1 = time.monotonic()
                canary = await self._run_canary()
            except BaseException as e:
                self.state, self.server_state.paused = SnapshotState.SERVING, None
                await self._accept_again()
                if isinstance(e, SnapshotError):
                    raise
                raise SnapshotError(500, f"the canary request failed ({e}); the worker serves again") from e
            t2 = time.monotonic()
            try:
                threads = await asyncio.to_thread(detach, self.worker)
            except BaseException as e:
                self._fail(f"detaching failed: {e}")
                raise SnapshotError(500, f"detaching from the daemon failed: {e}; the worker is not usable any "
                                         "more, restart it") from e
            t3 = time.monotonic()
            self.canary = canary
            self.manifest = build_manifest(self.worker, self.config, canary, threads)
            self.state = SnapshotState.DETACHED
            timings = {"quiesce_s": t1 - t0, "canary_s": t2 - t1, "detach_s": t3 - t2}
            logger.info("snapshot prepared: detached from the daemon (quiesce %.3f s, canary %.3f s, detach %.3f s); "
                        "weights at %s, KV cache at %s", *timings.values(),
                        _fmt(self.manifest["addresses"]["weights"]), _fmt(self.manifest["addresses"]["kv"]))
            return {"state": self.state.value, "manifest": self.manifest, "timings": timings}

    async def _quiesce(self, timeout_s: float) -> None:
        """Wait until no HTTP handler and no engine request is in flight (new ones are refused),
        and the start-up work left for after ready is done (the engine thread's graph captures,
        the runner's sampler warm-up: their kernels read memory the detach unmaps)."""
        engine, state = self.worker.engine, self.server_state
        deadline = time.monotonic() + timeout_s
        while state.num_http_in_flight or engine.num_in_flight or self._startup_work_running():
            if time.monotonic() >= deadline:
                n = max(state.num_http_in_flight, engine.num_in_flight)
                what = (f"{n} request(s) still running" if n else
                        "the start-up work after ready (graph captures, the sampler's kernels) still running")
                raise SnapshotError(409, f"{what} after {timeout_s:g} s; the worker serves again; retry with a "
                                         "larger timeout_s")
            await asyncio.sleep(0.01)

    def _startup_work_running(self) -> bool:
        done = getattr(self.worker.engine, "idle_work_done", None)
        return (done is not None and not done.is_set()) or bool(getattr(self.worker.runner, "background_busy", False))

    async def _run_canary(self) -> Canary:
        return await run_canary(self.worker, f"snapshot-canary-{os.getpid()}-{next(self._ids)}")

    # --- resume ----------------------------------------------------------------------------
    async def resume(self, load_if_missing: bool = False) -> dict[str, Any]:
        if self._lock.locked():
            raise SnapshotError(409, f"a snapshot step is already running (state {self.state.value})")
        async with self._lock:
            if self.state is not SnapshotState.DETACHED:
                hint = "; restart the worker" if self.state is SnapshotState.FAILED else ""
                raise SnapshotError(409, f"the worker is {self.state.value}, not detached: nothing to resume{hint}")
            assert self.canary is not None
            self.state, self.error = SnapshotState.RESUMING, None
            try:
                timings = await asyncio.to_thread(reattach, self.worker, self.config, load_if_missing)
            except BaseException as e:
                self.state = SnapshotState.DETACHED
                self.error = str(e)
                if isinstance(e, SnapshotError):
                    raise
                raise SnapshotError(500, f"re-attaching failed: {e}; the worker stays detached") from e
            t = time.monotonic()
            try:
                replay = await self._run_canary()
            except BaseException as e:
                self._fail(f"the canary request failed after re-attaching: {e}")
                raise SnapshotError(500, self.error or str(e)) from e
            timings["canary_s"] = time.monotonic() - t
            why = self.canary.mismatch(replay, CANARY_TOLERANCE.get(self.device_type, 1e-2))
            if why is not None:
                self._fail(f"the canary does not match after re-attaching: {why}")
                raise SnapshotError(500, f"{self.error}; the worker stays not ready: restart it")
            self.last_resume = timings
            self.state, self.server_state.paused, self.manifest = SnapshotState.SERVING, None, None
            await self._accept_again()
            logger.info("snapshot resumed: serving again (re-attach %.3f s, KV %.3f s, canary %.3f s)",
                        timings["reattach_s"], timings["kv_s"], timings["canary_s"])
            return {"state": self.state.value, **timings, "canary": replay.to_dict()}

    async def _accept_again(self) -> None:
        if self.listener is None:
            return
        try:
            await self.listener.start_accepting()
        except Exception as e:  # noqa: BLE001 - it serves through its open connections; say why not through new ones
            logger.error("the worker serves again but could not accept new connections: %s; restart it", e)

    def _fail(self, why: str) -> None:
        self.state, self.error = SnapshotState.FAILED, why
        self.server_state.paused = f"this worker could not resume from a snapshot ({why}); restart it"
        logger.error("snapshot: %s", why)


def _fmt(ranges: list[dict[str, int]]) -> str:
    return ", ".join(f"0x{r['start']:x}+{r['nbytes']}" for r in ranges)


__all__ = ["CANARY_PROMPT", "CANARY_TOLERANCE", "Canary", "SnapshotControl", "SnapshotError", "SnapshotState",
           "admin_socket_for_pid", "thread_names"]

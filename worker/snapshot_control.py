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

Imports nothing heavy at module level: the CLI imports `admin_socket_for_pid` from here.
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
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: The canary's prompt (greedy, one token).
CANARY_PROMPT = "The capital of France is"
#: How far the replayed canary's logprob may drift, by device type.
CANARY_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-2}
#: Thread names gRPC's core runs while any channel lives (they end with the last one).
GRPC_THREAD_PREFIXES = ("event_engine", "grpc_global_tim", "lifeguard", "grpc")
#: Seconds to wait, after the daemon connection closed, for gRPC's threads to end.
GRPC_THREADS_GONE_S = 5.0
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


class SnapshotError(RuntimeError):
    """A prepare/resume that cannot proceed; `status` is the HTTP status the admin socket answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Canary:
    prompt: str
    prompt_token_ids: tuple[int, ...]
    token_id: int
    logprob: float

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or self.token_id < 0:
            raise ValueError(f"invalid canary: {len(self.prompt_token_ids)} prompt tokens, token {self.token_id}")

    def mismatch(self, replay: Canary, tolerance: float) -> str | None:
        """Why `replay` does not reproduce this canary, or None when it does."""
        if replay.token_id != self.token_id:
            return f"greedy token {replay.token_id}, recorded {self.token_id}"
        if abs(replay.logprob - self.logprob) > tolerance:
            return f"logprob {replay.logprob:.6f}, recorded {self.logprob:.6f} (tolerance {tolerance:g})"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompt_token_ids"] = list(self.prompt_token_ids)
        return d


def thread_names() -> list[str]:
    """Names of this process's threads, from /proc (gRPC's C threads included)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass   # the thread ended meanwhile
    return names


def _grpc_threads() -> list[str]:
    return [n for n in thread_names() if n.startswith(GRPC_THREAD_PREFIXES)]


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
            self._check_detachable()
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
                threads = await asyncio.to_thread(self._detach)
            except BaseException as e:
                self._fail(f"detaching failed: {e}")
                raise SnapshotError(500, f"detaching from the daemon failed: {e}; the worker is not usable any "
                                         "more, restart it") from e
            t3 = time.monotonic()
            self.canary = canary
            self.manifest = self._manifest(canary, threads)
            self.state = SnapshotState.DETACHED
            timings = {"quiesce_s": t1 - t0, "canary_s": t2 - t1, "detach_s": t3 - t2}
            logger.info("snapshot prepared: detached from the daemon (quiesce %.3f s, canary %.3f s, detach %.3f s); "
                        "weights at %s, KV cache at %s", *timings.values(),
                        _fmt(self.manifest["addresses"]["weights"]), _fmt(self.manifest["addresses"]["kv"]))
            return {"state": self.state.value, "manifest": self.manifest, "timings": timings}

    def _check_detachable(self) -> None:
        from resident.daemon.memory.base import FixedSlabMapping

        w = self.worker
        store = w.store
        if store.source != "daemon":
            raise SnapshotError(409, "this worker loaded its weights in-process (--preload off, or no daemon was "
                                     "running), so a snapshot would have to carry them in its image; serve with "
                                     "--preload require (a running `resident preload` daemon) to snapshot it")
        if getattr(w, "tp", None) is not None:
            raise SnapshotError(409, "snapshots of tensor-parallel workers are not supported; serve with "
                                     "--tensor-parallel-size 1")
        if getattr(w, "draft_store", None) is not None:
            raise SnapshotError(409, f"this worker's speculative draft was attached as a model of its own "
                                     f"({w.draft_store.source}), not paired with the target, so re-attaching could "
                                     f"not map it back at the same addresses; serve with --preload require so the "
                                     f"daemon holds target and draft as one model "
                                     f"(`resident preload load {self.config.model} --draft DRAFT`)")
        mapping = getattr(store, "mapping", None)
        if mapping is None or isinstance(mapping, FixedSlabMapping):
            raise SnapshotError(409, f"the daemon's {getattr(store, 'backend', '?')} weights cannot be re-mapped at "
                                     "the same addresses; run the daemon with --backend cuda_vmm (GPU) or host_shm")
        for kv in _kv_caches(w.runner):
            if kv.memory is None and kv.host is None:
                raise SnapshotError(409, "this worker's KV cache is not in memory it can unmap and re-map")
        growth = getattr(w, "kv_growth", None)
        if growth is not None and growth.is_alive():
            raise SnapshotError(409, "the KV cache is still growing to its full size in the background; retry "
                                     "once `resident_worker_kv_cache_growth_seconds` is set")
        if w.llm_engine is None:
            raise SnapshotError(409, "this worker's engine does not support snapshots")

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
        from resident.worker.sampling_params import SamplingParams

        ids = self.worker.serving.tokenizer.encode(CANARY_PROMPT)
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True)
        token, logprob = -1, 0.0
        async for out in self.worker.engine.generate(f"snapshot-canary-{os.getpid()}-{next(self._ids)}", ids,
                                                     params):
            if out.new_token_ids:
                token, logprob = out.new_token_ids[0], out.logprobs[0].logprob
        return Canary(CANARY_PROMPT, tuple(ids), int(token), float(logprob))

    def _detach(self) -> list[str]:
        """(thread) Unmap the weights and the KV cache, end the lease and the daemon session."""
        self.worker.store.detach()   # a paired draft's weights too: they live in the same slabs
        for kv in _kv_caches(self.worker.runner):
            kv.unmap()
        _release_cached_gpu_memory(self.worker.runner)
        deadline = time.monotonic() + GRPC_THREADS_GONE_S
        while _grpc_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        names = thread_names()
        if _grpc_threads():
            logger.warning("gRPC threads still run after the daemon connection closed: %s", _grpc_threads())
        return names

    def _manifest(self, canary: Canary, threads: list[str]) -> dict[str, Any]:
        store, runner = self.worker.store, self.worker.runner
        descs = store.mapping.descs
        return {
            "pid": os.getpid(),
            "model_key": store.model_key,
            "model": self.config.model,
            "served_model_name": self.config.model_name,
            "daemon_socket": self.config.socket,
            "backend": store.mapping.backend,
            "device": str(runner.device),
            "device_uuid": descs[0].device_uuid if descs else "",
            "tensor_parallel_size": 1,
            "speculative": _speculative(self.config, store),
            "canary": canary.to_dict(),
            "addresses": {
                "weights": [{"start": a, "nbytes": n} for a, n in store.mapping.ranges()],
                "kv": [{"start": a, "nbytes": n} for kv in _kv_caches(runner) for a, n in kv.ranges()],
            },
            "threads": threads,
        }

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
                timings = await asyncio.to_thread(self._reattach, load_if_missing)
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

    def _reattach(self, load_if_missing: bool) -> dict[str, float]:
        """(thread) New session, same key, same addresses, checksums; then a zeroed KV cache."""
        from resident.daemon.client import Client
        from resident.daemon.errors import DaemonError, DaemonUnavailable, NotFound

        store, config = self.worker.store, self.config
        t0 = time.monotonic()
        try:
            client = Client(config.socket, client_name="resident-serve")
        except DaemonUnavailable as e:
            raise SnapshotError(503, f"cannot re-attach: {e}; the worker stays detached") from None
        try:
            self._attach_or_load(client, load_if_missing)
        except NotFound as e:
            client.close()
            raise SnapshotError(409, str(e)) from None
        except DaemonError as e:
            client.close()
            raise SnapshotError(409, f"the daemon refused to re-attach model {store.model_key[:16]}: {e}; the "
                                     "worker stays detached") from None
        except BaseException:
            client.close()
            raise
        try:
            store.verify(config.verify_sample)
        except BaseException:
            store.detach()
            raise
        t1 = time.monotonic()
        kvs = _kv_caches(self.worker.runner)
        done = 0
        try:
            for kv in kvs:
                kv.remap()
                done += 1
        except BaseException:
            for kv in kvs[:done]:   # stay cleanly detached: resume can be retried
                kv.unmap()
            store.detach()
            raise
        # The engine thread is idle (nothing was admitted since prepare); cached prefixes
        # point at KV blocks that now hold zeros.
        self.worker.llm_engine.scheduler.block_manager.reset_prefix_cache()
        return {"reattach_s": t1 - t0, "kv_s": time.monotonic() - t1}

    def _attach_or_load(self, client: Any, load_if_missing: bool) -> None:
        from resident.daemon.errors import NotFound
        from resident.daemon.loader import LoadSpec
        from resident.worker.tp_spawn import spec_fields
        from resident.worker.weight_store import _absolute, _load_into_daemon

        store, config = self.worker.store, self.config
        try:
            store.attach_again(client)
            return
        except NotFound:
            if not load_if_missing:
                raise NotFound(f"the daemon at {config.socket} no longer holds model {store.model_key[:16]} "
                               f"({config.model}); load it (`resident preload load {config.model}`) or resume "
                               "with load_if_missing; the worker stays detached") from None
        spec = _absolute(LoadSpec(**spec_fields(config)))   # a paired draft is part of the model key
        logger.info("snapshot resume: the daemon no longer holds %s; asking it to load it", store.model_key[:16])
        _load_into_daemon(client, spec)
        try:
            store.attach_again(client)
        except NotFound:
            raise NotFound(f"after loading {config.model}, the daemon still holds no model with key "
                           f"{store.model_key[:16]}: the checkpoint changed since this worker started; start a "
                           "new worker instead") from None

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


def _kv_caches(runner: Any) -> list[Any]:
    """The runner's KV caches: the target's, and a speculative draft's (SpecDecodeRunner)."""
    caches = getattr(runner, "kv_caches", None)
    return list(caches) if caches is not None else [runner.kv_cache]


def _speculative(config: Any, store: Any) -> dict[str, Any] | None:
    """What the manifest records of speculative decoding (None without it)."""
    spec = getattr(config, "speculative", None)
    if spec is None:
        return None
    draft = getattr(store, "draft", None)
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_model": spec.draft_model, "draft_key": draft.model_key if draft is not None else None}


def _fmt(ranges: list[dict[str, int]]) -> str:
    return ", ".join(f"0x{r['start']:x}+{r['nbytes']}" for r in ranges)


__all__ = ["CANARY_PROMPT", "CANARY_TOLERANCE", "Canary", "SnapshotControl", "SnapshotError", "SnapshotState",
           "admin_socket_for_pid", "thread_names"]


def _release_cached_gpu_memory(runner: Any) -> None:
    """Give the allocator's cached, unused blocks back to the driver before the checkpoint:
    the driver copies every allocation of the process into the image, used or not. Blocks in
    use (model buffers) and the CUDA graphs' private pools stay; their addresses do not move."""
    device = getattr(runner, "device", None)
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return
    import torch

    with torch.cuda.device(device):
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        logger.info("snapshot: released %.1f MiB of cached GPU memory before the checkpoint",
                    (before - torch.cuda.memory_reserved()) / 2**20)

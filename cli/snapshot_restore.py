"""`resident snapshot restore DIR`: bring a snapshotted worker back serving on its port.

Everything that can be checked is checked before CRIU runs, each with its own error: the
directory and manifest, privileges and CRIU, kernel and versions, GPU UUID and driver, that
the daemon still holds the model key (or --load-if-missing), that the port is free, and that
the snapshot's pids are free (waited for: a dump that stopped the worker leaves them taken
until its parent reaps it). Then: `criu restore --restore-detached`; on GPU, CUDA restore +
unlock; POST /snapshot/resume (the worker re-attaches by key, maps weights and a fresh KV
cache at the recorded addresses, replays the canary); wait for /ready. If anything after the
CRIU restore fails, the restored tree is killed: nothing is left half-restored.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from resident.cli.snapshot_create import SnapshotError, usable_criu
from resident.cli.snapshot_manifest import IMAGES, Manifest, ManifestError, gpu_facts, load_manifest, versions
from resident.cli.snapshot_worker import AdminClient, WorkerError, wait_ready
from resident.worker import criu
from resident.worker.criu import CriuError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreConfig:
    directory: Path
    load_if_missing: bool = False
    model_key: str = ""                 # if set, the manifest must be for this key
    daemon_socket: str | None = None    # overrides the manifest's
    pid_wait_s: float = 10.0
    ready_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # Written so that NaN (which compares false both ways) is refused too.
        if not 0 <= self.pid_wait_s < math.inf:
            raise ValueError(f"--pid-wait must be a finite number of seconds >= 0, got {self.pid_wait_s}")
        if not 0 < self.ready_timeout_s < math.inf:
            raise ValueError(f"--ready-timeout must be a finite number of seconds > 0, got {self.ready_timeout_s}")


@dataclass
class RestoreResult:
    manifest: Manifest
    pid: int
    timings_s: dict[str, float] = field(default_factory=dict)


def check_host(config: RestoreConfig) -> tuple[Manifest, criu.CriuBinary]:
    """Every check that needs no change to the host; raises SnapshotError naming the problem."""
    try:
        manifest = load_manifest(config.directory)
    except ManifestError as e:
        raise SnapshotError(str(e)) from None
    if config.model_key and manifest.model_key != config.model_key:
        raise SnapshotError(f"{config.directory} is a snapshot of model key {manifest.model_key}, not "
                            f"{config.model_key}")
    binary = usable_criu("to restore")
    kernel = os.uname().release
    if kernel != manifest.kernel:
        raise SnapshotError(f"the snapshot was taken on kernel {manifest.kernel}, this host runs {kernel}; "
                            "create a new snapshot on this kernel")
    here = versions()
    changed = [f"{k} {manifest.versions.get(k)} -> {v}" for k, v in here.items() if manifest.versions.get(k) != v]
    if changed:
        raise SnapshotError(f"software changed since the snapshot ({', '.join(changed)}); create a new snapshot")
    if manifest.on_gpu:
        _check_gpu(manifest)
    _check_daemon(manifest, config)
    _check_port(manifest)
    still = criu.wait_pids_gone(manifest.tree_pids, config.pid_wait_s)
    if still:
        raise SnapshotError("the snapshot's pids are still taken: " + "; ".join(_describe_pid(p) for p in still)
                            + ". Stop the original worker (and let its parent reap it) before restoring")
    return manifest, binary


def _check_gpu(manifest: Manifest) -> None:
    want = manifest.gpu.get("uuid", "")
    gpu = gpu_facts(want)
    if not gpu:
        raise SnapshotError(f"GPU {want or '(unknown)'} of the snapshot is not on this host (nvidia-smi lists it not)")
    if manifest.gpu.get("driver") and gpu["driver"] != manifest.gpu["driver"]:
        raise SnapshotError(f"NVIDIA driver {manifest.gpu['driver']} at snapshot, {gpu['driver']} now; "
                            "create a new snapshot")
    kv_bytes = sum(e - s for s, e in manifest.kv_ranges())
    need = int(manifest.gpu.get("used_bytes", "0")) + kv_bytes
    free = int(gpu["free_bytes"])
    if free < need:
        raise SnapshotError(f"GPU {gpu['uuid']} has {free / 2**30:.2f} GiB free; the worker needs "
                            f"{need / 2**30:.2f} GiB (its CUDA state and KV cache): free GPU memory first (a CUDA "
                            "restore that runs out of memory can leave the process stuck)")


def _describe_pid(pid: int) -> str:
    state = criu.pid_state(pid)
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    except OSError:
        return f"pid {pid}"
    if state == "Z":
        return f"pid {pid} is a zombie its parent {ppid} has not reaped"
    return f"pid {pid} runs ({cmd.strip() or '?'}, parent {ppid})"


def _check_daemon(manifest: Manifest, config: RestoreConfig) -> None:
    path = config.daemon_socket if config.daemon_socket is not None else manifest.daemon_socket
    if not path:
        return  # the worker ran without a daemon
    from resident.daemon.client import Client
    from resident.daemon.errors import DaemonError

    try:
        with Client(path, client_name="resident snapshot restore") as client:
            models = client.list()
    except DaemonError as e:
        raise SnapshotError(f"cannot ask the daemon at {path} for model {manifest.model_key}: {e}") from None
    if any(m.key == manifest.model_key for m in models):
        return
    if config.load_if_missing:
        logger.info("the daemon does not hold %s; the worker will have it loaded", manifest.model_key)
        return
    held = ", ".join(f"{m.name} ({m.key[:12]})" for m in models) or "no model"
    raise SnapshotError(f"the daemon at {path} no longer holds model key {manifest.model_key} (it holds {held}); "
                        "load it again (`resident preload load ...`) or pass --load-if-missing")


def _check_port(manifest: Manifest) -> None:
    family = socket.AF_INET6 if ":" in manifest.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((manifest.host, manifest.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise SnapshotError(f"port {manifest.port} on {manifest.host} is in use; the restored worker needs "
                                    "it: stop whatever listens there") from None
            raise SnapshotError(f"cannot bind {manifest.host}:{manifest.port}: {e}") from None


def restore_snapshot(config: RestoreConfig) -> RestoreResult:
    manifest, binary = check_host(config)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    log_dir = config.directory if os.access(config.directory, os.W_OK) else Path(tempfile.mkdtemp(prefix="resident-"))
    log = log_dir / f"restore-{int(time.time())}.log"
    try:
        result = criu.restore(binary, config.directory / IMAGES, manifest.criu_options, log)
    except CriuError as e:
        # A criu that failed or was killed can leave part of the tree behind, holding the pids
        # and the port; they were free before it ran, so whatever holds them now is its.
        criu.kill_tree(list(manifest.tree_pids))
        raise SnapshotError(str(e)) from None
    timings["criu_restore"] = result.seconds
    try:
        if manifest.on_gpu:
            from resident.worker.cuda_checkpoint import CudaCheckpoint

            timings["cuda_restore"] = CudaCheckpoint(result.pid).restore_and_unlock()
        reply = AdminClient(manifest.admin_socket).resume(config.load_if_missing, config.ready_timeout_s)
        timings.update({k.removesuffix("_s"): float(v) for k, v in reply.items()
                        if k.endswith("_s") and isinstance(v, (int, float))})
        wait_ready(manifest.host, manifest.port, config.ready_timeout_s)
    except BaseException as e:
        logger.error("restore failed after CRIU brought the worker back (%s); killing pids %s", e,
                     list(manifest.tree_pids))
        criu.kill_tree(list(manifest.tree_pids))
        if isinstance(e, (WorkerError, RuntimeError)):
            raise SnapshotError(f"{e} (the restored worker was stopped; CRIU log: {log})") from e
        raise
    timings["total"] = time.monotonic() - t0
    return RestoreResult(manifest, result.pid, timings)


__all__ = ["RestoreConfig", "RestoreResult", "check_host", "restore_snapshot"]

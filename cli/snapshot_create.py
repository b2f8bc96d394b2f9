"""`resident snapshot create`: freeze one running TP=1 worker into a snapshot directory.

Order: find the worker and its admin socket; refuse what CRIU cannot carry (stdout/stderr
pipes) before touching it; POST /snapshot/prepare (the worker quiesces, records the canary,
detaches weights and KV keeping their address ranges, closes its daemon connections); on GPU,
lock + checkpoint its CUDA state; `criu dump --leave-running` into DIR.tmp/images; prove from
the images that none of the detached ranges' pages are in them; write the manifest; rename
DIR.tmp -> DIR. Then either stop the worker (SIGKILL to its tree) or resume it (CUDA restore +
unlock, POST /snapshot/resume). Any failure resumes the worker and removes DIR.tmp.

The dump always leaves the tree running so that a failed check can still resume it.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from resident.cli.snapshot_doctor import privileges
from resident.cli.snapshot_manifest import (IMAGES, Manifest, address_ranges, gpu_facts, gpu_used_bytes, image_sizes,
                                            versions, write_manifest)
from resident.cli.snapshot_worker import AdminClient, daemon_socket_of, find_admin, listening_tcp
from resident.worker import criu, criu_images
from resident.worker.criu import find_criu, format_version

logger = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    pass


@dataclass(frozen=True)
class CreateConfig:
    pid: int
    output: Path
    port: int = 0                    # the port asked for (--url); 0: the worker's only listening port
    leave_running: bool = False
    prepare_timeout_s: float = 120.0
    resume_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.pid <= 0:
            raise ValueError(f"pid must be positive, got {self.pid}")
        if not self.output.is_absolute():
            raise ValueError(f"output must be an absolute path, got {self.output}")
        # Refused here, before the worker is touched; NaN compares false both ways.
        if not 0 <= self.prepare_timeout_s < math.inf:
            raise ValueError(f"--prepare-timeout must be a finite number of seconds >= 0, got {self.prepare_timeout_s}")


@dataclass
class CreateResult:
    manifest: Manifest
    timings_s: dict[str, float] = field(default_factory=dict)


def _refuse_pipes(pid: int) -> None:
    targets = criu.fd_targets(pid)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if targets.get(fd, "").startswith("pipe:"):
            raise SnapshotError(f"the worker's {name} is a pipe, which CRIU cannot bring back connected: start "
                                f"`resident serve` with stdout and stderr redirected to a file (e.g. "
                                "`>> worker.log 2>&1`, or StandardOutput=append:... under systemd)")


def _pick_port(pid: int, asked: int) -> tuple[str, int]:
    listening = listening_tcp(pid)
    if asked:
        for host, port in listening:
            if port == asked:
                return host, port
        raise SnapshotError(f"pid {pid} does not listen on port {asked} (it listens on {listening})")
    if len(listening) != 1:
        raise SnapshotError(f"pid {pid} listens on {listening or 'no TCP port'}; pass --url to name the port")
    return listening[0]


def usable_criu(purpose: str) -> criu.CriuBinary:
    """The CRIU to run, once this process has the privileges `purpose` ("for a snapshot") needs."""
    priv = privileges()
    if not priv.ok:
        raise SnapshotError(f"no privileges {purpose}: {priv.detail}; {priv.fix}")
    found = find_criu()
    if found.binary is None:
        raise SnapshotError(f"no usable CRIU: {found.reason()}")
    return found.binary


def create_snapshot(config: CreateConfig) -> CreateResult:
    binary = usable_criu("for a snapshot")
    if criu.pid_state(config.pid) in (None, "Z"):
        raise SnapshotError(f"no running process with pid {config.pid}")
    if config.output.exists():
        raise SnapshotError(f"{config.output} already exists; remove it or choose another --output")
    parent = config.output.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        # Found before the worker quiesces and detaches, not after.
        raise SnapshotError(f"cannot create {config.output}: {parent} is not a writable folder; create it or "
                            "choose another --output")
    _refuse_pipes(config.pid)
    host, port = _pick_port(config.pid, config.port)
    admin = find_admin(config.pid)
    state = admin.state()
    if state != "serving":
        raise SnapshotError(f"the worker is {state!r}, not serving; a snapshot starts from a serving worker")
    options = criu.options_for(config.pid)
    tree = criu.process_tree(config.pid)
    daemon_socket = daemon_socket_of(config.pid)

    tmp = config.output.with_name(config.output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    timings: dict[str, float] = {}
    t = time.monotonic()
    reply = admin.prepare(config.prepare_timeout_s)
    timings["prepare"] = time.monotonic() - t
    worker = dict(reply.get("manifest", {}))
    device = str(worker.get("device", "cpu"))
    cuda = None
    try:
        gpu: dict[str, str] = {}
        if device.startswith("cuda"):
            from resident.worker.cuda_checkpoint import CudaCheckpoint

            uuid = str(worker.get("device_uuid", ""))
            gpu = {**{"uuid": uuid, "driver": ""}, **gpu_facts(uuid)}
            gpu.pop("free_bytes", None)
            # what the detached process still holds on the GPU; a restore needs that much free
            # (plus its KV cache), else the driver's restore can leave the process stuck
            gpu["used_bytes"] = str(gpu_used_bytes(config.pid))
            cuda = CudaCheckpoint(config.pid)
            timings["cuda_checkpoint"] = cuda.lock_and_checkpoint()
        images = tmp / IMAGES
        images.mkdir(parents=True)
        result = criu.dump(binary, config.pid, images, options, tmp / "dump.log", leave_running=True)
        timings["criu_dump"] = result.seconds
        ranges = address_ranges(worker.get("addresses"))
        leaked = criu_images.dumped_bytes_in(images, ranges)
        if leaked:
            raise SnapshotError(f"the image holds {leaked} bytes of the worker's detached weight/KV ranges: the "
                                "worker did not detach them; refusing a snapshot that would carry its weights")
        manifest = Manifest(
            model_key=str(worker.get("model_key", "")), device=device, pid=config.pid, tree_pids=tuple(tree),
            host=host, port=port, admin_socket=admin.path,
            daemon_socket=str(worker.get("daemon_socket") or daemon_socket),
            kernel=os.uname().release, versions=versions(), criu_version=format_version(binary.version),
            criu_options=options, address_ranges=tuple(ranges), image_bytes=criu_images.image_bytes(images),
            canary=worker.get("canary"),
            gpu=gpu,
            worker=worker, created_at=time.time(), image_sizes=image_sizes(images))
        write_manifest(tmp, manifest)
        os.rename(tmp, config.output)
    except BaseException as e:
        kept_log = _keep_dump_log(tmp, config.output)
        shutil.rmtree(tmp, ignore_errors=True)
        logger.error("snapshot failed (%s); resuming the worker", e)
        try:
            _resume(admin, cuda, config.resume_timeout_s)
        except Exception as resume_error:  # report both; the first is the cause
            raise SnapshotError(f"{e}; resuming the worker afterwards failed too: {resume_error}") from e
        if isinstance(e, (criu.CriuError, OSError)):   # e.g. the disk filled up: a message, not a traceback
            raise SnapshotError(_describe_failure(e, tmp, kept_log)) from e
        raise
    if config.leave_running:
        timings.update(_resume(admin, cuda, config.resume_timeout_s))
    else:
        criu.kill_tree(tree, wait_s=30)
    return CreateResult(manifest, timings)


def _keep_dump_log(tmp: Path, output: Path) -> Path | None:
    """Move DIR.tmp/dump.log beside DIR (a rename: works on a full disk) before DIR.tmp goes."""
    kept = output.with_name(output.name + ".dump.log")
    try:
        os.replace(tmp / "dump.log", kept)
    except OSError:
        return None
    return kept


def _describe_failure(e: BaseException, tmp: Path, kept_log: Path | None) -> str:
    text = str(e) if isinstance(e, criu.CriuError) else f"cannot write the snapshot into {tmp}: {e}"
    text = text.replace(str(tmp / "dump.log"), str(kept_log) if kept_log else "(its log is gone with the tmp folder)")
    if "No space left" in text:
        fix = "Free some space there or choose another --output."
    else:
        fix = "Choose another --output." if isinstance(e, OSError) else "The log names the cause."
    return f"{text}\nNothing was kept; the worker was resumed and serves again. {fix}"


def _resume(admin: AdminClient, cuda: object, timeout_s: float) -> dict[str, float]:
    timings: dict[str, float] = {}
    if cuda is not None:
        timings["cuda_restore"] = cuda.restore_and_unlock()  # type: ignore[attr-defined]
    reply = admin.resume(load_if_missing=False, timeout_s=timeout_s)
    # Named as restore names them (`reattach`, not `reattach_s`: the timings are all seconds).
    timings.update({k.removesuffix("_s"): float(v) for k, v in reply.items()
                    if k.endswith("_s") and isinstance(v, (int, float))})
    return timings


__all__ = ["CreateConfig", "CreateResult", "SnapshotError", "create_snapshot"]

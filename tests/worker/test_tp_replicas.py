"""A supervised replica can be a tensor-parallel group, restarted and rolled out as a unit.

`resident serve --data-parallel-size R --tensor-parallel-size 2` on CPU (gloo): each replica
process is rank 0 of its own group and spawns its rank 1; every rank attaches its shard of
the daemon's TP=2 copy of the model. A `resident rollout` under a streaming load
(cli/load_generator.py, no retries) replaces whole groups one at a time without a failed
request and without reading the model from disk again; the greedy answer is the same
before and after. A kill -9 of one replica's rank 1 takes that replica down with a clear
log line (rank 0 cannot compute without it), and the supervisor starts a new group.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from serve_helpers import (
    MODEL_NAME,
    daemon_helpers,
    http,
    metric,
    serve_env,
    servable_tiny_model,
    start_serve,
    stop_serve,
)

from resident.cli.load_generator import LoadConfig, LoadGenerator
from resident.worker.control import control_socket_path, get_status
from resident.worker.serve_config import ServeConfig
from resident.worker.supervisor_config import SupervisorConfig
from resident.worker.tp_executor import RANK_DIED_EXIT

PROMPT = "tensor parallel replicas"


def completion(base: str) -> str:
    status, body = http(base, "POST", "/v1/completions",
                        {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def ready_replicas(ctl: str, count: int, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        replicas = get_status(ctl)["replicas"]
        if len(replicas) == count and all(r["phase"] == "ready" for r in replicas):
            return replicas
        time.sleep(0.1)
    raise AssertionError(f"not {count} ready replicas within {timeout_s} s: {get_status(ctl)['replicas']}")


def rank1_of(replica_pid: int) -> int:
    """The replica's tensor-parallel rank 1: its one child process running tp_executor."""
    (child,) = [c for c in psutil.Process(replica_pid).children()
                if "resident.worker.tp_executor" in " ".join(c.cmdline())]
    return child.pid


def gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def tp_leases(d) -> dict[str, set[int]]:
    """client name -> pids holding a lease on the daemon's TP=2 copy of the model."""
    with d.client("probe") as c:
        (info,) = [m for m in c.list() if m.tensor_parallel_size == 2]
    leases: dict[str, set[int]] = {}
    for lease in info.leases:
        leases.setdefault(lease.client_name, set()).add(lease.pid)
    return leases


def assert_leases(d, ranks: dict[int, int], timeout_s: float = 10.0) -> None:
    """The daemon's leases are exactly these groups' (rank 0 pid -> rank 1 pid): every rank
    attached its own shard, and the groups that left released theirs."""
    want = {"resident-serve-tp0": set(ranks), "resident-serve-tp1": set(ranks.values())}
    deadline = time.monotonic() + timeout_s
    while (got := tp_leases(d)) != want and time.monotonic() < deadline:
        time.sleep(0.1)   # a closed connection's lease goes a moment later
    assert got == want


def test_rollout_and_rank_death_of_tp_replicas(short_tmp, tmp_path):
    model = servable_tiny_model(tmp_path / "m", "qwen2")
    d = daemon_helpers().start_daemon(short_tmp)
    env = serve_env(RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    log = tmp_path / "sup.log"
    sup = start_serve(model, log, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                      "--preload", "auto", "--socket", d.socket, "--device", "cpu", "--max-model-len", "128",
                      "--kv-cache-memory", "8MiB", "--drain-grace", "1", "--cpu-threads", "1", wait=True, env=env)
    try:
        port = int(sup.base_url.rsplit(":", 1)[1])
        ctl = control_socket_path(port, env)
        before = ready_replicas(ctl, 2)
        old_ranks = {r["pid"]: rank1_of(r["pid"]) for r in before}
        want = completion(sup.base_url)
        # Every group attached its two shards: rank 0 in the replica, rank 1 in its child.
        assert_leases(d, old_ranks)
        disk_before = metric(f"http://{d.http}", "resident_disk_read_bytes_total")

        load = LoadGenerator(LoadConfig(sup.base_url, MODEL_NAME, num_clients=4, max_tokens=8, think_s=0.1))
        load.start()
        time.sleep(1.0)
        t_roll = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "resident.cli.main", "rollout", "--port", str(port)],
                             env=env, capture_output=True, text=True, timeout=300)
        t_done = time.monotonic()
        time.sleep(1.0)
        load.stop(60)
        print(f"\nTP replicas rollout: {len(load.results)} requests, {len(load.window(t_roll, t_done))} during the "
              f"rollout ({t_done - t_roll:.1f} s), {len(load.failures())} failures")
        assert out.returncode == 0 and "rollout complete" in out.stdout, out.stdout + out.stderr
        failures = load.failures()
        assert not failures, f"{len(failures)} failed requests, e.g. {[r.error for r in failures[:3]]}"
        assert load.window(t_roll, t_done), "the load did not keep going through the rollout"

        after = ready_replicas(ctl, 2)
        new_ranks = {r["pid"]: rank1_of(r["pid"]) for r in after}
        assert not set(new_ranks) & set(old_ranks), "both groups were replaced"
        assert all(gone(pid) for pid in old_ranks.values()), "an old group's rank 1 outlived its rank 0"
        assert completion(sup.base_url) == want
        # The new groups attached the daemon's shards; nothing was read from disk again.
        assert metric(f"http://{d.http}", "resident_disk_read_bytes_total") == disk_before
        assert_leases(d, new_ranks)

        # kill -9 of one replica's rank 1: that replica exits (status 3), the supervisor replaces it.
        victim, victim_rank1 = next(iter(new_ranks.items()))
        os.kill(victim_rank1, signal.SIGKILL)
        assert gone(victim), "rank 0 kept running without its rank 1"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = {r["pid"] for r in ready_replicas(ctl, 2)}
            if victim not in pids:
                break
            time.sleep(0.1)
        assert victim not in pids and len(pids) == 2
        text = log.read_text()
        assert re.search(rf"tensor-parallel rank 1 \(pid {victim_rank1}\) exited", text), text[-3000:]
        assert re.search(rf"\(pid {victim}, serving\) exited unexpectedly with code {RANK_DIED_EXIT}; replacing",
                         text), text[-3000:]
        assert completion(sup.base_url) == want
    finally:
        stop_serve(sup)
        d.stop()


def test_the_launcher_refuses_tensor_parallel_replicas():
    serve = ServeConfig(model="m", preload="off", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--launcher cannot start tensor-parallel replicas"):
        SupervisorConfig(serve=serve, num_replicas=2, use_launcher=True)
    assert SupervisorConfig(serve=serve, num_replicas=2, num_standby=1).serve.tensor_parallel_size == 2


def two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.timeout(300)   # 4 worker processes, each compiling Triton kernels on a fresh machine (hit 90 s once)
@pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs")
def test_tp_replicas_on_two_gpus_roll_out_without_failures(short_tmp, tmp_path):
    """Two replicas x TP=2 on cuda:0 and cuda:1 (every replica's rank r on cuda:r, each GPU's
    KV cut into the supervisor's slices): a rollout under load fails no request and the
    greedy answer stays the same."""
    model = servable_tiny_model(tmp_path / "m", "qwen2")
    d = daemon_helpers().start_daemon(short_tmp, "--backend", "cuda_vmm")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RESIDENT_RUNTIME_DIR=str(short_tmp / "rt"))
    env.pop("RESIDENT_SOCKET", None)
    sup = start_serve(model, tmp_path / "sup.log", "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                      "--preload", "require", "--socket", d.socket, "--device", "cuda:0", "--max-model-len", "256",
                      "--gpu-memory-utilization", "0.3", "--drain-grace", "1", wait=True, env=env)
    try:
        port = int(sup.base_url.rsplit(":", 1)[1])
        ctl = control_socket_path(port, env)
        ready_replicas(ctl, 2)
        want = completion(sup.base_url)
        load = LoadGenerator(LoadConfig(sup.base_url, MODEL_NAME, num_clients=8, max_tokens=8, think_s=0.05))
        load.start()
        out = subprocess.run([sys.executable, "-m", "resident.cli.main", "rollout", "--port", str(port)],
                             env=env, capture_output=True, text=True, timeout=300)
        load.stop(60)
        assert out.returncode == 0 and "rollout complete" in out.stdout, (
            f"{out.stdout}{out.stderr}\n--- supervisor log:\n{sup.log_path.read_text()[-6000:]}")
        assert not load.failures()
        ready_replicas(ctl, 2)
        assert completion(sup.base_url) == want
    finally:
        stop_serve(sup)
        d.stop()

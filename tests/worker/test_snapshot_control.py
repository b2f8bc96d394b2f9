"""The worker's side of a snapshot, with a real daemon and a real `resident serve` (no CRIU):
prepare quiesces and detaches (no weight or KV pages mapped, the lease released, no gRPC
threads), resume re-attaches at the same addresses and serves the same greedy completion;
a running stream is waited for; a daemon that lost the model gives a clear error and the
worker stays detached until it can re-attach (or loads the model itself when asked)."""
from __future__ import annotations

import http.client as httpc
import json
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from serve_helpers import MODEL_NAME, daemon_helpers, http, serve_env, servable_tiny_model, start_serve, stop_serve

#: Several KV blocks long, so the prefix cache holds its blocks before a snapshot: after resume
#: those blocks hold zeros and must not be reused.
PROMPT = {"model": MODEL_NAME, "prompt": "Once upon a time, in a land far away, there lived a very small model " * 2,
          "max_tokens": 12, "temperature": 0, "ignore_eos": True}


class _UnixHTTP(httpc.HTTPConnection):
    def __init__(self, path: str, timeout_s: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def admin(path: str, method: str, route: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    conn = _UnixHTTP(path)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, route, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def maps_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/maps").read_text().splitlines()


def lines_over(pid: int, start: int, nbytes: int) -> list[str]:
    out = []
    for line in maps_of(pid):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < start + nbytes and start < hi:
            out.append(line)
    return out


def assert_placeholders(pid: int, ranges: list[dict[str, int]]) -> None:
    for r in ranges:
        lines = lines_over(pid, r["start"], r["nbytes"])
        assert lines, f"nothing reserved at 0x{r['start']:x}"
        for line in lines:
            fields = line.split()
            assert fields[1] == "---p" and len(fields) == 5, f"not a PROT_NONE anonymous placeholder: {line}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One daemon and one worker for the module (each test leaves it serving)."""
    run_dir = Path(tempfile.mkdtemp(prefix="snap", dir="/tmp"))   # Unix socket paths must stay short
    tmp = tmp_path_factory.mktemp("snapshot")
    model = servable_tiny_model(tmp / "llama", "llama")
    d = daemon_helpers().start_daemon(run_dir)
    w = None
    try:
        w = start_serve(model, tmp / "w.log", "--preload", "require", "--socket", d.socket,
                        env=serve_env(RESIDENT_RUNTIME_DIR=str(run_dir)))
        from resident.worker.snapshot_control import admin_socket_for_pid

        path = admin_socket_for_pid(w.proc.pid, {"RESIDENT_RUNTIME_DIR": str(run_dir)})
        yield {"daemon": d, "worker": w, "admin": path, "model": model, "tmp": tmp, "run_dir": run_dir}
    finally:
        if w is not None:
            stop_serve(w)
        d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _completion(base: str) -> str:
    status, body = http(base, "POST", "/v1/completions", PROMPT)
    assert status == 200, body
    return body["choices"][0]["text"]


def _leases(d) -> int:
    with d.client("probe") as c:
        return sum(len(m.leases) for m in c.status().models)


def _other_sessions(d, expect: int) -> int:
    """Daemon sessions besides this probe's own, once they are `expect` (the daemon notices a
    closed connection on its own schedule) or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        with d.client("probe") as c:
            n = c.status().num_sessions - 1
        if n == expect or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def _serving(s) -> None:
    status, state = admin(s["admin"], "GET", "/snapshot/state")
    assert status == 200 and state["state"] == "serving", state


def test_prepare_detaches_and_resume_serves_the_same_completion(setup):
    s = setup
    w, d, pid = s["worker"], s["daemon"], s["worker"].proc.pid
    _serving(s)
    before = _completion(w.base_url)
    assert _leases(d) == 1

    status, body = admin(s["admin"], "POST", "/snapshot/prepare", {"timeout_s": 10})
    assert status == 200, body
    m = body["manifest"]
    assert body["state"] == "detached" and m["pid"] == pid and m["backend"] == "host_shm" and m["device"] == "cpu"
    assert m["canary"]["prompt_token_ids"] and m["canary"]["token_id"] >= 0 and m["canary"]["logprob"] <= 0
    assert m["model_key"] and m["addresses"]["weights"] and m["addresses"]["kv"]
    assert not any(t.startswith(("event_engine", "grpc", "lifeguard")) for t in m["threads"]), m["threads"]
    # No weight or KV page is mapped: their ranges are PROT_NONE placeholders, no memfd is left.
    assert_placeholders(pid, m["addresses"]["weights"] + m["addresses"]["kv"])
    assert not [l for l in maps_of(pid) if "memfd:resident-slab" in l]
    assert _leases(d) == 0, "the lease must be released while detached"
    assert _other_sessions(d, 0) == 0, "the worker's daemon session must be closed while detached"
    # Not ready, and requests are refused with a reason, on both sockets.
    status, ready = http(w.base_url, "GET", "/ready")
    assert status == 503 and "snapshot" in ready["reason"]
    status, refused = http(w.base_url, "POST", "/v1/completions", PROMPT)
    assert status == 503 and "snapshot" in refused["error"]["message"]
    assert admin(s["admin"], "GET", "/ready")[0] == 503
    status, state = admin(s["admin"], "GET", "/snapshot/state")
    assert state["state"] == "detached" and state["manifest"]["model_key"] == m["model_key"]
    status, again = admin(s["admin"], "POST", "/snapshot/prepare", {})
    assert status == 409 and "detached" in again["error"]

    status, resumed = admin(s["admin"], "POST", "/snapshot/resume", {})
    assert status == 200, resumed
    assert resumed["state"] == "serving" and {"reattach_s", "kv_s", "canary_s"} <= set(resumed)
    assert resumed["canary"]["token_id"] == m["canary"]["token_id"]
    for r in m["addresses"]["weights"]:
        assert all("memfd:resident-slab" in l for l in lines_over(pid, r["start"], r["nbytes"]))
    for r in m["addresses"]["kv"]:
        assert all(l.split()[1] == "rw-p" for l in lines_over(pid, r["start"], r["nbytes"]))
    assert _leases(d) == 1 and _other_sessions(d, 1) == 1
    assert http(w.base_url, "GET", "/ready")[0] == 200
    assert _completion(w.base_url) == before
    status, again = admin(s["admin"], "POST", "/snapshot/resume", {})
    assert status == 409 and "not detached" in again["error"]


def _stream(base: str, max_tokens: int, first: threading.Event, result: dict) -> None:
    conn = httpc.HTTPConnection(base.removeprefix("http://"), timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**PROMPT, "max_tokens": max_tokens, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        result["status"] = resp.status
        chunks = []
        for line in resp:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                chunks.append(json.loads(line[6:]))
                first.set()
        result["chunks"] = chunks
    finally:
        first.set()
        conn.close()


def test_prepare_waits_for_a_running_stream_and_a_short_timeout_gives_up(setup):
    s = setup
    _serving(s)
    for timeout_s, expect in ((0.0, 409), (60.0, 200)):
        first, result = threading.Event(), {}
        t = threading.Thread(target=_stream, args=(s["worker"].base_url, 300, first, result))
        t.start()
        assert first.wait(60)
        status, body = admin(s["admin"], "POST", "/snapshot/prepare", {"timeout_s": timeout_s})
        t.join(120)
        assert status == expect, body
        chunks = result["chunks"]
        assert result["status"] == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert sum(1 for c in chunks if c["choices"][0]["text"] or c["choices"][0]["finish_reason"]) >= 1
        if expect == 409:
            assert "still running" in body["error"] and body["state"] == "serving"
            assert http(s["worker"].base_url, "GET", "/ready")[0] == 200
    assert admin(s["admin"], "POST", "/snapshot/resume", {})[0] == 200


def test_resume_after_the_daemon_unloaded_the_model_stays_detached_until_it_can(setup):
    s = setup
    w, d, pid = s["worker"], s["daemon"], s["worker"].proc.pid
    _serving(s)
    before = _completion(w.base_url)
    status, body = admin(s["admin"], "POST", "/snapshot/prepare", {"timeout_s": 10})
    assert status == 200, body
    m = body["manifest"]
    with d.client("probe") as c:
        assert c.unload(m["model_key"])
        assert not c.list()

    status, refused = admin(s["admin"], "POST", "/snapshot/resume", {})
    assert status == 409 and "no longer holds" in refused["error"] and "load_if_missing" in refused["error"]
    assert refused["state"] == "detached"
    assert_placeholders(pid, m["addresses"]["weights"] + m["addresses"]["kv"])   # nothing half-attached
    assert _leases(d) == 0 and http(w.base_url, "GET", "/ready")[0] == 503

    status, resumed = admin(s["admin"], "POST", "/snapshot/resume", {"load_if_missing": True})
    assert status == 200, resumed
    with d.client("probe") as c:
        assert [x.key for x in c.list()] == [m["model_key"]]
    assert _completion(w.base_url) == before


def test_a_supervised_replica_being_snapshotted_leaves_new_connections_to_the_other_one(setup):
    """Two replicas on one shared socket: while replica 0 is prepared (and detached) it takes no
    connection, so every request reaches replica 1 (none is answered 503); after resume it
    accepts again."""
    from resident.worker.control import control_socket_path, get_status

    s = setup
    env = serve_env(RESIDENT_RUNTIME_DIR=str(s["run_dir"]))
    sup = start_serve(s["model"], s["tmp"] / "sup.log", "--preload", "require", "--socket", s["daemon"].socket,
                      "--data-parallel-size", "2", "--max-model-len", "128", "--kv-cache-memory", "8MiB",
                      "--cpu-threads", "1", env=env)
    try:
        ctl = control_socket_path(int(sup.base_url.rsplit(":", 1)[1]), env)
        deadline = time.monotonic() + 60
        while True:
            replicas = get_status(ctl)["replicas"]
            if len(replicas) == 2 and all(r["phase"] == "ready" for r in replicas):
                break
            assert time.monotonic() < deadline, replicas
            time.sleep(0.05)
        path = replicas[0]["admin_socket"]
        status, body = admin(path, "POST", "/snapshot/prepare", {"timeout_s": 10})
        assert status == 200, body
        assert admin(path, "GET", "/status")[1]["accepting"] is False
        codes = [http(sup.base_url, "POST", "/v1/completions", {**PROMPT, "max_tokens": 1})[0] for _ in range(12)]
        assert codes == [200] * 12, f"a paused replica still took connections: {codes}"

        status, body = admin(path, "POST", "/snapshot/resume", {})
        assert status == 200, body
        assert admin(path, "GET", "/status")[1]["accepting"] is True
        assert http(sup.base_url, "POST", "/v1/completions", {**PROMPT, "max_tokens": 1})[0] == 200
        assert "not accepting connections on the shared socket" in sup.log_path.read_text()
    finally:
        stop_serve(sup)


def test_bad_bodies_are_refused(setup):
    s = setup
    _serving(s)
    assert admin(s["admin"], "POST", "/snapshot/prepare", raw=b"{not json")[0] == 400
    status, body = admin(s["admin"], "POST", "/snapshot/prepare", {"timeout_s": "soon"})
    assert status == 400 and "timeout_s" in body["error"]
    status, body = admin(s["admin"], "POST", "/snapshot/resume", {"load_if_missing": 1})
    assert status == 400 and "load_if_missing" in body["error"]
    _serving(s)


def test_a_worker_that_loaded_its_own_weights_refuses_to_detach(tmp_path):
    run_dir = Path(tempfile.mkdtemp(prefix="snap", dir="/tmp"))
    model = servable_tiny_model(tmp_path / "llama", "llama")
    path = str(run_dir / "admin.sock")
    w = start_serve(model, tmp_path / "w.log", "--preload", "off", "--admin-socket", path)
    try:
        status, body = admin(path, "POST", "/snapshot/prepare", {"timeout_s": 1})
        assert status == 409 and "--preload require" in body["error"] and body["state"] == "serving"
        assert http(w.base_url, "GET", "/ready")[0] == 200
        assert admin(path, "GET", "/ready")[0] == 200
    finally:
        stop_serve(w)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_canary_replay_tolerance_and_admin_socket_path(monkeypatch):
    from resident.worker.snapshot_canary import CANARY_TOLERANCE, Canary
    from resident.worker.snapshot_control import admin_socket_for_pid

    recorded = Canary("p", (1, 2), token_id=7, logprob=-1.25)
    assert recorded.mismatch(Canary("p", (1, 2), 7, -1.25 + 5e-5), CANARY_TOLERANCE["cpu"]) is None
    assert "logprob" in recorded.mismatch(Canary("p", (1, 2), 7, -1.26), CANARY_TOLERANCE["cpu"])
    assert "greedy token 8" in recorded.mismatch(Canary("p", (1, 2), 8, -1.25), CANARY_TOLERANCE["cuda"])
    assert admin_socket_for_pid(42, {"RESIDENT_RUNTIME_DIR": "/x/run"}) == "/x/run/worker-42.sock"
    with pytest.raises(ValueError, match="positive"):
        admin_socket_for_pid(0, {})


# --- on a GPU: captured graphs over re-mapped weights and KV ----------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_runner_decodes_the_same_through_graphs_after_detach_and_remap(tiny_model):
    from resident.daemon.loader import LoadSpec, load
    from resident.daemon.memory.cuda_vmm import CudaVmmBackend
    from resident.worker.config import ModelConfig
    from resident.worker.engine import LLMEngine
    from resident.worker.engine_config import EngineConfig
    from resident.worker.model_runner import ModelRunner
    from resident.worker.sampling_params import SamplingParams

    path = tiny_model("llama")
    loaded = load(LoadSpec(model=str(path)), CudaVmmBackend(device=0))
    descs, fds = [sl.desc for sl in loaded.slabs], [sl.export_fd() for sl in loaded.slabs]
    mapping = CudaVmmBackend.map_slabs(descs, fds)
    weights = loaded.table.views(mapping.tensors)
    (start, nbytes), = mapping.ranges()
    assert all(start <= t.data_ptr() < start + nbytes for t in weights.values())
    mc = ModelConfig.from_hf(loaded.config)
    config = EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
                          max_model_len=256)
    runner = ModelRunner(mc, config, weights, device="cuda", cuda_graphs="eager")
    runner.warmup()
    runner.capture_graphs()

    def decode() -> list[int]:
        engine = LLMEngine(config, runner)
        engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        out: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                out += o.new_token_ids
        return out

    before = decode()
    kv_ptrs = [t.data_ptr() for t in runner.kv_cache.tensors]
    mapping.unmap()
    runner.kv_cache.unmap()
    mapping.remap(descs, fds)
    runner.kv_cache.remap()
    assert mapping.ranges() == [(start, nbytes)] and [t.data_ptr() for t in runner.kv_cache.tensors] == kv_ptrs
    assert decode() == before
    runner.close()
    for sl in loaded.slabs:
        sl.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_worker_detaches_from_a_cuda_vmm_daemon_and_resumes(tmp_path):
    run_dir = Path(tempfile.mkdtemp(prefix="snap", dir="/tmp"))
    model = servable_tiny_model(tmp_path / "llama", "llama")
    d = daemon_helpers().start_daemon(run_dir, "--backend", "cuda_vmm", env={"CUDA_VISIBLE_DEVICES": "0"})
    path = str(run_dir / "admin.sock")
    w = start_serve(model, tmp_path / "w.log", "--preload", "require", "--socket", d.socket, "--device", "cuda",
                    "--kv-cache-initial", "0", "--admin-socket", path, env=serve_env(CUDA_VISIBLE_DEVICES="0"))
    try:
        before = _completion(w.base_url)
        status, body = admin(path, "POST", "/snapshot/prepare", {"timeout_s": 10})
        assert status == 200, body
        m = body["manifest"]
        assert m["backend"] == "cuda_vmm" and m["device"].startswith("cuda") and m["device_uuid"].startswith("GPU-")
        assert _leases(d) == 0
        status, resumed = admin(path, "POST", "/snapshot/resume", {})
        assert status == 200, resumed
        assert _completion(w.base_url) == before   # captured decode graphs over the re-mapped weights and KV
        assert _leases(d) == 1
    finally:
        stop_serve(w)
        d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)

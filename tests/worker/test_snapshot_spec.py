"""Snapshot prepare/resume of a worker that speculates, with a real daemon and a real
`resident serve` (no CRIU): with a draft paired with its target in the daemon, prepare
leaves no weight page (the draft's included: same slabs) and no KV page of either model
mapped; resume maps both back at the same addresses and the worker serves the same greedy
completion with speculation still on (drafts proposed and accepted, counted in the response
and in /metrics). Prompt lookup (no draft weights, no draft KV) likewise."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from serve_helpers import MODEL_NAME, daemon_helpers, http, metric, serve_env, servable_tiny_model, start_serve, \
    stop_serve
from test_snapshot_control import admin, assert_placeholders, lines_over, maps_of

#: Repetitive, so prompt lookup finds proposals too; several KV blocks long.
PROMPT = {"model": MODEL_NAME, "prompt": "one two three four five six seven eight " * 4,
          "max_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    run_dir = Path(tempfile.mkdtemp(prefix="snsp", dir="/tmp"))   # Unix socket paths must stay short
    tmp = tmp_path_factory.mktemp("snapshot-spec")
    target = servable_tiny_model(tmp / "target", "llama", init_std=0.3)
    draft = tmp / "draft"   # the target's weights in another folder: a draft that agrees with it
    shutil.copytree(target, draft)
    d = daemon_helpers().start_daemon(run_dir)
    try:
        yield {"daemon": d, "run_dir": run_dir, "tmp": tmp, "target": target, "draft": draft}
    finally:
        d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _completion(base: str) -> tuple[str, dict]:
    status, body = http(base, "POST", "/v1/completions", PROMPT)
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["speculative_decoding"]


def _metric_reaches(base: str, name: str, want: float) -> bool:
    """The engine thread publishes a step's counters after the response may have gone out."""
    deadline = time.monotonic() + 10
    while (got := metric(base, name)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == want, f"{name} = {got}, expected {want}"
    return True


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculating_worker_detaches_and_resumes_with_speculation_on(daemon, method: str) -> None:
    s = daemon
    spec_args = (["--speculative-model", str(s["draft"])] if method == "draft" else
                 ["--speculative-model", "[ngram]", "--ngram-prompt-lookup-max", "3"])
    w = start_serve(s["target"], s["tmp"] / f"w-{method}.log", "--preload", "require", "--socket", s["daemon"].socket,
                    "--max-model-len", "256", *spec_args, "--num-speculative-tokens", "3",
                    env=serve_env(RESIDENT_RUNTIME_DIR=str(s["run_dir"])))
    try:
        from resident.worker.snapshot_control import admin_socket_for_pid

        pid = w.proc.pid
        path = admin_socket_for_pid(pid, {"RESIDENT_RUNTIME_DIR": str(s["run_dir"])})
        before, spec_before = _completion(w.base_url)
        assert spec_before["num_proposed"] > 0, spec_before   # a random tiny model rarely follows the n-grams
        if method == "draft":   # one attach: the daemon holds the pair as one model
            with s["daemon"].client("probe") as c:
                assert [m.draft_key != "" for m in c.status().models] == [True]

        status, body = admin(path, "POST", "/snapshot/prepare", {"timeout_s": 10})
        assert status == 200, body
        m = body["manifest"]
        kv = m["addresses"]["kv"]
        assert len(kv) == (2 if method == "draft" else 1), kv   # the draft's KV cache is a range of its own
        assert m["speculative"]["method"] == method and m["speculative"]["num_speculative_tokens"] == 3
        assert (m["speculative"]["draft_key"] is not None) == (method == "draft")
        assert_placeholders(pid, m["addresses"]["weights"] + kv)
        assert not [line for line in maps_of(pid) if "memfd:resident-slab" in line]
        assert http(w.base_url, "POST", "/v1/completions", PROMPT)[0] == 503

        status, resumed = admin(path, "POST", "/snapshot/resume", {})
        assert status == 200, resumed
        assert resumed["canary"]["token_id"] == m["canary"]["token_id"]
        for r in kv:
            assert all(line.split()[1] == "rw-p" for line in lines_over(pid, r["start"], r["nbytes"]))
        proposed = metric(w.base_url, "resident_worker_spec_proposed_tokens_total")
        accepted = metric(w.base_url, "resident_worker_spec_accepted_tokens_total")
        after, spec_after = _completion(w.base_url)
        assert after == before
        # Speculation still runs (and, for the draft = target pair, is accepted as before: its
        # KV cache came back zeroed with the prefix cache forgotten, not stale).
        assert spec_after == spec_before
        if method == "draft":
            assert spec_after["acceptance_rate"] >= 0.9 and spec_before["acceptance_rate"] >= 0.9
        assert _metric_reaches(w.base_url, "resident_worker_spec_proposed_tokens_total",
                               proposed + spec_after["num_proposed"])
        assert _metric_reaches(w.base_url, "resident_worker_spec_accepted_tokens_total",
                               accepted + spec_after["num_accepted"])
    finally:
        stop_serve(w)


@pytest.mark.gpu
def test_gpu_speculating_worker_detaches_from_a_cuda_vmm_daemon_and_resumes(tmp_path) -> None:
    """cuda_vmm weights (the draft's in the same slabs) and both VMM KV ranges released and
    re-mapped; the draft's captured decode graphs replay over the re-mapped memory."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_dir = Path(tempfile.mkdtemp(prefix="snsp", dir="/tmp"))
    target = servable_tiny_model(tmp_path / "target", "llama", init_std=0.3)
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    d = daemon_helpers().start_daemon(run_dir, "--backend", "cuda_vmm", env={"CUDA_VISIBLE_DEVICES": "0"})
    path = str(run_dir / "admin.sock")
    w = None
    try:
        w = start_serve(target, tmp_path / "w.log", "--preload", "require", "--socket", d.socket, "--device", "cuda",
                        "--kv-cache-initial", "0", "--admin-socket", path, "--speculative-model", str(draft),
                        "--num-speculative-tokens", "3", env=serve_env(CUDA_VISIBLE_DEVICES="0"))
        before, spec_before = _completion(w.base_url)
        status, body = admin(path, "POST", "/snapshot/prepare", {"timeout_s": 10})
        assert status == 200, body
        m = body["manifest"]
        assert m["backend"] == "cuda_vmm" and len(m["addresses"]["kv"]) == 2 and m["speculative"]["draft_key"]
        status, resumed = admin(path, "POST", "/snapshot/resume", {})
        assert status == 200, resumed
        after, spec_after = _completion(w.base_url)
        assert after == before and spec_after["num_accepted"] > 0
        assert spec_after["acceptance_rate"] >= 0.9
    finally:
        if w is not None:
            stop_serve(w)
        d.stop()
        shutil.rmtree(run_dir, ignore_errors=True)

"""tp_spawn: the other tensor-parallel ranks started before rank 0's imports (no torch)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from resident.worker import tp_spawn


@pytest.mark.parametrize(("device", "want"), [
    ("cpu", ["cpu", "cpu"]), ("cuda", ["cuda:0", "cuda:1"]), ("cuda:2", ["cuda:2", "cuda:3"]), ("npu", None)])
def test_early_devices(device, want):
    assert tp_spawn.early_devices(device, 2) == want


def test_auto_guesses_from_the_driver_and_visible_devices(monkeypatch):
    monkeypatch.setattr(tp_spawn.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert tp_spawn.early_devices("auto", 2) == ["cuda:0", "cuda:1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert tp_spawn.early_devices("auto", 2) == ["cpu", "cpu"]
    monkeypatch.setattr(tp_spawn.os.path, "exists", lambda p: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert tp_spawn.early_devices("auto", 2) == ["cpu", "cpu"]


def _config(**kw):
    base = dict(tensor_parallel_size=2, device="cpu", model="/m", served_model_name="m", dtype="auto",
                quantization="none", revision=None, hub_cache=None, speculative=None, preload="off", socket=None,
                verify_sample=16, cpu_threads=1, kv_profile_cache="off")
    return SimpleNamespace(**{**base, **kw})


def test_the_module_imports_no_torch():
    code = "import sys, resident.worker.tp_spawn; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_take_early_adopts_matching_ranks_and_stops_others(monkeypatch):
    """A mismatch (other devices or another spec) stops the early children; a match hands them over once."""
    started = []

    class FakeProc:
        def __init__(self, cmd, pass_fds):
            self.cmd, self.waited = cmd, False
            started.append(self)

        def wait(self, timeout=None):
            self.waited = True
            return 0

    monkeypatch.setattr(tp_spawn.subprocess, "Popen", FakeProc)
    assert tp_spawn.spawn_early(_config(tensor_parallel_size=1)) is None
    early = tp_spawn.spawn_early(_config())
    assert early is not None and len(early.procs) == 1 and early.port > 0
    assert '"store_port": %d' % early.port in started[0].cmd[-1]
    assert tp_spawn.take_early(["cpu", "cpu"], lambda spec: spec["model"] == "/m") is early
    assert tp_spawn.take_early(["cpu", "cpu"], lambda spec: True) is None   # taken already
    early.abort()

    tp_spawn.spawn_early(_config())
    assert tp_spawn.take_early(["cuda:0", "cuda:1"], lambda spec: True) is None
    assert started[-1].waited   # stopped: its lifeline closed


def test_ranks_never_adopted_are_stopped_when_rank_0_exits():
    """Rank 0 failing before TPGroup adopted the early ranks (`--tensor-parallel-size 7` of a
    9-head model) left them to the lifeline, and those that had reached the rendezvous printed
    torch's TCPStore errors (200 lines of C++ frames) after rank 0's one line saying why."""
    config = json.dumps(vars(_config(tensor_parallel_size=3)))
    code = f"""
import json, subprocess, sys, types
from resident.worker import tp_spawn
real = subprocess.Popen
# A child that neither watches the lifeline nor dies with it: only a kill stops it.
tp_spawn.subprocess.Popen = lambda cmd, pass_fds: real([sys.executable, "-c", "import time; time.sleep(60)"])
early = tp_spawn.spawn_early(types.SimpleNamespace(**json.loads({config!r})))
print(" ".join(str(p.pid) for p in early.procs), flush=True)
sys.exit(1)   # as `resident serve` does when it cannot start
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    for pid in pids:   # reaped by rank 0 before it exited: gone, not merely orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_spec_fields_build_the_load_spec():
    from resident.daemon.loader import LoadSpec

    spec = LoadSpec(**tp_spawn.spec_fields(_config(speculative=SimpleNamespace(draft_model="/d"))))
    assert spec.model == "/m" and spec.draft == "/d" and spec.tensor_parallel_size == 1


def test_ranks_get_rank_0s_triton_caches(tmp_path, monkeypatch):
    """A child rank's Triton prefetch reads the compile-cache key and the kernel
    specializations rank 0's configuration recorded (tp_rank._start_triton_prefetch)."""
    from resident.worker.serve_config import ServeConfig
    from resident.worker.tp_spawn import RankLaunch, startup_caches
    from resident.worker.triton_specializations import source_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = ServeConfig(model=str(tmp_path), preload="off", tensor_parallel_size=2)
    caches = startup_caches(config)
    assert caches["triton_key_cache"].endswith("triton-key.json")
    cache, key = source_for(config)
    assert caches["specializations"] == [str(cache.path), key]
    launch = RankLaunch(rank=1, size=2, store_port=1, devices=["cuda:0", "cuda:1"], spec={}, preload="off",
                        socket=None, verify_sample=0, cpu_threads=None, **caches)
    assert RankLaunch(**json.loads(json.dumps(dataclasses.asdict(launch)))) == launch   # the command line's JSON
    assert startup_caches(ServeConfig(model=str(tmp_path), preload="off", kv_profile_cache="off")) == \
        {"triton_key_cache": None, "specializations": None}

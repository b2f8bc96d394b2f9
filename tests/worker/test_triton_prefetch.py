"""Triton's once-per-process start-up work done in a background thread (worker/triton_prefetch.py).

Each case runs in its own interpreter: what is asserted is what lands in Triton's
process-wide caches (and which modules get imported), so the process must start clean.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from resident.worker.triton_prefetch import start_triton_prefetch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _run(code: str, hide_gpu: bool = True) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_nothing_starts_for_a_cpu_worker() -> None:
    assert start_triton_prefetch("cpu", None) is None


@needs_triton
def test_the_libtriton_hash_lands_in_tritons_own_cache() -> None:
    # Stage 1 needs no GPU: the compile cache's key (triton_key, a hash of libtriton.so) is
    # computed in the thread and Triton's lru_cache keeps it; a CPU worker then stops.
    out = _run("""
from resident.worker.triton_prefetch import TritonPrefetch
p = TritonPrefetch().start()
p.set_device(None)
ok = p.join()
from triton.runtime.cache import triton_key
print(ok, triton_key.cache_info().currsize, sorted(p.seconds), p.skipped)
""")
    assert out.split()[:2] == ["True", "1"], out
    assert "'libtriton hash'" in out and "does not compute on a GPU" in out, out


@needs_triton
def test_no_gpu_means_no_triton_import() -> None:
    # --device auto on a host without a GPU: the CUDA pre-creation's verdict stops the thread
    # before it imports anything.
    out = _run("""
import sys
from resident.worker.triton_prefetch import start_triton_prefetch
p = start_triton_prefetch("auto", lambda: False)
p.set_device(None)
print(p.join(), "triton" in sys.modules, p.skipped)
""")
    assert out.startswith("True False no GPU"), out


@needs_triton
def test_without_a_context_made_in_advance_the_resolved_device_decides() -> None:
    # --device auto on a GPU host without cuda-python: no pre-created context, but the device
    # the main thread resolves is a GPU, so the work runs (stage 2 then fails here: no driver).
    out = _run("""
from resident.worker.triton_prefetch import start_triton_prefetch
p = start_triton_prefetch("auto", lambda: False)
p.set_device((9, 0))
p.join()
print(sorted(p.seconds), p.skipped)
""")
    assert "libtriton hash" in out and "kernels" in out and out.strip().endswith("None"), out


@needs_triton
def test_an_explicit_gpu_device_does_not_wait_for_the_verdict() -> None:
    out = _run("""
from resident.worker.triton_prefetch import start_triton_prefetch
p = start_triton_prefetch("cuda:1", lambda: False)
p.set_device(None)
p.join()
print(sorted(p.seconds))
""")
    assert "libtriton hash" in out, out


@needs_triton
def test_a_failing_step_is_recorded_never_raised() -> None:
    # With no GPU visible Triton has no active driver: stage 2 imports the kernels and computes
    # their JIT cache keys, then fails at the driver; the worker goes on (the first launch
    # would do that work), and the log says so.
    out = _run("""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from resident.worker.triton_prefetch import TritonPrefetch
p = TritonPrefetch().start()
p.set_device((9, 0))
print("joined", p.join(), p.error is not None and p.error.startswith("driver:"))
from triton.runtime.jit import JITFunction
fns = [v for n, m in list(sys.modules.items()) if n.startswith("resident.worker.kernels.")
       for v in vars(m).values() if isinstance(v, JITFunction)]
print("keys", len(fns) > 0 and all(f.hash is not None for f in fns))
""")
    assert "joined False True" in out and "keys True" in out, out
    assert "the first kernel launches do it" in out, out


@pytest.mark.gpu
def test_prefetched_work_serves_the_first_kernel_launch() -> None:
    out = _run("""
import torch
from resident.worker.triton_prefetch import TritonPrefetch
p = TritonPrefetch().start()
torch.zeros(1, device="cuda")
p.set_device(torch.cuda.get_device_capability(0))
assert p.join(), p.describe()
from triton.backends.nvidia.compiler import get_ptxas_version
from triton.runtime.cache import triton_key
from triton.runtime.driver import driver
assert triton_key.cache_info().currsize == 1 and get_ptxas_version.cache_info().currsize == 1
assert driver._active is not None
from resident.worker.kernels.dispatch import get_kernels
from resident.worker.layers.norm import rms_norm
x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
out = get_kernels("cuda", "triton").rms_norm(x, w, 1e-5)
torch.testing.assert_close(out, rms_norm(x, w, 1e-5), atol=2e-2, rtol=2e-2)
print("ok", p.describe())
""", hide_gpu=False)
    assert out.startswith("ok"), out

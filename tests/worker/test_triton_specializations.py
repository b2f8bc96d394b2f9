"""Triton kernel specializations recorded at one start and preloaded at the next (worker/triton_specializations.py).

On CPU: the cache file, the configuration key, the hook's recording and chaining, stale
entries skipped. On a GPU (marked): a real record in one process and a preload in the next
leave the warm-up nothing to load.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from resident.worker import triton_specializations as ts
from resident.worker.serve_config import ServeConfig

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _entry(i: int, function: str = "resident.worker.kernels.rmsnorm._rms_norm_kernel") -> ts.Specialization:
    return ts.Specialization(function, f"key{i}", json.dumps({"name": function, "i": i}))


def test_cache_round_trip_per_configuration(tmp_path) -> None:
    cache = ts.SpecializationCache(tmp_path / "sub" / ts.FILE_NAME)
    assert cache.load("a") == []
    cache.store("a", [_entry(1), _entry(2), _entry(1)])
    cache.store("b", [_entry(3)])
    assert cache.load("a") == [_entry(1), _entry(2)]   # duplicates dropped, order kept
    assert cache.load("b") == [_entry(3)]
    cache.store("a", [_entry(4)])
    assert cache.load("a") == [_entry(4)]


def test_cache_keeps_the_latest_configurations(tmp_path) -> None:
    cache = ts.SpecializationCache(tmp_path / ts.FILE_NAME)
    for i in range(ts.MAX_CONFIGS + 3):
        cache.store(f"k{i}", [_entry(i)])
    assert cache.load("k0") == [] and cache.load("k2") == []
    assert cache.load(f"k{ts.MAX_CONFIGS + 2}") == [_entry(ts.MAX_CONFIGS + 2)]


@pytest.mark.parametrize("content", ["not json", '{"format": 99, "configs": {}}', '[1, 2]',
                                     '{"format": 1, "configs": {"a": [{"function": "f"}]}}'])
def test_unreadable_content_reads_as_empty(tmp_path, content) -> None:
    path = tmp_path / ts.FILE_NAME
    path.write_text(content)
    assert ts.SpecializationCache(path).load("a") == []


def test_the_cache_lives_beside_the_kv_profile_cache_and_follows_its_switch(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = ServeConfig(model="m", preload="off")
    cache, key = ts.source_for(config)
    assert cache.path == tmp_path / "resident" / ts.FILE_NAME
    assert ts.source_for(replace(config, kv_profile_cache="off")) is None
    # What decides the specializations loaded before /ready is in the key.
    for change in ({"block_size": 32}, {"max_num_seqs": 8}, {"cuda_graphs": "eager"}, {"dtype": "float16"},
                   {"max_num_batched_tokens": 1024}, {"model": "other"}):
        assert ts.source_for(replace(config, **change))[1] != key, change


def test_nothing_is_recorded_without_a_key() -> None:
    with ts.recording(None) as found:
        assert found is None
    with ts.recording(SimpleNamespace(specialization_key=None)) as found:
        assert found is None
    ts.store_loaded(None, [])   # no-op


@needs_triton
def test_the_hook_records_our_kernels_and_chains_the_previous_one() -> None:
    from triton import knobs

    calls = []
    previous = knobs.runtime.jit_post_compile_hook

    def earlier(**kwargs):
        calls.append(kwargs["key"])

    knobs.runtime.jit_post_compile_hook = earlier
    try:
        ours = SimpleNamespace(jit_function=SimpleNamespace(cache_key="ck"))
        with ts.record() as found:
            hook = knobs.runtime.jit_post_compile_hook
            for name, warmup in (("resident.worker.kernels.rmsnorm._rms_norm_kernel", False),
                                 ("resident.worker.kernels.rmsnorm._rms_norm_kernel", True),
                                 ("someone.else.kernel", False)):
                data = json.dumps({"name": name})
                hook(key=name, repr="", fn=ours, compile={"specialization_data": data}, is_manual_warmup=warmup,
                     already_compiled=False)
            hook(key="broken", repr="", fn=ours, compile={}, is_manual_warmup=False, already_compiled=False)
        assert knobs.runtime.jit_post_compile_hook is earlier
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert [f.function for f in found] == ["resident.worker.kernels.rmsnorm._rms_norm_kernel"]
    assert found[0].cache_key == "ck"
    assert len(calls) == 4


@needs_triton
def test_stale_entries_are_skipped_not_raised() -> None:
    importlib.import_module("resident.worker.kernels.rmsnorm")   # a kernel module with a JIT function

    result = ts.preload([_entry(1, "resident.worker.kernels.gone._kernel"), _entry(2)], device_index=0)
    assert (result.loaded, result.num_stale, result.num_failed) == ([], 2, 0)


def test_store_loaded_writes_only_what_changed(tmp_path) -> None:
    cache = ts.SpecializationCache(tmp_path / ts.FILE_NAME)
    prefetch = SimpleNamespace(specialization_key="k", specialization_cache=cache, cached=[],
                               preloaded=None)
    ts.store_loaded(prefetch, [_entry(1)])
    assert cache.load("k") == [_entry(1)]
    prefetch.cached = [_entry(1)]
    prefetch.preloaded = ts.PreloadResult([_entry(1)])
    mtime = cache.path.stat().st_mtime_ns
    ts.store_loaded(prefetch, [])
    assert cache.path.stat().st_mtime_ns == mtime
    ts.store_loaded(prefetch, [_entry(2)])
    assert cache.load("k") == [_entry(1), _entry(2)]


_GPU_START = r"""
import json
import torch
from resident.worker.triton_prefetch import TritonPrefetch
from resident.worker import triton_specializations as ts
from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner
p = TritonPrefetch().start()
torch.zeros(1, device="cuda")
p.set_device(torch.cuda.get_device_capability(0), 0, (ts.SpecializationCache({path!r}), "tiny"))
assert p.join(), p.describe()
from resident.worker.weight_store import LocalStore
from resident.daemon.loader import LoadSpec
store = LocalStore(LoadSpec(model={model!r}, dtype="bfloat16"), device="cuda:0")
cfg = ModelConfig.from_hf(store.config)
ec = EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
runner = ModelRunner(cfg, ec, store.tensors, device="cuda:0", cuda_graphs="eager")
with ts.recording(p) as recorded:
    runner.warmup()
    runner.capture_graphs()
ts.store_loaded(p, recorded)
print(json.dumps({{"recorded": len(recorded), "preloaded": p.preloaded.describe() if p.preloaded else None}}))
"""


@pytest.mark.gpu
def test_a_second_start_preloads_everything_the_warm_up_needs(tmp_path) -> None:
    from fixtures_models import make_tiny_model

    model = make_tiny_model(tmp_path / "m", "llama")
    code = _GPU_START.format(path=str(tmp_path / ts.FILE_NAME), model=str(model))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ))
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["recorded"] > 0 and runs[0]["preloaded"] is None, runs
    # The second start loaded every specialization in the background: the warm-up loaded none.
    assert runs[1]["recorded"] == 0, runs
    assert runs[1]["preloaded"].startswith(f"{runs[0]['recorded']} loaded, 0 stale, 0 failed"), runs

"""The KV profile cache: a restart with the same configuration skips the probe runner and
the profile forward; anything that changes the activation memory measures again; a broken
cache file never stops a worker.

CPU tests drive `decide_headroom` (the same decision `plan_gpu_kv_cache` makes) with a fake
profiler that counts its calls; the GPU tests run the real planner and `resident serve`.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from resident.worker.config import ModelConfig
from resident.worker.kv_profile_cache import (
    HeadroomKey,
    KvProfileCache,
    decide_headroom,
    headroom_key,
    resolve_cache_path,
)

MiB = 2**20


class FakeProfiler:
    def __init__(self, headroom: int = 700 * MiB) -> None:
        self.headroom = headroom
        self.calls = 0

    def __call__(self) -> tuple[int, dict[str, float]]:
        self.calls += 1
        return self.headroom, {"probe_build": 0.5, "profile_forward": 1.0}


def _config() -> ModelConfig:
    return ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                                    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512))


def _key(**changes) -> HeadroomKey:
    mc = _config()
    weights = {"model.embed_tokens.weight": torch.empty(2, 2, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.empty(2, 2, dtype=torch.bfloat16)}
    key = headroom_key(mc, weights, block_size=16, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=2048,
                       cuda_graphs="lazy", gpu_name="NVIDIA H200")
    return replace(key, **changes)


def test_second_start_reads_the_headroom_and_runs_no_profile(tmp_path, caplog) -> None:
    cache, key, prof = KvProfileCache(tmp_path / "kv-profile.json"), _key(), FakeProfiler()
    caplog.set_level(logging.INFO, logger="resident.worker.kv_profile_cache")
    first = decide_headroom(key, cache, prof)
    assert (first.headroom_bytes, first.source, prof.calls) == (700 * MiB, "measured", 1)
    assert first.timings == {"probe_build": 0.5, "profile_forward": 1.0}
    assert "stored in" in caplog.text
    # A new process: a fresh cache object over the same file, and a profiler that must not run.
    again = decide_headroom(key, KvProfileCache(tmp_path / "kv-profile.json"), FakeProfiler(1))
    assert (again.headroom_bytes, again.source) == (700 * MiB, "cached")
    assert set(again.timings) == {"cache_lookup"}
    assert "from the KV profile cache" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["kv-profile.json"], "a temporary file was left behind"


@pytest.mark.parametrize("change", [
    {"max_num_batched_tokens": 4096}, {"max_num_seqs": 128}, {"max_model_len": 4096}, {"block_size": 32},
    {"cuda_graphs": "eager"}, {"gpu_name": "NVIDIA H100 80GB HBM3"}, {"quantization": "fp8_per_tensor"},
    {"weight_dtypes": ("float16",)}, {"kernel_backend": "torch"}, {"tensor_parallel_size": 2},
    {"versions": (("resident", "0.2.0"), ("torch", "2.11.0"), ("triton", "3.6.0"))},
])
def test_a_change_that_affects_activation_memory_measures_again(tmp_path, change) -> None:
    cache = KvProfileCache(tmp_path / "c.json")
    decide_headroom(_key(), cache, FakeProfiler(500 * MiB))
    prof = FakeProfiler(900 * MiB)
    got = decide_headroom(_key(**change), cache, prof)
    assert (got.headroom_bytes, got.source, prof.calls) == (900 * MiB, "measured", 1)
    # Both entries are kept: switching back is a hit again.
    assert decide_headroom(_key(), cache, FakeProfiler(1)).headroom_bytes == 500 * MiB


def test_a_different_architecture_is_a_different_key() -> None:
    mc = _config()
    wider = replace(mc, intermediate_size=mc.intermediate_size * 2)
    w = {"model.embed_tokens.weight": torch.empty(1, dtype=torch.bfloat16)}
    kw = dict(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, cuda_graphs="lazy",
              gpu_name="g")
    assert headroom_key(mc, w, **kw).digest() != headroom_key(wider, w, **kw).digest()
    assert headroom_key(mc, w, **kw).digest() == headroom_key(replace(mc), w, **kw).digest()


def test_fp8_weights_are_part_of_the_key() -> None:
    mc = _config()
    kw = dict(block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, cuda_graphs="lazy",
              gpu_name="g")
    fp8 = {"a.weight": torch.empty(1, dtype=torch.float8_e4m3fn), "a.weight_scale": torch.ones(())}
    key = headroom_key(mc, fp8, **kw)
    assert key.quantization == "fp8_per_tensor" and key.weight_dtypes == ("float32", "float8_e4m3fn")


@pytest.mark.parametrize("content", ["{not json", '{"version": 99, "entries": {}}', '["a list"]',
                                     '{"version": 1, "entries": []}', ""])
def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content) -> None:
    path = tmp_path / "kv-profile.json"
    path.write_text(content)
    key, prof = _key(), FakeProfiler()
    with caplog.at_level(logging.WARNING):
        got = decide_headroom(key, KvProfileCache(path), prof)
    assert got.source == "measured" and prof.calls == 1
    assert "corrupt" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text())["version"] == 1
    assert decide_headroom(key, KvProfileCache(path), FakeProfiler(1)).source == "cached"


@pytest.mark.parametrize("value", [0, -5, "700", 1 << 60, True, None])
def test_an_implausible_entry_is_measured_again(tmp_path, caplog, value) -> None:
    path, key = tmp_path / "c.json", _key()
    path.write_text(json.dumps({"version": 1, "entries": {key.digest(): {"headroom_bytes": value}}}))
    prof = FakeProfiler()
    with caplog.at_level(logging.WARNING):
        got = decide_headroom(key, KvProfileCache(path), prof)
    assert got.source == "measured" and prof.calls == 1 and "implausible" in caplog.text


def test_an_unwritable_cache_only_warns(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = KvProfileCache(blocker / "sub" / "kv-profile.json")   # its parent cannot be created
    prof = FakeProfiler()
    with caplog.at_level(logging.WARNING):
        first = decide_headroom(_key(), cache, prof)
        second = decide_headroom(_key(), cache, prof)
    assert (first.source, second.source, prof.calls) == ("measured", "measured", 2)
    assert "could not write the KV profile cache" in caplog.text


def test_cache_off_always_measures() -> None:
    prof = FakeProfiler()
    for _ in range(2):
        assert decide_headroom(_key(), None, prof).source == "measured (cache off)"
    assert prof.calls == 2


def test_the_file_keeps_the_most_recent_entries(tmp_path) -> None:
    cache = KvProfileCache(tmp_path / "c.json", max_entries=3)
    for tokens in (64, 128, 256, 512):
        decide_headroom(_key(max_num_batched_tokens=tokens), cache, FakeProfiler(tokens * MiB))
    entries = json.loads(cache.path.read_text())["entries"]
    assert sorted(e["key"]["max_num_batched_tokens"] for e in entries.values()) == [128, 256, 512]
    prof = FakeProfiler()
    decide_headroom(_key(max_num_batched_tokens=64), cache, prof)
    assert prof.calls == 1


def test_cache_path_follows_xdg_and_the_setting(tmp_path) -> None:
    assert resolve_cache_path("auto", {"XDG_CACHE_HOME": "/x/cache", "HOME": "/h"}) == \
        Path("/x/cache/resident/kv-profile.json")
    assert resolve_cache_path("auto", {"HOME": "/h"}) == Path("/h/.cache/resident/kv-profile.json")
    assert resolve_cache_path("off", {"XDG_CACHE_HOME": "/x"}) is None
    assert resolve_cache_path(str(tmp_path / "k.json"), {}) == tmp_path / "k.json"


def test_a_code_change_changes_the_fingerprint(tmp_path, monkeypatch) -> None:
    from resident.worker.kv_profile_cache import code_fingerprint

    pkg = tmp_path / "fp_pkg_probe"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layers" / "norm.py").write_text("EPS = 1e-6\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_fingerprint(("fp_pkg_probe",))
    assert code_fingerprint(("fp_pkg_probe",)) == before
    (pkg / "layers" / "norm.py").write_text("EPS = 1e-5  # a different layer\n")
    assert code_fingerprint(("fp_pkg_probe",)) != before
    assert dict(_key().versions)["resident-code"] == code_fingerprint()


def test_key_rejects_impossible_fields() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        _key(max_num_seqs=0)
    with pytest.raises(ValueError, match="GPU's name"):
        _key(gpu_name="")


# --- on a GPU: the real planner and `resident serve` -------------------------------------------
@pytest.mark.gpu
def test_gpu_plan_uses_the_cache_on_the_second_plan(tmp_path, tiny_model) -> None:
    from weights_util import fused_weights_from_hf_folder

    from resident.worker.gpu_kv_plan import plan_gpu_kv_cache

    path = tiny_model("llama3")
    mc = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = {k: v.cuda() for k, v in fused_weights_from_hf_folder(path).items()}
    cache = KvProfileCache(tmp_path / "kv-profile.json")
    kw = dict(block_size=16, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, utilization=0.5,
              cuda_graphs="lazy", headroom_cache=cache)
    first = plan_gpu_kv_cache(mc, weights, torch.device("cuda:0"), **kw)
    second = plan_gpu_kv_cache(mc, weights, torch.device("cuda:0"), **kw)
    assert (first.headroom_source, second.headroom_source) == ("measured", "cached")
    assert "probe_build" in first.timings and "probe_build" not in second.timings
    assert second.budget.headroom_bytes == first.budget.headroom_bytes


@pytest.mark.gpu
def test_gpu_serve_restart_reports_the_cached_headroom(tmp_path) -> None:
    from serve_helpers import servable_tiny_model, serve_env, start_serve, stop_serve

    model = servable_tiny_model(tmp_path / "llama", "llama")
    env = serve_env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    sources = []
    for i in range(2):
        log = tmp_path / f"serve{i}.log"
        proc = start_serve(model, log, "--preload", "off", "--device", "cuda", env=env)
        stop_serve(proc)
        m = re.search(r"kv_alloc breakdown: plan [0-9.]+ s, headroom ([a-z ()]+?) \(", log.read_text())
        assert m, log.read_text()[-3000:]
        sources.append(m.group(1))
    assert sources == ["measured", "cached"]
    assert os.path.exists(tmp_path / "xdg" / "resident" / "kv-profile.json")

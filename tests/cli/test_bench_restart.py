"""`resident bench checkpoint` writes a servable random-weight Llama folder; `resident bench
restart` measures HF transformers, a cold and a warm worker on it, writes JSON and a
picture, and records a failing variant instead of losing the others."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resident.cli import bench_plot
from resident.cli.bench_checkpoint import hf_config, place, tensor_shapes
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory.host_shm import HostShmBackend

CLI = [sys.executable, "-m", "resident.cli.main", "bench"]


def run(args, timeout=300):
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    return r


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "tiny"
    r = run(["checkpoint", str(out), "--shape", "tiny", "--device", "cpu"])
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_llama3_8b_shape_is_16_gb_in_four_shards():
    cfg = hf_config("llama3-8b", "bfloat16")
    placed = place(tensor_shapes(cfg), 2, 0)
    assert sum(p.nbytes for p in placed) == 16_060_522_496  # Llama-3-8B: 8.03 B parameters
    assert max(p.shard for p in placed) + 1 == 4
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (
        4096, 32, 32, 8, 14336, 128256, False)


def test_checkpoint_is_hf_readable_and_loads(tiny_ckpt, tmp_path):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    weights = load_file(str(tiny_ckpt / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert abs(weights["lm_head.weight"].float().std().item() - 0.02) < 0.002
    assert torch.equal(weights["model.norm.weight"], torch.ones(cfg["hidden_size"], dtype=torch.bfloat16))
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"])
    tok = json.loads((tiny_ckpt / "tokenizer.json").read_text())
    assert max(tok["model"]["vocab"].values()) < cfg["vocab_size"]
    m = load(LoadSpec(str(tiny_ckpt)), HostShmBackend())
    try:
        assert m.dtype == "bfloat16" and "model.layers.1.self_attn.qkv_proj.weight" in {e.name for e in m.table.entries}
    finally:
        for s in m.slabs:
            s.close()
    # sharded: index file, same tensors
    sharded = tmp_path / "sharded"
    r = run(["checkpoint", str(sharded), "--shape", "tiny", "--shards", "3", "--dtype", "float32"])
    assert r.returncode == 0, r.stderr
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) and len(set(index["weight_map"].values())) == 3
    r = run(["checkpoint", str(sharded), "--shape", "tiny"])
    assert r.returncode == 2 and "--force" in r.stderr


def test_restart_cold_and_warm_with_json_and_plot(tiny_ckpt, tmp_path):
    out, pic = tmp_path / "restart.json", tmp_path / "restart.svg"
    r = run(["restart", str(tiny_ckpt), "--runs", "1", "--variants", "cold,warm", "--json", str(out),
             "--plot", str(pic)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(b) resident --preload off" in r.stdout and "(c) resident + daemon" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["floor"]["import_torch_s"] > 0
    data_bytes = sum(t.numel() * t.element_size() for t in load_file(str(tiny_ckpt / "model.safetensors")).values())
    assert doc["preload"]["bytes_read"] == data_bytes and doc["preload"]["gb_s"] > 0
    for v in ("cold", "warm"):
        res = doc[v]
        assert "error" not in res
        assert 0 < res["ready_s"] <= res["first_token_s"] < 120
        assert {"import", "weights", "kv_alloc", "warmup"} <= set(res["phases"])
        assert res["phases"]["import"] < res["ready_s"]
    assert 0 < doc["warm"]["attach_s"] < 1.0  # parsed from the warm worker's log
    for v in ("cold", "warm"):   # each run paired with a floor process started right before it
        run0 = doc[v]["runs"][0]
        assert run0["floor_s"] > 0   # not "< ready_s": on a busy host the floor process can be the slower one
        assert run0["above_floor_s"] == pytest.approx(run0["ready_s"] - run0["floor_s"])
        assert run0["after_imports_s"] == pytest.approx(run0["ready_s"] - run0["phases"]["import"])
        assert doc[v]["above_floor_s"] == pytest.approx(run0["above_floor_s"])   # the median of one run
    # ready - floor goes negative when the floor process itself ran slow (a busy box): a figure all the same
    assert re.search(r"ready - floor \(a floor process right before each run\): -?[0-9.]+ s median \(per run "
                     r"-?[0-9.]+\); after the imports [0-9.]+ s \(per run [0-9.]+\)", r.stdout), r.stdout
    assert re.fullmatch(r"rpc [0-9.]+, fds [0-9.]+, map [0-9.]+, views [0-9.]+ ms",
                        doc["warm"]["runs"][0]["attach_breakdown"])
    assert re.fullmatch(r"device\+modules [0-9.]+, key [0-9.]+, client [0-9.]+, store [0-9.]+ \(of which the attach "
                        r"[0-9.]+\); [0-9.]+ s in all", doc["warm"]["runs"][0]["weights_breakdown"])
    # each build phase's CPU seconds on the build thread against its wall time, and the process's CPU
    cpu = doc["warm"]["runs"][0]["cpu_breakdown"]
    # (the inline front end loads a local folder's tokenizer first, before the weights)
    assert re.match(r"tokenizer [0-9.]+ of [0-9.]+, weights [0-9.]+ of [0-9.]+, .*kv alloc [0-9.]+ of [0-9.]+, "
                    r"warmup [0-9.]+ of [0-9.]+, verify [0-9.]+ of [0-9.]+, .*; the process used [0-9.]+ s of CPU in "
                    r"its [0-9.]+ s$", cpu), cpu
    svg = pic.read_text()
    assert svg.startswith("<svg") and "(c) resident + daemon" in svg and "weights" in svg


def test_restart_hf_variant(tiny_ckpt, tmp_path):
    out = tmp_path / "hf.json"
    r = run(["restart", str(tiny_ckpt), "--runs", "1", "--variants", "hf", "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    hf = json.loads(out.read_text())["hf"]
    assert hf["runs"][0]["new_tokens"] == 1
    assert 0 < hf["ready_s"] < hf["first_token_s"]
    assert hf["phases"]["import"] > 0 and hf["phases"]["weights"] > 0 and hf["phases"]["tokenizer"] > 0
    assert "no tokenizer" not in hf["runs"][0]["note"]   # the checkpoint's tokenizer was loaded and used


def test_a_failing_variant_is_reported_not_fatal(tiny_ckpt, tmp_path):
    out = tmp_path / "fail.json"
    r = run(["restart", str(tiny_ckpt), "--runs", "1", "--variants", "cold", "--serve-args", "--max-model-len 1",
             "--json", str(out)])
    assert r.returncode == 1
    assert "failed" in r.stdout and "logs are in" in r.stderr
    doc = json.loads(out.read_text())
    assert "max-model-len" in doc["cold"]["error"]


def test_plot_segments_and_png_falls_back_to_svg(tmp_path, monkeypatch):
    results = {"model": "/m/tiny", "device": "cuda", "gpu": "H200", "floor": {"import_torch_s": 3.4},
               "warm": {"ready_s": 4.0, "first_token_s": 4.1,
                        "phases": {"import": 3.5, "weights": 0.01, "kv_alloc": 0.2, "total": 4.0}},
               "hf": {"ready_s": 17.0, "first_token_s": 17.8,
                      "phases": {"import": 6.0, "cuda_init": 0.3, "weights": 10.7, "first_token": 0.8}}}
    segs = dict(bench_plot.segments(results["warm"]))
    assert segs["import"] == 3.5 and abs(segs["other"] - 0.29) < 1e-9 and abs(segs["first token"] - 0.1) < 1e-9
    assert "total" not in segs
    assert abs(sum(v for _, v in bench_plot.segments(results["hf"])) - 17.8) < 1e-9
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    written = bench_plot.plot_phases(results, ["hf", "warm"], tmp_path / "p.png")
    assert written == tmp_path / "p.svg" and "(a) HF transformers" in written.read_text()


def test_restart_of_a_tp2_group_cold_and_attached_to_the_daemons_shards(tiny_ckpt, tmp_path):
    """`--tensor-parallel-size 2` (gloo on CPU): cold = both ranks load their own shard, warm =
    both attach theirs from a daemon holding the model as 2 shards; the JSON carries rank 0's
    phases, the group's formation, rank 1's own start-up and every rank's attach."""
    out, pic = tmp_path / "tp.json", tmp_path / "tp.svg"
    r = run(["restart", str(tiny_ckpt), "--runs", "1", "--tensor-parallel-size", "2", "--json", str(out),
             "--plot", str(pic), "--serve-args", "--cpu-threads 1 --max-model-len 256"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tensor parallel: 2 ranks" in r.stdout and "TP group formed in" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["tensor_parallel_size"] == 2 and "hf" not in doc   # HF has no TP to compare with
    data_bytes = sum(t.numel() * t.element_size() for t in load_file(str(tiny_ckpt / "model.safetensors")).values())
    assert data_bytes <= doc["preload"]["resident_bytes"] < 1.1 * data_bytes   # 2 halves (+ replicated norms)
    for v, source in (("cold", "local"), ("warm", "daemon")):
        res = doc[v]
        assert "error" not in res
        assert 0 < res["ready_s"] <= res["first_token_s"] < 120
        assert {"import", "weights", "kv_alloc", "warmup"} <= set(res["phases"])
        assert 0 < res["tp_group_s"] <= res["phases"]["weights"] + 0.05   # formed inside rank 0's weights phase
        (rank1,) = res["runs"][0]["tp_ranks"]
        assert rank1["rank"] == 1 and rank1["source"] == source and rank1["import_s"] > 0
    assert len(doc["warm"]["runs"][0]["attach_s_per_rank"]) == 2
    assert "(c) resident + daemon" in pic.read_text()

    r = run(["restart", str(tiny_ckpt), "--tensor-parallel-size", "2", "--variants", "hf"])
    assert r.returncode == 2 and "no tensor parallelism" in r.stderr

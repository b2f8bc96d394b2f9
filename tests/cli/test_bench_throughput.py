"""`resident bench throughput` on a tiny checkpoint on CPU: decode tokens/s per batch size,
bytes per step from the weights and KV actually read, and the roofline fraction."""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from resident.cli.bench_throughput import copy_bandwidth, weight_bytes_per_step


def test_throughput_bf16_and_fp8_on_cpu(tiny_model, tmp_path):
    folder = tiny_model("llama", dtype="bfloat16")
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder),
                        "--batch-sizes", "1,3", "--context", "40", "--steps", "3", "--warmup-steps", "1",
                        "--quantization", "none,fp8_per_tensor", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OF ROOFLINE" in r.stdout and "fp8_per_tensor" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["copy_bandwidth_bytes_per_s"] > 1e8
    by_q = {v["quantization"]: v for v in doc["variants"]}
    assert set(by_q) == {"none", "fp8_per_tensor"}
    cfg = json.loads((folder / "config.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv_per_token = 2 * layers * cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"]) * 2  # bf16 KV
    for v in by_q.values():
        assert [r["batch"] for r in v["results"]] == [1, 3]
        for res in v["results"]:
            assert res["all_decode_steps"] and res["tokens_per_s"] > 0
            assert abs(res["tokens_per_s"] - res["batch"] / res["step_s"]) < 1e-6 * res["tokens_per_s"]
            assert res["kv_bytes"] == int(res["batch"] * (40 + 1 + 1 + 1) * kv_per_token)
            assert res["bytes_per_step"] == res["weight_bytes"] + res["kv_bytes"]
            assert 0 < res["roofline_fraction"] == res["roofline_step_s"] / res["step_s"]
    # fp8 linear weights are half the bytes of bf16 ones; embeddings/norms/lm_head stay
    assert by_q["fp8_per_tensor"]["results"][0]["weight_bytes"] < 0.8 * by_q["none"]["results"][0]["weight_bytes"]


def test_weight_bytes_count_only_looked_up_embedding_rows_unless_tied():
    w = {"model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
         "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}
    assert weight_bytes_per_step(w, 4) == 100 * 8 * 2 + 16  # tied: the table is the LM head
    w["lm_head.weight"] = torch.zeros(100, 8, dtype=torch.bfloat16)
    assert weight_bytes_per_step(w, 4) == 4 * 8 * 2 + 16 + 100 * 8 * 2


def test_copy_bandwidth_is_measured():
    assert copy_bandwidth(torch.device("cpu"), 8 << 20, 2) > 1e8


def test_bad_arguments_are_usage_errors(tiny_model):
    folder = tiny_model("llama")
    for args, msg in ((["--batch-sizes", "1,x"], "comma-separated"), (["--quantization", "int4"], "int4")):
        r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_throughput_of_a_tp2_group_on_cpu(tiny_model, tmp_path):
    """`--tensor-parallel-size 2` measures a gloo TP group (rank 1 a child process) like TP=1."""
    folder = tiny_model("llama", dtype="float32")
    out = tmp_path / "tp2.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder),
                        "--batch-sizes", "1,2", "--context", "24", "--steps", "2", "--warmup-steps", "1",
                        "--quantization", "none", "--tensor-parallel-size", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["tensor_parallel_size"] == 2
    (variant,) = doc["variants"]
    assert [res["batch"] for res in variant["results"]] == [1, 2]
    for res in variant["results"]:
        assert res["all_decode_steps"] and res["tokens_per_s"] > 0 and res["roofline_fraction"] > 0

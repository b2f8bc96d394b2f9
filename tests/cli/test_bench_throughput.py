"""`resident bench throughput` on a tiny checkpoint on CPU: decode tokens/s per batch size,
bytes per step from the weights and KV actually read, and the roofline fraction."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from resident.cli.bench_throughput import copy_bandwidth, weight_bytes_per_step


def _bench_throughput(folder, out, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`resident bench throughput` at batch 1 and 3 over 3 timed steps after 1, JSON to `out`;
    asserts it exited 0."""
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder),
                        "--batch-sizes", "1,3", "--steps", "3", "--warmup-steps", "1", *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k not in ("RESIDENT_GEMV", "RESIDENT_PDL")}
                       | (env or {}))
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_throughput_bf16_and_fp8_on_cpu(tiny_model, tmp_path):
    folder = tiny_model("llama", dtype="bfloat16")
    out = tmp_path / "tp.json"
    r = _bench_throughput(folder, out, "--context", "40", "--quantization", "none,fp8_per_tensor",
                          env={"RESIDENT_PDL": "off"})
    assert "OF ROOFLINE" in r.stdout and "fp8_per_tensor" in r.stdout and "; RESIDENT_PDL=off" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["kernel_switches"] == {"RESIDENT_GEMV": None, "RESIDENT_PDL": "off"}     # what ran, recorded
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


def test_throughput_with_and_without_async_scheduling(tiny_model, tmp_path):
    folder = tiny_model("llama")
    out = tmp_path / "async.json"
    r = _bench_throughput(folder, out, "--context", "24", "--async-scheduling", "on,off")
    assert "ASYNC" in r.stdout
    results = json.loads(out.read_text())["variants"][0]["results"]
    assert [(res["batch"], res["async_scheduling"]) for res in results] == [(1, True), (1, False), (3, True), (3, False)]
    assert all(res["all_decode_steps"] and res["tokens_per_s"] > 0 for res in results)


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
    for args, msg in ((["--batch-sizes", "1,x"], "comma-separated"), (["--quantization", "int4"], "int4"),
                      (["--async-scheduling", "maybe"], "--async-scheduling takes on, off or on,off")):
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


def _counts(profile: dict) -> dict[str, float]:
    return {c: v["calls_per_step"] for c, v in profile["categories"].items()}


def test_throughput_profile_on_cpu(tiny_model, tmp_path):
    """`--profile`: per row, a table of kernel categories (CPU ops here) and a `profile` key in the JSON,
    taken after the timed steps; refused with a TP group."""
    folder = tiny_model("llama", dtype="bfloat16")
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder),
                        "--batch-sizes", "1,2", "--context", "24", "--steps", "2", "--warmup-steps", "1",
                        "--quantization", "none,fp8_per_tensor", "--profile", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for needle in ("profile none batch 1", "profile fp8_per_tensor batch 2", "GEMM/GEMV", "gap (step - kernels)",
                   "rotary+KV write", "same kernels"):
        assert needle in r.stdout, r.stdout
    doc = json.loads(out.read_text())
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for v in doc["variants"]:
        for res in v["results"]:
            assert res["all_decode_steps"] and res["tokens_per_s"] > 0   # the timed figures are all there
            p = res["profile"]
            assert "error" not in p, p
            assert p["time_source"] == "cpu op self time" and p["step_us"] == pytest.approx(res["step_s"] * 1e6)
            calls = _counts(p)
            # every layer's reference kernels show up under their categories
            for cat in ("gemm", "attention", "norm", "rotary_kv", "activation", "sampling"):
                assert calls[cat] >= layers, (cat, calls)
            assert (calls["quantization"] > 0) == (v["quantization"] == "fp8_per_tensor"), calls
            assert p["gemm_bytes_per_s"] > 0
            assert p["kernel_us_per_step"] == pytest.approx(sum(c["us_per_step"] for c in p["categories"].values()))
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder), "--profile",
                        "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--profile profiles one device" in r.stderr, r.stderr


def test_throughput_without_profile_has_no_profile_key(tiny_model, tmp_path):
    folder = tiny_model("llama", dtype="float32")
    out = tmp_path / "plain.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder),
                        "--batch-sizes", "1", "--context", "16", "--steps", "2", "--warmup-steps", "0",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GEMM/GEMV" not in r.stdout
    assert all("profile" not in res for v in json.loads(out.read_text())["variants"] for res in v["results"])


@pytest.mark.gpu
def test_throughput_profile_on_gpu(tiny_model, tmp_path):
    """On CUDA every kernel of the decode step is named by PATTERNS: each layer's GEMMs, attention,
    norms and silu-mul are counted in their category, and the graph-mode pass saw the replays.
    The rotation and the KV write have no kernel of their own there: the decode attention
    (`Kernels.rotary_paged_attention`, session 14) does them, so they count as attention."""
    folder = tiny_model("llama", dtype="bfloat16")
    out = tmp_path / "profile-gpu.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "throughput", str(folder),
                        "--device", "cuda", "--batch-sizes", "1,8", "--context", "64", "--steps", "4",
                        "--warmup-steps", "2", "--quantization", "none,fp8_per_tensor", "--profile",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for v in json.loads(out.read_text())["variants"]:
        for res in v["results"]:
            p = res["profile"]
            assert "error" not in p, p
            calls = _counts(p)
            assert calls["gemm"] >= 4 * layers + 1, calls      # qkv, o, gate_up, down per layer; the LM head
            for cat in ("attention", "activation"):
                assert calls[cat] >= layers, (cat, calls)
            assert calls["rotary_kv"] == 0, calls   # inside the attention kernel
            assert calls["norm"] >= 2 * layers, calls
            assert p["graph_mode"] is not None and p["graph_mode"]["calls_per_step"] > 0

"""`resident bench attach`: synthetic Llama-shaped checkpoints of the asked sizes, a private
daemon, load throughput and attach latency, a table and a JSON file."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from resident.cli.bench_attach import LlamaShape


@pytest.mark.parametrize("size", [1 << 20, 16 << 20, 256 << 20, 1 << 30])
def test_shapes_hit_the_requested_size(size):
    shape = LlamaShape.for_bytes(size)
    nbytes = 2 * sum(math.prod(d) for d in shape.tensor_shapes().values())
    assert abs(nbytes - size) / size < 0.1
    assert shape.num_attention_heads * shape.head_dim == shape.hidden_size
    assert shape.num_attention_heads % shape.num_key_value_heads == 0
    cfg = shape.config()
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == shape.num_key_value_heads


def test_bench_attach_writes_a_table_and_valid_json(tmp_path):
    out = tmp_path / "attach.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "attach", "--sizes", "4MiB",
                        "--repeats", "2", "--fresh", "1", "--layers", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ATTACH MS p50" in r.stdout and "LOAD GB/S" in r.stdout and "FRESH ATTACH MS" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "attach" and doc["backend"] == "host_shm" and doc["repeats"] == 2
    (res,) = doc["results"]
    assert res["requested_bytes"] == 4 << 20
    assert abs(res["resident_bytes"] - (4 << 20)) / (4 << 20) < 0.1
    assert res["num_tensors"] == 3 * 6 + 3          # fused qkv and gate_up: 6 per layer, + embed, norm, lm_head
    assert doc["layers"] == 3 and doc["fresh"] == 1
    # The attach from a new process (imports included) was measured once, and took real time.
    assert len(res["fresh_attach_ms"]["samples"]) == 1 and res["fresh_attach_ms"]["median"] > 0
    assert len(res["fresh_connect_ms"]["samples"]) == 1 and res["fresh_connect_ms"]["median"] > 0
    assert res["load_s"] > 0 and res["load_gb_s"] > 0
    assert len(res["attach_ms"]["samples"]) == 2 and len(res["connect_ms"]["samples"]) == 2
    assert 0 < res["attach_ms"]["median"] <= res["attach_ms"]["p90"] < 10_000
    assert doc["machine"]["cpu_count"] >= 1


def test_bench_attach_rejects_bad_sizes():
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "attach", "--sizes", "1MiB,big"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid size 'big'" in r.stderr

"""`resident bench speculative` on the default model (CPU): every mode runs, speculation
gives the plain run's greedy tokens, and the JSON carries acceptance per mode."""
from __future__ import annotations

import json
import subprocess
import sys


def test_bench_speculative_runs_every_mode(default_model_dir, tmp_path):
    out = tmp_path / "spec.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "speculative", str(default_model_dir),
                        "--draft-layers", "2", "--num-speculative-tokens", "2", "--batch-sizes", "1",
                        "--max-tokens", "6", "--workloads", "repetitive", "--cpu-threads", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SAME OUT" in r.stdout
    doc = json.loads(out.read_text())
    by_mode = {row["mode"]: row for row in doc["results"]}
    assert set(by_mode) == {"plain", "draft", "ngram"}
    for row in by_mode.values():
        assert row["same_output"] == row["batch"] == 1
        assert row["tokens_per_s"] > 0
    for mode in ("draft", "ngram"):
        assert 0.0 <= by_mode[mode]["acceptance_rate"] <= 1.0

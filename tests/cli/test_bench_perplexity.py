"""`resident bench perplexity`: teacher-forced perplexity through the engine's runner, in
prefill chunks over the paged KV cache, equals HF transformers' loss on the same tokens;
the CLI compares weight variants over the same token ids."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from resident.cli.bench_perplexity import perplexity
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory import get_backend
from resident.worker.config import ModelConfig
from resident.worker.engine_config import EngineConfig
from resident.worker.model_runner import ModelRunner


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_perplexity_equals_hf_loss(tiny_model, chunk):
    transformers = pytest.importorskip("transformers")
    folder = tiny_model("llama", dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg["vocab_size"], (50,), generator=g).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    loaded = load(LoadSpec(str(folder)), get_backend("host_shm"))
    try:
        tensors = loaded.table.views([s.readable() for s in loaded.slabs])
        ec = EngineConfig(block_size=16, num_kv_blocks=4, max_num_seqs=1, max_num_batched_tokens=chunk,
                          max_model_len=64, enable_prefix_caching=False)
        runner = ModelRunner(ModelConfig.from_hf(loaded.config), ec, tensors)
        got = perplexity(runner, ids, chunk, 16)
    finally:
        runner = tensors = None
        for s in loaded.slabs:
            s.close()
    assert got["tokens"] == 49
    assert got["nll"] == pytest.approx(want, abs=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-4)


def test_cli_compares_bf16_and_fp8_on_the_default_model(default_model_dir, tmp_path):
    out = tmp_path / "ppl.json"
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "bench", "perplexity", str(default_model_dir),
                        "--max-tokens", "96", "--chunk", "40", "--dtype", "bfloat16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fp8_per_tensor" in r.stdout and "vs first" in r.stdout
    doc = json.loads(out.read_text())
    base, fp8 = doc["results"]
    assert base["quantization"] == "none" and fp8["quantization"] == "fp8_per_tensor"
    assert base["tokens"] == fp8["tokens"] == 95
    # A real model on real text: far better than chance, and fp8 close to bf16.
    assert base["perplexity"] < 100 and fp8["perplexity"] < 1.5 * base["perplexity"]
    assert fp8["resident_bytes"] < 0.75 * base["resident_bytes"]

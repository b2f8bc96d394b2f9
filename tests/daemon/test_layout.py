"""The loader stores tensors in the engine's layout, bit-identical to torch.cat of the HF tensors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from resident.daemon import layout
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory.host_shm import HostShmBackend


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture
def load_views():
    loaded = []

    def run(folder: Path, **kw) -> tuple[object, dict[str, torch.Tensor]]:
        m = load(LoadSpec(str(folder), **kw), HostShmBackend(max_slab_bytes=128 << 10))
        loaded.append(m)
        return m, m.table.views([s.readable() for s in m.slabs])

    yield run
    for m in loaded:
        for s in m.slabs:
            s.close()


def expected_layout(folder: Path) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    hf = hf_tensors(folder)
    return {f.name: torch.cat([hf[s] for s in f.sources]) for f in layout.plan(config, set(hf))}


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_layout_bit_identical(tiny_model, load_views, arch):
    folder = tiny_model(arch)
    model, views = load_views(folder)
    want = expected_layout(folder)
    assert set(views) == set(want)
    for name, t in want.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape, name
        assert torch.equal(views[name].view(torch.uint8), t.view(torch.uint8)), name
        assert views[name].is_contiguous()
    assert model.layout == layout.LAYOUT
    cfg = json.loads((folder / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", False)
    assert ("lm_head.weight" in views) == (not tied)
    a = "model.layers.1.self_attn"
    assert (f"{a}.qkv_proj.bias" in views) == (arch == "qwen2")
    assert (f"{a}.q_norm.weight" in views and f"{a}.k_norm.weight" in views) == (arch == "qwen3")
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nh
    assert views[f"{a}.qkv_proj.weight"].shape == ((nh + 2 * nkv) * d, cfg["hidden_size"])
    assert views["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * cfg["intermediate_size"], cfg["hidden_size"])


def test_sharded_checkpoint(tiny_model, load_views):
    folder = tiny_model("qwen2", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    model, views = load_views(folder)
    want = expected_layout(folder)
    assert set(views) == set(want)
    for name, t in want.items():
        assert torch.equal(views[name], t), name
    assert len(model.slabs) > 1  # 128 KiB slab limit in the fixture


def rewrite(folder: Path, change) -> None:
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_unknown_tensor_is_refused(tiny_model, load_views):
    folder = tiny_model("llama")
    rewrite(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(layout.LayoutError, match="extra_proj"):
        load_views(folder)


def test_missing_tensor_is_refused(tiny_model, load_views):
    folder = tiny_model("llama")
    rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(layout.LayoutError, match="missing"):
        load_views(folder)


def test_wrong_shape_is_refused(tiny_model, load_views):
    folder = tiny_model("llama")
    rewrite(folder, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(layout.LayoutError, match=r"up_proj.weight has shape \(100, 64\)"):
        load_views(folder)


def test_unsupported_architecture_is_refused(tiny_model, load_views):
    folder = tiny_model("llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(layout.LayoutError, match="unsupported architecture"):
        load_views(folder)

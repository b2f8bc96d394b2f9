"""Resolving a model: local folders and the local HF hub cache; clear errors otherwise."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from resident.daemon.source import ModelNotFound, SourceError, default_hub_cache, resolve_model

from fake_hub import COMMIT, fake_hub


def test_local_folder(tiny_model):
    folder = tiny_model("llama")
    src = resolve_model(str(folder))
    assert src.folder == folder.resolve()
    assert src.files == [folder.resolve() / "model.safetensors"]
    assert src.config["architectures"] == ["LlamaForCausalLM"]
    assert src.hub_id is None and src.revision is None


def test_sharded_folder_uses_index(tiny_model):
    folder = tiny_model("llama", max_shard_size="100KB")
    (folder / "stray.safetensors").write_bytes(b"not listed in the index")
    src = resolve_model(str(folder))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert [p.name for p in src.files] == sorted(set(index["weight_map"].values()))


def test_index_naming_missing_shard(tiny_model):
    folder = tiny_model("llama", max_shard_size="100KB")
    victim = sorted(folder.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(SourceError, match=f"{victim.name}, which is missing.*re-download"):
        resolve_model(str(folder))


def test_missing_path(tmp_path):
    with pytest.raises(SourceError, match="no such model folder"):
        resolve_model(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        resolve_model(str(tmp_path / "m"))


def test_folder_without_weights(tiny_model):
    folder = tiny_model("llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"no \*\.safetensors"):
        resolve_model(str(folder))


def test_bin_only_folder_explains_conversion(tiny_model):
    folder = tiny_model("llama")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(SourceError, match="pytorch_model.bin.*needs safetensors.*safe_serialization=True"):
        resolve_model(str(folder))


def test_a_gguf_folder_or_file_points_to_the_original_checkpoint(tiny_model):
    """The conversion command offered for .bin files cannot convert a GGUF (transformers fails
    on the folder, and refuses to save a GGUF-loaded model), so GGUF gets its own advice."""
    folder = tiny_model("llama")
    (folder / "model.safetensors").rename(folder / "model-Q4_K_M.gguf")
    for path in (folder, folder / "model-Q4_K_M.gguf"):
        with pytest.raises(SourceError) as e:
            resolve_model(str(path))
        assert "GGUF" in str(e.value) and "original safetensors checkpoint" in str(e.value)
        assert "save_pretrained" not in str(e.value)


def test_bad_config_json(tiny_model):
    folder = tiny_model("llama")
    (folder / "config.json").write_text("{broken")
    with pytest.raises(SourceError, match="cannot parse.*config.json"):
        resolve_model(str(folder))


def test_hub_id_from_cache(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so "org/tiny" is not a local path
    snap = fake_hub(tmp_path / "hub", "org/tiny", tiny_model("llama"))
    src = resolve_model("org/tiny", hub_cache=str(tmp_path / "hub"))
    assert src.folder == snap and src.hub_id == "org/tiny" and src.revision == COMMIT
    assert [p.name for p in src.files] == ["model.safetensors"]
    # A commit hash as revision, and a named ref.
    assert resolve_model("org/tiny", revision=COMMIT, hub_cache=str(tmp_path / "hub")).revision == COMMIT
    with pytest.raises(ModelNotFound, match="revision 'v2'.*huggingface-cli download org/tiny --revision v2"):
        resolve_model("org/tiny", revision="v2", hub_cache=str(tmp_path / "hub"))


def test_hub_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound, match="does not download.*huggingface-cli download org/absent"):
        resolve_model("org/absent", hub_cache=str(tmp_path / "hub"))


def test_default_hub_cache_precedence():
    assert default_hub_cache({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert default_hub_cache({"HF_HOME": "/b"}) == Path("/b/hub")
    assert default_hub_cache({}) == Path("~/.cache/huggingface/hub").expanduser()


def test_missing_models_are_model_not_found_and_bad_ones_are_not(tiny_model, tmp_path):
    """The daemon answers NOT_FOUND for ModelNotFound, INVALID_ARGUMENT for other SourceErrors."""
    with pytest.raises(ModelNotFound, match="no such model folder"):
        resolve_model(str(tmp_path / "absent"))
    folder = tiny_model("llama")
    (folder / "config.json").unlink()
    with pytest.raises(SourceError, match="has no config.json") as e:
        resolve_model(str(folder))
    assert not isinstance(e.value, ModelNotFound)

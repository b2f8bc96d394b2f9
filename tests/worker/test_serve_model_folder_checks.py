"""A model folder that cannot be served fails `resident serve` before its weights load (a large
model's load takes minutes), with the one line naming what is missing."""
from __future__ import annotations

import json
import shutil
import time

import pytest
from serve_helpers import servable_tiny_model

from resident.worker.metrics import ServerMetrics
from resident.worker.serve_config import ServeConfig
from resident.worker.startup import StartupTimer, build_worker
from resident.worker.tokenizer import TokenizerError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return servable_tiny_model(tmp_path_factory.mktemp("folder") / "llama", "llama")


@pytest.fixture
def folder(tiny, tmp_path, monkeypatch):
    """A copy of the tiny model whose weights must not be loaded."""
    import resident.worker.weight_store as weight_store

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the folder was checked")

    monkeypatch.setattr(weight_store, "open_store", no_load)
    shutil.copytree(tiny, tmp_path / "model")
    return tmp_path / "model"


def _build(folder, **kwargs):
    config = ServeConfig(model=str(folder), preload="off", device="cpu", **kwargs)
    return build_worker(config, StartupTimer(time.time()), ServerMetrics("m"))


def test_a_folder_without_tokenizer_json_fails_before_the_weights_load(folder):
    """It was found only after the weights had loaded (the tokenizer is read after them)."""
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=f"{folder} has no tokenizer.json; .* serve a folder that includes it"):
        _build(folder)


@pytest.mark.parametrize("content, words", [(b'{"version": "1.0", "model": ', "cannot load"),
                                            (b"\x00\x01 not json", "cannot load")])
def test_a_tokenizer_json_that_does_not_load_fails_before_the_weights_load(folder, content, words):
    """The inline front end read tokenizer.json only after the weights had loaded (a large
    model's cold load takes minutes; an attached one the daemon then keeps)."""
    (folder / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=f"{words} {folder / 'tokenizer.json'}"):
        _build(folder)


def test_a_config_the_decoder_cannot_run_fails_before_the_weights_load(folder):
    """ModelConfig read the config only after the weights (and the daemon kept them)."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "longrope", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope scaling type 'longrope' is not supported"):
        _build(folder)


@pytest.mark.parametrize("kwargs, words", [
    ({"max_model_len": 100_000}, "--max-model-len 100000 exceeds the model's max_position_embeddings"),
    ({"num_kv_blocks": 1}, "--num-kv-blocks 1 holds 16 tokens, fewer than one request"),
    # (found only after the weights until session 17; the dtype is not known before them: a lower bound)
    ({"kv_cache_memory_bytes": 1024, "max_model_len": 64},
     "--kv-cache-memory 1024 bytes holds 0 blocks of 16 tokens, fewer than one request of --max-model-len 64 needs "
     r"\(4 blocks = at least .* MiB, twice that for float32 weights\); raise --kv-cache-memory"),
])
def test_flags_the_model_config_refuses_fail_before_the_weights_load(folder, kwargs, words):
    with pytest.raises(ValueError, match=words):
        _build(folder, **kwargs)


def test_a_missing_draft_model_is_named_as_the_draft(folder, tmp_path):
    """It was 'no such model folder: PATH', the same words as for MODEL."""
    draft = tmp_path / "no-draft"
    with pytest.raises(ValueError, match=f"--speculative-model {draft}: no such model folder .*; pass the draft "
                                         "model's folder, or '\\[ngram\\]' for prompt lookup"):
        _build(folder, speculative_model=str(draft), num_speculative_tokens=3)

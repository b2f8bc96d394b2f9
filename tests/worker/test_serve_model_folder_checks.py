"""A model folder that cannot be served fails `resident serve` before its weights load (a large
model's load takes minutes), with the one line naming what is missing."""
from __future__ import annotations

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


def test_a_folder_without_tokenizer_json_fails_before_the_weights_load(tiny, tmp_path, monkeypatch):
    """It was found only after the weights had loaded (the tokenizer is read after them)."""
    import resident.worker.weight_store as weight_store

    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    (folder / "tokenizer.json").unlink()

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(weight_store, "open_store", no_load)
    config = ServeConfig(model=str(folder), preload="off", device="cpu")
    with pytest.raises(TokenizerError, match=f"{folder} has no tokenizer.json; .* serve a folder that includes it"):
        build_worker(config, StartupTimer(time.time()), ServerMetrics("m"))

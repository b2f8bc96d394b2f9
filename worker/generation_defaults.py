"""Default sampling parameters from the model's generation_config.json, as vLLM's `--generation-config`.

Model authors put their recommended sampling in generation_config.json (Llama 3.1: temperature 0.6,
top_p 0.9; Qwen3: temperature 0.6, top_p 0.95, top_k 20). vLLM uses them as the defaults of requests
that do not send their own (`--generation-config auto`, its default); so does resident. A request's
own value always wins. `max_new_tokens` becomes a cap on max_tokens, as in vLLM.

- `--generation-config auto`: the model folder's generation_config.json (none there: no defaults).
- `--generation-config vllm`: no model defaults (OpenAI's: temperature 1, top_p 1, ...).
- `--generation-config FOLDER`: FOLDER/generation_config.json.
- `--override-generation-config JSON`: fields that replace (or add to) the file's, e.g.
  '{"temperature": 0.5}'.

Only the sampling fields are read (temperature, top_p, top_k, min_p, repetition_penalty,
max_new_tokens); `do_sample` is ignored, as vLLM does. A value out of range in the model's file is
skipped with a warning naming it; in an override it is an error at start.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("auto", "vllm")
FILE = "generation_config.json"
#: generation_config.json's fields -> the request field each is the default of.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_mode(value: str) -> None:
    """--generation-config: auto, vllm or a folder holding generation_config.json."""
    if value in MODES:
        return
    if not (Path(value).expanduser() / FILE).is_file():
        raise ValueError(f"--generation-config {value!r}: expected auto (the model's {FILE}), vllm (no model "
                         f"defaults) or a folder holding {FILE}; {Path(value).expanduser() / FILE} does not exist")


def _valid(name: str, value: Any) -> Any:
    """`value` for generation-config field `name` as the request field takes it; a ValueError saying why not."""
    from resident.worker.sampling_params import SamplingParams

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if name in ("top_k", "max_new_tokens"):
        if value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        value = int(value)
    if name == "max_new_tokens":
        if value < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {value}")
        return value
    SamplingParams(**{name: value})   # its range checks, with its messages
    return max(value, 0) if name == "top_k" else float(value)


def parse_overrides(text: str | None) -> dict[str, Any]:
    """--override-generation-config's JSON object, checked (keys named, values in range)."""
    if text is None:
        return {}
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--override-generation-config is not JSON ({e}); send an object such as "
                         "'{\"temperature\": 0.5}'") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--override-generation-config must be a JSON object, got {text[:100]!r}")
    out = {}
    for name, value in obj.items():
        if name not in FIELDS:
            raise ValueError(f"--override-generation-config: {name!r} is not a sampling field this server reads; "
                             f"use {', '.join(FIELDS)}")
        try:
            out[name] = _valid(name, value)
        except ValueError as e:
            raise ValueError(f"--override-generation-config: {e}") from None
    return out


def generation_defaults(mode: str, model_folder: str | Path, overrides: dict[str, Any] | None = None,
                        log: bool = True) -> tuple[tuple[str, Any], ...]:
    """The requests' default sampling fields as (request field, value) pairs: from `mode`'s
    generation_config.json (see the module doc), then `overrides` (already checked)."""
    values: dict[str, Any] = {}
    source = "--override-generation-config"
    if mode != "vllm":
        path = (Path(model_folder) if mode == "auto" else Path(mode).expanduser()) / FILE
        try:
            raw = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError) as e:
            logger.warning("%s: not readable as JSON (%s); no default sampling from it", path, e)
            raw = {}
        for name in FIELDS:
            if name in raw and raw[name] is not None:
                try:
                    values[name] = _valid(name, raw[name])
                except ValueError as e:
                    logger.warning("%s: %s; that default is not used", path, e)
        source = str(path) + (" and --override-generation-config" if overrides else "")
    values.update(overrides or {})
    if values and log:
        logger.info("default sampling from %s: %s (a request's own values win; --generation-config vllm "
                    "turns the model's off)", source, ", ".join(f"{k} {v}" for k, v in values.items()))
    return tuple((FIELDS[k], v) for k, v in values.items())

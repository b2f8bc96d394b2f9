"""A failed start logs one line when the error explains itself (startup.explains_itself): the
daemon's refusals name their fix, so they get no traceback; an unexpected error keeps one."""
from __future__ import annotations

import pytest

from resident.daemon.errors import DaemonUnavailable, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from resident.worker.startup import explains_itself
from resident.worker.weight_store import WeightStoreError


@pytest.mark.parametrize("error", [
    ResourceExhausted("the model needs 20.0 GB of host memory, 3.1 GB are available: unload a model"),
    PermissionDenied("uid 1000 may not load models"), NotFound("no model with key 1234"),
    InvalidArgument("bad dtype"), DaemonUnavailable("no daemon"),
    WeightStoreError("--preload require: ..."), ValueError("--max-model-len 0"), OSError(28, "No space left"),
])
def test_refusals_and_bad_input_explain_themselves(error):
    assert explains_itself(error)


@pytest.mark.parametrize("error", [KeyError("hidden_size"), TypeError("unhashable"), AttributeError("x")])
def test_internal_errors_keep_their_traceback(error):
    assert not explains_itself(error)


def _kv_blocks_error(**serve) -> str:
    from types import SimpleNamespace

    import torch

    from resident.worker.serve_config import ServeConfig
    from resident.worker.startup_checks import cpu_kv_blocks

    config = ServeConfig(model="/m", preload="off", **serve)
    model = SimpleNamespace(num_kv_heads=3, head_dim=64, num_layers=30)
    with pytest.raises(ValueError) as e:
        cpu_kv_blocks(config, model, torch.float32, 4096)
    return str(e.value)


def test_kv_sizes_too_small_for_one_request_name_the_flags_and_the_size():
    """`--num-kv-blocks 1` was refused in EngineConfig's words (max_model_len=4096, num_kv_blocks
    >= 256), `--kv-cache-memory 1KiB` read as "0 MiB", and `--kv-cache-memory 0` named
    kv_cache_memory_bytes."""
    message = _kv_blocks_error(num_kv_blocks=1)
    assert message.startswith("--num-kv-blocks 1 holds 16 tokens") and "--max-model-len 4096" in message
    assert "raise --num-kv-blocks to 256 or more" in message
    assert _kv_blocks_error(kv_cache_memory_bytes=1024).startswith("--kv-cache-memory 1024 bytes holds 0 blocks")
    assert _kv_blocks_error(kv_cache_memory_bytes=2**21).startswith("--kv-cache-memory 2 MiB holds")
    from resident.worker.serve_config import ServeConfig

    with pytest.raises(ValueError, match="^--kv-cache-memory must be positive, got 0$"):
        ServeConfig(model="/m", preload="off", kv_cache_memory_bytes=0)


def test_a_max_model_len_beyond_the_models_positions_is_refused():
    """It was a warning in the log, and the server then answered past the positions the model
    knows (vLLM refuses it too); unset, it is the model's, at most CPU_MAX_MODEL_LEN on CPU."""
    from resident.worker.serve_config import CPU_MAX_MODEL_LEN
    from resident.worker.startup import resolve_max_model_len

    with pytest.raises(ValueError, match=r"^--max-model-len 600 exceeds the model's max_position_embeddings 512 .*"
                                         r"use --max-model-len 512 or less, or leave it unset$"):
        resolve_max_model_len(600, 512, "cpu")
    assert resolve_max_model_len(512, 512, "cuda") == resolve_max_model_len(None, 512, "cuda") == 512
    assert resolve_max_model_len(None, 131072, "cpu") == CPU_MAX_MODEL_LEN
    assert resolve_max_model_len(None, 131072, "cuda") == 131072

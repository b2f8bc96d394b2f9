"""What a worker's start-up checks of its configuration against the model (see startup.py):
--max-model-len against the model's positions (`resolve_max_model_len`), the KV cache's size
against one request of that length (`cpu_kv_blocks` off a GPU), and, before the weights load,
all a local model folder lets be refused (`check_before_weights`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from resident.worker.serve_config import CPU_MAX_MODEL_LEN, ServeConfig


def resolve_max_model_len(requested: int | None, max_positions: int, device_type: str) -> int:
    """--max-model-len, or by default the model's max_position_embeddings (on CPU at most
    CPU_MAX_MODEL_LEN). Beyond the positions the model was trained for (rope scaling included: the
    config's max_position_embeddings counts it) its outputs are not to be trusted, so a larger
    value is refused, as vLLM refuses it."""
    if requested and requested > max_positions:
        raise ValueError(f"--max-model-len {requested} exceeds the model's max_position_embeddings {max_positions} "
                         f"(its config.json): positions beyond it give wrong outputs; use --max-model-len "
                         f"{max_positions} or less, or leave it unset")
    return requested or min(max_positions, CPU_MAX_MODEL_LEN if device_type == "cpu" else 1 << 30)


def cpu_kv_blocks(config: ServeConfig, model_config: Any, dtype: Any, max_model_len: int) -> int:
    """The KV blocks off a GPU: --num-kv-blocks, or as many as --kv-cache-memory holds, at most what
    every running sequence at full length can use; a ValueError naming the fix when that is fewer
    than one request of max_model_len needs."""
    from resident.worker.kv_cache import bytes_per_block

    per_seq = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        _check_num_kv_blocks(config, max_model_len)
        return config.num_kv_blocks
    blocks = _check_kv_cache_memory(config, bytes_per_block(model_config, dtype, config.block_size), max_model_len)
    # More than every running sequence at full length can never be used.
    return min(blocks, per_seq * config.max_num_seqs)


def _check_kv_cache_memory(config: ServeConfig, per_block: int, max_model_len: int, at_least: bool = False) -> int:
    """The blocks of `per_block` bytes --kv-cache-memory holds; a ValueError naming the fix when
    that is fewer than one request of max_model_len needs (`at_least`: per_block is a lower bound,
    the weights' dtype not known yet)."""
    per_seq = -(-max_model_len // config.block_size)
    blocks = config.kv_cache_memory_bytes // per_block
    if blocks < per_seq:
        given = config.kv_cache_memory_bytes   # 1KiB read "0 MiB"
        size = f"{given / 2**20:.0f} MiB" if given >= 2**20 else f"{given} bytes"
        raise ValueError(
            f"--kv-cache-memory {size} holds {blocks} blocks of "
            f"{config.block_size} tokens, fewer than one request of --max-model-len {max_model_len} needs "
            f"({per_seq} blocks = {'at least ' if at_least else ''}{per_seq * per_block / 2**20:.1f} MiB"
            f"{', twice that for float32 weights' if at_least else ''}); raise --kv-cache-memory or lower "
            "--max-model-len")
    return blocks


def _check_num_kv_blocks(config: ServeConfig, max_model_len: int) -> None:
    per_seq = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None and config.num_kv_blocks < per_seq:
        raise ValueError(
            f"--num-kv-blocks {config.num_kv_blocks} holds {config.num_kv_blocks * config.block_size} tokens, "
            f"fewer than one request of --max-model-len {max_model_len} needs ({per_seq} blocks of "
            f"{config.block_size} tokens); raise --num-kv-blocks to {per_seq} or more, or lower --max-model-len")


def check_before_weights(config: ServeConfig, device_type: str) -> None:
    """What a local model folder lets be refused before its weights load (minutes for a large
    model, and the daemon would keep them): a config.json the decoder cannot run (rope scaling,
    activation), --max-model-len beyond its positions, --num-kv-blocks below one such request (on
    CPU, --kv-cache-memory below one even at 2 bytes an element). (The inline front end's
    tokenizer has loaded before this, from such a folder: `startup_build._build_worker`;
    --frontend process loads it beside the weights.)
    A hub id, or a config.json that does not parse, is left to the store's own messages. A
    --speculative-model that is neither a folder nor a hub id is named as the draft."""
    import json

    from resident.daemon.source import looks_like_hub_id
    from resident.worker.config import ModelConfig

    spec = config.speculative
    if spec is not None and spec.method == "draft" and not Path(spec.draft_model).expanduser().exists() \
            and not looks_like_hub_id(spec.draft_model):   # it was named only as "no such model folder"
        raise ValueError(f"--speculative-model {spec.draft_model}: no such model folder (nor is it a hub id of the "
                         "form 'org/name'); pass the draft model's folder, or '[ngram]' for prompt lookup")
    folder = Path(config.model).expanduser()
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(hf_config, dict):
        return
    model_config = ModelConfig.from_hf(hf_config).for_tp(config.tensor_parallel_size)
    max_model_len = resolve_max_model_len(config.max_model_len, model_config.max_position_embeddings, device_type)
    _check_num_kv_blocks(config, max_model_len)
    if device_type == "cpu" and config.num_kv_blocks is None:
        # At 2 bytes an element, the smallest activation dtype: a cache too small even then is too
        # small whatever the weights turn out to be (on a GPU the memory left sizes it instead).
        import torch

        from resident.worker.kv_cache import bytes_per_block

        _check_kv_cache_memory(config, bytes_per_block(model_config, torch.float16, config.block_size), max_model_len,
                               at_least=True)


__all__ = ["check_before_weights", "cpu_kv_blocks", "resolve_max_model_len"]

"""`resident serve --speculative-model ...`: the draft's weights, the KV budget shared with
it, and the runner wrapped for speculation. Kept out of startup.py, which calls these.

Draft weights come from the store's pair when the daemon (or LocalStore) holds target and
draft as one model (`WeightStore.draft`, see docs/internals.md); otherwise the draft is
obtained as a model of its own through the same `open_store` (attached from the daemon
when it holds it, else loaded in-process), and that second store is returned so the
caller can close it.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class DraftSource:
    config: dict
    tensors: Mapping[str, Any]
    store: Any = None  # a second WeightStore to close at shutdown, when not paired with the target


def open_draft(spec: Any, store: Any, load_spec: Any, preload: str, socket: str | None, device: str) -> DraftSource | None:
    """The draft's config and tensors for `spec` (a SpecConfig), or None for prompt lookup."""
    if spec is None or spec.method != "draft":
        return None
    paired = getattr(store, "draft", None)
    if paired is not None:
        logger.info("speculative decoding: draft %s attached with the target (%s)", paired.model_dir, store.source)
        return DraftSource(dict(paired.config), paired.tensors)
    from dataclasses import replace

    from resident.worker.weight_store import open_store

    draft_spec = replace(load_spec, model=spec.draft_model, name="", revision=None, draft=None)
    draft_store = open_store(draft_spec, preload, socket, device=device)
    logger.info("speculative decoding: draft %s from %s (its own store; not paired with the target)",
                draft_store.model_dir, draft_store.source)
    return DraftSource(dict(draft_store.config), draft_store.tensors, draft_store)


def target_share_of_kv(draft: DraftSource | None, target_block_bytes: int, block_size: int) -> float:
    """The target's share of the KV memory when the draft keeps an equally long cache."""
    if draft is None:
        return 1.0
    from resident.worker.config import ModelConfig
    from resident.worker.kv_cache import bytes_per_block

    dtype = draft.tensors["model.embed_tokens.weight"].dtype
    draft_bytes = bytes_per_block(ModelConfig.from_hf(draft.config), dtype, block_size)
    return target_block_bytes / (target_block_bytes + draft_bytes)


def headroom_profile(spec: Any, draft: DraftSource | None, device: Any) -> Any:
    """The GPU planner's `speculative` argument (spec_decode.profile.SpecProfile), or None
    without speculation. A draft whose weights are not on `device` yet is moved there now,
    before the planner measures what the GPU holds (wrap_runner then finds them there)."""
    if spec is None:
        return None
    from resident.worker.device import weights_on
    from resident.worker.spec_decode.profile import SpecProfile

    if draft is None:
        return SpecProfile(method=spec.method, num_speculative_tokens=spec.num_speculative_tokens)
    draft.tensors = weights_on(draft.tensors, device)
    return SpecProfile(method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
                       draft_config=draft.config, draft_weights=draft.tensors)


def wrap_runner(spec: Any, runner: Any, draft: DraftSource | None, device: Any, cuda_graphs: str,
                max_num_kv_blocks: int | None, seed: int | None = None) -> Any:
    """The SpecDecodeRunner over `runner`, or `runner` itself without speculation; `seed` (--seed)
    seeds its generators for unseeded requests (None: random)."""
    if spec is None:
        return runner
    from resident.worker.device import weights_on
    from resident.worker.spec_decode.build import build_spec_runner

    tensors = weights_on(draft.tensors, device) if draft is not None else None
    out = build_spec_runner(spec, runner, draft.config if draft else None, tensors, cuda_graphs=cuda_graphs,
                            max_num_kv_blocks=max_num_kv_blocks, seed=seed)
    logger.info("speculative decoding: %s, %d tokens per step", spec.method if spec.method == "ngram"
                else f"draft {spec.draft_model}", spec.num_speculative_tokens)
    return out

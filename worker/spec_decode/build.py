"""Build the speculative runner from a SpecConfig (used by `resident serve` and the bench)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from resident.worker.config import ModelConfig
from resident.worker.model_runner import ModelRunner
from resident.worker.spec_decode.config import SpecConfig
from resident.worker.spec_decode.draft import DraftProposer
from resident.worker.spec_decode.ngram import NgramProposer
from resident.worker.spec_decode.runner import SpecDecodeRunner


def build_spec_runner(spec: SpecConfig, target: ModelRunner, draft_config: dict | None = None,
                      draft_weights: Mapping[str, torch.Tensor] | None = None, *, cuda_graphs: str = "lazy",
                      max_num_kv_blocks: int | None = None, seed: int | None = None) -> SpecDecodeRunner:
    """Wrap `target`: prompt lookup needs nothing more; a draft model gets a ModelRunner of
    its own over `draft_weights` with the target's engine config (same blocks)."""
    if spec.method == "ngram":
        proposer: DraftProposer | NgramProposer = NgramProposer(
            spec.num_speculative_tokens, spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min)
    else:
        if draft_config is None or draft_weights is None:
            raise ValueError(f"speculative decoding with draft model {spec.draft_model!r}: its weights are missing")
        draft = ModelRunner(ModelConfig.from_hf(draft_config), target.engine_config, draft_weights,
                            device=str(target.device), cuda_graphs=cuda_graphs,
                            max_num_kv_blocks=max_num_kv_blocks, kernel_backend="auto")
        proposer = DraftProposer(draft, seed=seed)
    return SpecDecodeRunner(target, proposer, seed=seed, num_speculative_tokens=spec.num_speculative_tokens)

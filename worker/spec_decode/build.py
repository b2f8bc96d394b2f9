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
    its own over `draft_weights` with the target's engine config (same blocks). `seed` (None:
    random) seeds the verifier's and the draft's generators for unseeded requests, each its own
    stream derived from it (`derived_seed`): `--seed` seeds the target's sampler with it too, and
    the rejection sampler's guarantee needs its draws independent of the draft's."""
    if spec.method == "ngram":
        proposer: DraftProposer | NgramProposer = NgramProposer(
            spec.num_speculative_tokens, spec.ngram_prompt_lookup_max, spec.ngram_prompt_lookup_min)
    else:
        if draft_config is None or draft_weights is None:
            raise ValueError(f"speculative decoding with draft model {spec.draft_model!r}: its weights are missing")
        draft = ModelRunner(ModelConfig.from_hf(draft_config), target.engine_config, draft_weights,
                            device=str(target.device), cuda_graphs=cuda_graphs,
                            max_num_kv_blocks=max_num_kv_blocks, kernel_backend="auto")
        proposer = DraftProposer(draft, seed=derived_seed(seed, 2))
    return SpecDecodeRunner(target, proposer, seed=derived_seed(seed, 1),
                            num_speculative_tokens=spec.num_speculative_tokens)


def derived_seed(seed: int | None, stream: int) -> int | None:
    """Seed number `stream` derived from `seed` (None stays None), in torch's range [0, 2**64)."""
    return None if seed is None else (seed + stream) % 2**64

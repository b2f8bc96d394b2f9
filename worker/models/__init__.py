"""Model registry: HF architecture name -> decoder class."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from resident.daemon.layout import ARCHITECTURES


def _registry() -> dict[str, type]:
    # Imported lazily and built per call: no module-level mutable state.
    from resident.worker.models.llama import LlamaForCausalLM

    return {arch: LlamaForCausalLM for arch in ARCHITECTURES}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_registry())


def get_model_class(architecture: str) -> type:
    registry = _registry()
    try:
        return registry[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(registry)}"
        ) from None


def build_model(model_config, weights: Mapping[str, torch.Tensor], **options):
    """The decoder for `model_config.architecture` over `weights` (referenced, not copied);
    `options` (kernels, max_position) go to the decoder."""
    return get_model_class(model_config.architecture)(model_config, weights, **options)

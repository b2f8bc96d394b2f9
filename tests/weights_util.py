"""Test helper: the engine-layout weights of an HF folder, fused with plain torch.cat.

Applies `resident.daemon.layout.plan` without the daemon's loader, so model tests do not
depend on it; fidelity tests also run through the real loader (`resident.daemon.loader`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from resident.daemon.layout import plan


def read_hf_folder(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, all HF tensors by name) of a local checkpoint folder."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return config, tensors


def fused_weights_from_hf_folder(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """name -> tensor in the engine layout (fused qkv_proj / gate_up_proj), cast to `dtype`."""
    config, tensors = read_hf_folder(path)
    out: dict[str, torch.Tensor] = {}
    for fused in plan(config, set(tensors)):
        parts = [tensors[s] for s in fused.sources]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        out[fused.name] = t.to(dtype).contiguous()
    return out

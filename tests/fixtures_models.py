"""Tiny random-weight checkpoints of real architectures, written with HF transformers.

Weights are initialised with a larger std than HF's default so logits are not flat (near
ties would make greedy comparisons meaningless).
"""
from __future__ import annotations

from pathlib import Path

ARCH_CONFIGS: dict[str, dict] = {
    "llama": dict(
        cls="LlamaConfig", model="LlamaForCausalLM",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        cls="LlamaConfig", model="LlamaForCausalLM",
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=256, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ),
    "qwen2": dict(
        cls="Qwen2Config", model="Qwen2ForCausalLM",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        cls="Qwen3Config", model="Qwen3ForCausalLM",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "mistral": dict(
        cls="MistralConfig", model="MistralForCausalLM",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False,
    ),
    "phi3": dict(   # qkv_proj and gate_up_proj stored fused
        cls="Phi3Config", model="Phi3ForCausalLM",
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
}


def make_tiny_model(path: Path, arch: str = "llama", *, dtype: str = "float32", seed: int = 0,
                    init_std: float = 0.15, max_shard_size: str | None = None, **overrides) -> Path:
    """Write a random-weight HF checkpoint (config.json + safetensors) to `path`."""
    import torch
    import transformers

    spec = dict(ARCH_CONFIGS[arch])
    cfg_cls = getattr(transformers, spec.pop("cls"))
    model_cls = getattr(transformers, spec.pop("model"))
    spec.update(overrides)
    config = cfg_cls(**spec, initializer_range=init_std)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path

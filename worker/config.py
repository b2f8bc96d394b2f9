"""ModelConfig: the model's shape and variants, read once from an HF `config.json`.

One frozen dataclass covers the Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3);
the decoder reads only this, never the raw dict. Both config spellings are accepted:
transformers 5 writes `rope_parameters` (holding `rope_theta` and the scaling type),
older checkpoints write `rope_theta` plus `rope_scaling` (with `type` or `rope_type`).

Sliding windows (Mistral, Qwen2/3 with `use_sliding_window`) are kept per layer and the
attention applies them exactly (keys with position > query position - window), so
`max_model_len` is not capped at the window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from resident.daemon.layout import ARCHITECTURES, check_architecture

#: Rope scaling types the rotary layer computes exactly as HF does.
ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    pass


def _positive(x: float) -> bool:
    """x > 0 and finite (NaN and inf pass a plain `<= 0` test)."""
    return math.isfinite(x) and x > 0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF semantics)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope scaling type {self.type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if not _positive(self.theta):
            raise ModelConfigError(f"rope_theta must be a finite number > 0, got {self.theta}")
        if self.type in ("linear", "llama3") and not _positive(self.factor):
            raise ModelConfigError(f"rope scaling factor must be a finite number > 0, got {self.factor}")
        if self.type == "llama3":
            if self.original_max_position_embeddings <= 0:
                raise ModelConfigError("llama3 rope scaling needs original_max_position_embeddings > 0")
            if not (0 < self.low_freq_factor < self.high_freq_factor and math.isfinite(self.high_freq_factor)):
                raise ModelConfigError(
                    f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.low_freq_factor} and {self.high_freq_factor}"
                )

    @classmethod
    def from_hf(cls, config: dict) -> "RopeConfig":
        params = config.get("rope_parameters")
        scaling = config.get("rope_scaling")
        if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
            raise ModelConfigError("per-layer-type rope_parameters are not supported by the Llama-family decoder")
        merged: dict = {}
        if isinstance(params, dict):
            merged.update(params)
        if isinstance(scaling, dict):
            merged.update({k: v for k, v in scaling.items() if k not in merged})
        theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
        rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
        if float(merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
            raise ModelConfigError("partial_rotary_factor != 1 is not supported by the Llama-family decoder")
        if rtype not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope scaling type {rtype!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        kw: dict = {"theta": float(theta), "type": rtype}
        if rtype in ("linear", "llama3"):
            if "factor" not in merged:
                raise ModelConfigError(f"rope scaling {rtype!r} without a 'factor'")
            kw["factor"] = float(merged["factor"])
        if rtype == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                if key not in merged:
                    raise ModelConfigError(f"llama3 rope scaling without {key!r}")
                kw[key] = float(merged[key])
            omax = merged.get("original_max_position_embeddings") or config.get("max_position_embeddings")
            kw["original_max_position_embeddings"] = int(omax or 0)
        return cls(**kw)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    #: q/k/v projections carry a bias (Qwen2; Llama/Qwen3 with attention_bias).
    qkv_bias: bool = False
    #: o_proj carries a bias (Llama/Qwen3 with attention_bias).
    o_bias: bool = False
    #: per-head RMSNorm of q and k before rotary (Qwen3).
    qk_norm: bool = False
    #: attention window per layer (None = full causal attention).
    sliding_windows: tuple[int | None, ...] = ()
    #: the checkpoint's own dtype name as config.json states it (informational: the model
    #: computes in the dtype of the weights it is given).
    dtype: str = "float32"
    #: > 1: a rank-local config (`for_tp`): heads, kv heads and intermediate size are this
    #: rank's share; vocab_size stays the full vocabulary.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not _positive(self.rms_norm_eps):
            raise ModelConfigError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps}")
        if len(self.sliding_windows) != self.num_layers:
            raise ModelConfigError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            raise ModelConfigError(f"sliding windows must be > 0, got {self.sliding_windows}")
        if self.tensor_parallel_size < 1 or self.vocab_size % self.tensor_parallel_size:
            raise ModelConfigError(f"tensor_parallel_size {self.tensor_parallel_size} must be >= 1 and divide "
                                   f"vocab_size {self.vocab_size}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ModelConfigError(f"dtype must be a dtype name, got {self.dtype!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def for_tp(self, size: int) -> "ModelConfig":
        """The rank-local config of a tensor-parallel group of `size` ranks: heads, kv heads
        and intermediate size divided (what each rank computes and caches); vocab_size stays
        the full vocabulary (each rank holds vocab_size / size rows of the embedding and
        lm_head, `vocab_shard_size`)."""
        if self.tensor_parallel_size != 1:
            raise ModelConfigError(f"for_tp({size}) of a config that is already rank-local "
                                   f"(tensor_parallel_size {self.tensor_parallel_size})")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ModelConfigError(f"tensor-parallel size must be an integer >= 1, got {size!r}")
        if size == 1:
            return self
        for field, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                             ("intermediate_size", self.intermediate_size), ("vocab_size", self.vocab_size)):
            if value % size:
                raise ModelConfigError(
                    f"--tensor-parallel-size {size} does not divide the model's {field} ({value}); use a size "
                    f"that divides its heads ({self.num_heads}), kv heads ({self.num_kv_heads}), "
                    f"intermediate size ({self.intermediate_size}) and vocabulary ({self.vocab_size})")
        return replace(self, num_heads=self.num_heads // size, num_kv_heads=self.num_kv_heads // size,
                       intermediate_size=self.intermediate_size // size, tensor_parallel_size=size)

    @property
    def vocab_shard_size(self) -> int:
        """Rows of the embedding and lm_head this rank holds (vocab-parallel)."""
        return self.vocab_size // self.tensor_parallel_size

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """Build from a parsed HF `config.json`; fails naming what is unsupported."""
        try:
            arch = check_architecture(config)
        except ValueError as e:
            raise ModelConfigError(str(e)) from None
        act = config.get("hidden_act", config.get("hidden_activation", "silu"))
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported; the Llama-family decoder uses 'silu'")
        if config.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported by the Llama-family layout")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            num_layers = int(config["num_hidden_layers"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            attention_bias = bool(config.get("attention_bias", False))
            qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
            o_bias = attention_bias and arch != "Qwen2ForCausalLM"
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
            return cls(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=RopeConfig.from_hf(config),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                qk_norm=arch == "Qwen3ForCausalLM",
                sliding_windows=_sliding_windows(config, arch, num_layers),
                dtype=dtype,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks required field {e.args[0]!r}") from None


def _sliding_windows(config: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer attention windows with HF's semantics for each architecture."""
    window = config.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not config.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * num_layers
    window = int(window)
    layer_types = config.get("layer_types")
    if layer_types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(config.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        return (window,) * num_layers
    if len(layer_types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelConfigError(f"layer types {unknown} are not supported; supported: sliding_attention, full_attention")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)

"""Layout rules: how a checkpoint's tensors are stored in the daemon, per model family.

The daemon stores weights in the layout the engine computes with, so attaching costs no
copy: for the Llama family q/k/v projections are concatenated into one `qkv_proj` and
gate/up into one `gate_up_proj` (along the output dimension, in that order). The engine
(worker/) imports these names from here; the daemon never imports the worker.

Bump LAYOUT_VERSION whenever the stored layout changes: it is part of the model key, so a
worker never attaches weights laid out for a different engine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

LAYOUT_FAMILY = "llama"
LAYOUT_VERSION = 1
LAYOUT = f"{LAYOUT_FAMILY}/{LAYOUT_VERSION}"

#: HF architectures served by the Llama-family decoder.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM")

# HF tensors that carry no weights the engine needs.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class FusedTensor:
    """One tensor as stored: the concatenation (dim 0) of `sources`, in order."""

    name: str
    sources: tuple[str, ...]
    #: A linear weight that fp8 quantization applies to (norms, embeddings, lm_head and
    #: biases stay in their dtype).
    quantizable: bool = False


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def check_architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise LayoutError(
            f"config.json: architectures is {archs!r}; it must be a list of class names such as "
            f"[\"LlamaForCausalLM\"] (supported: {', '.join(ARCHITECTURES)}); fix config.json or re-download it"
        )
    for a in archs:
        if a in ARCHITECTURES:
            return a
    raise LayoutError(
        f"unsupported architecture {archs or config.get('model_type')!r}; supported: {', '.join(ARCHITECTURES)}"
    )


def check_unquantized(config: dict) -> None:
    """Refuse a pre-quantized checkpoint (fp8, GPTQ, AWQ, ...): its tensors (`*.weight_scale`,
    `qweight`, ...) would otherwise fail as unknown or missing, which points at the wrong fix."""
    key = next((k for k in ("quantization_config", "compression_config") if config.get(k)), None)
    if key is not None:
        method = config[key].get("quant_method") if isinstance(config[key], dict) else None
        raise LayoutError(
            f"config.json describes a pre-quantized checkpoint ({key}"
            + (f" quant_method {method!r}" if method else "") + "); resident loads unquantized floating-point "
            "checkpoints (F32, F16, BF16) and quantizes while loading: load the original checkpoint, with "
            "--quantization fp8_per_tensor for fp8 weights"
        )


def config_int(config: dict, key: str, default: int | None = None) -> int:
    """config.json's positive integer `key`; with a `default`, that when the field is absent,
    null or 0 (as the worker's `config.get(key) or default`). Fails (LayoutError) naming the
    field when it is missing or not a positive integer, so a broken config never reaches a
    bare int() or a loop over its layers."""
    value = config.get(key)
    if default is not None and not value:
        return default
    if value is None:
        raise LayoutError(f"config.json has no {key!r}, which layout {LAYOUT} needs; the model folder's "
                          "config.json is incomplete: re-download it or add the field")
    number = _as_int(value)
    if number is None or number <= 0:
        raise LayoutError(f"config.json: {key} is {value!r}, not a positive integer; fix config.json (it must "
                          "describe these weights) or re-download it")
    return number


def _as_int(value: object) -> int | None:
    """`value` as an int where the worker's int() reads it as one (an int, an integral float,
    a string of digits); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def head_dim(config: dict) -> int:
    return config_int(config, "head_dim", 0) or (
        config_int(config, "hidden_size") // config_int(config, "num_attention_heads"))


def plan(config: dict, names: set[str]) -> list[FusedTensor]:
    """The stored tensors for a checkpoint with HF tensor `names`, in storage order.

    Fails (LayoutError) on a missing tensor, and on an unexpected one rather than
    silently dropping weights.
    """
    check_architecture(config)
    check_unquantized(config)
    num_layers = config_int(config, "num_hidden_layers")
    present = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    if num_layers > len(present):
        # Checked before the loop below, which an absurd layer count would make endless.
        raise LayoutError(
            f"config.json says num_hidden_layers={num_layers}, but the checkpoint holds tensors of "
            f"{len(present)} layer(s); the config and the weights do not belong together"
        )
    out: list[FusedTensor] = [FusedTensor("model.embed_tokens.weight", ("model.embed_tokens.weight",))]
    for i in range(num_layers):
        p = layer_prefix(i)
        a, m = f"{p}.self_attn", f"{p}.mlp"
        out.append(FusedTensor(f"{p}.input_layernorm.weight", (f"{p}.input_layernorm.weight",)))
        # Phi-3 checkpoints store qkv_proj and gate_up_proj already fused, in this layout's order.
        qkv = (f"{a}.qkv_proj.weight",) if f"{a}.qkv_proj.weight" in names else tuple(
            f"{a}.{x}_proj.weight" for x in "qkv")
        out.append(FusedTensor(f"{a}.qkv_proj.weight", qkv, quantizable=True))
        if f"{a}.q_proj.bias" in names:
            out.append(FusedTensor(f"{a}.qkv_proj.bias", tuple(f"{a}.{x}_proj.bias" for x in "qkv")))
        if f"{a}.q_norm.weight" in names:
            out.append(FusedTensor(f"{a}.q_norm.weight", (f"{a}.q_norm.weight",)))
            out.append(FusedTensor(f"{a}.k_norm.weight", (f"{a}.k_norm.weight",)))
        out.append(FusedTensor(f"{a}.o_proj.weight", (f"{a}.o_proj.weight",), quantizable=True))
        if f"{a}.o_proj.bias" in names:
            out.append(FusedTensor(f"{a}.o_proj.bias", (f"{a}.o_proj.bias",)))
        out.append(FusedTensor(f"{p}.post_attention_layernorm.weight", (f"{p}.post_attention_layernorm.weight",)))
        gate_up = (f"{m}.gate_up_proj.weight",) if f"{m}.gate_up_proj.weight" in names else (
            f"{m}.gate_proj.weight", f"{m}.up_proj.weight")
        out.append(FusedTensor(f"{m}.gate_up_proj.weight", gate_up, quantizable=True))
        out.append(FusedTensor(f"{m}.down_proj.weight", (f"{m}.down_proj.weight",), quantizable=True))
    out.append(FusedTensor("model.norm.weight", ("model.norm.weight",)))
    tied = bool(config.get("tie_word_embeddings", False))
    if not tied:
        out.append(FusedTensor("lm_head.weight", ("lm_head.weight",)))

    used = {s for f in out for s in f.sources}
    missing = sorted(used - names)
    if missing:
        raise LayoutError(
            f"checkpoint is missing {len(missing)} tensor(s) required by layout {LAYOUT}, e.g. {missing[:3]}"
        )
    extra = sorted(n for n in names - used if not _IGNORED.match(n) and not (tied and n == "lm_head.weight"))
    if extra:
        raise LayoutError(
            f"checkpoint has {len(extra)} tensor(s) that layout {LAYOUT} does not know, e.g. {extra[:3]}; "
            f"is the architecture in config.json right?"
        )
    return out


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Shapes (HF names) implied by config.json, to catch a checkpoint that does not match."""
    h = config_int(config, "hidden_size")
    nh = config_int(config, "num_attention_heads")
    nkv = config_int(config, "num_key_value_heads", 0) or nh
    d = head_dim(config)
    inter = config_int(config, "intermediate_size")
    vocab = config_int(config, "vocab_size")
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(config_int(config, "num_hidden_layers")):
        p = layer_prefix(i)
        a, m = f"{p}.self_attn", f"{p}.mlp"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{a}.q_proj.weight": (nh * d, h),
            f"{a}.k_proj.weight": (nkv * d, h),
            f"{a}.v_proj.weight": (nkv * d, h),
            f"{a}.q_proj.bias": (nh * d,),
            f"{a}.k_proj.bias": (nkv * d,),
            f"{a}.v_proj.bias": (nkv * d,),
            f"{a}.o_proj.weight": (h, nh * d),
            f"{a}.o_proj.bias": (h,),
            f"{a}.q_norm.weight": (d,),
            f"{a}.k_norm.weight": (d,),
            f"{m}.gate_proj.weight": (inter, h),
            f"{m}.up_proj.weight": (inter, h),
            f"{a}.qkv_proj.weight": ((nh + 2 * nkv) * d, h),   # Phi-3: stored fused
            f"{m}.gate_up_proj.weight": (2 * inter, h),
            f"{m}.down_proj.weight": (h, inter),
        })
    return shapes


def check_shapes(config: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail if a checkpoint tensor's shape disagrees with config.json."""
    want = expected_shapes(config)
    for name, shape in shapes.items():
        if name in want and tuple(shape) != want[name]:
            raise LayoutError(
                f"tensor {name} has shape {tuple(shape)} but config.json implies {want[name]}; "
                f"the config and the weights do not belong together"
            )

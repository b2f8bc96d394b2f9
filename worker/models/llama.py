"""The one Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) over the fused layout.

Variants are options read from ModelConfig: qkv/o biases, Qwen3's per-head q/k RMSNorm,
per-layer sliding windows, tied embeddings, rope scaling. Weights are the stored tensors
named as in `resident.daemon.layout` (fused `qkv_proj` = [q; k; v] and `gate_up_proj` =
[gate; up] along the output dim), referenced as given — zero-copy views of daemon memory
are never copied, converted or written. Computation runs in the dtype of the
non-quantized tensors; fp8 linears quantize their activations on the fly.

Norms, rotary + KV-cache write, SiLU-and-mul, paged attention and the fp8 GEMM run through
one `Kernels` backend (`worker/kernels`): Triton on a GPU, the PyTorch reference layers on
CPU (and as the fallback). The rotary cos/sin table covers `max_position` positions.

Tensor parallelism (`parallel` = this rank's `worker.distributed.ParallelGroup`, weights
sharded by `resident.daemon.sharding`, `config` rank-local from `ModelConfig.for_tp`): the
rank computes its heads and its slice of the MLP; o_proj and down_proj are row-parallel,
so their partial sums are all-reduced (o_proj's bias, whole on every rank, is added once
after the all-reduce); the embedding is vocab-parallel (rows outside this rank's range
give zeros, then all-reduce) and so is lm_head (local logits all-gathered to the full
vocabulary). With `parallel` None or of size 1 nothing of this runs.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from resident.daemon.layout import layer_prefix
from resident.worker.config import ModelConfig
from resident.worker.kernels.dispatch import Kernels, get_kernels
from resident.worker.kernels.reference import build_cos_sin_cache
from resident.worker.layers.attention import AttentionMetadata
from resident.worker.layers.linear import FP8_DTYPE, Fp8PerTensorLinear, make_linear
from resident.worker.layers.rotary import compute_inv_freq

logger = logging.getLogger(__name__)


class WeightsError(ValueError):
    pass


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Stored (fused) tensor names and shapes this decoder needs, quantization aside."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    vocab = config.vocab_shard_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(config.num_layers):
        p = layer_prefix(i)
        a, m = f"{p}.self_attn", f"{p}.mlp"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{a}.qkv_proj.weight"] = (config.q_size + 2 * config.kv_size, h)
        if config.qkv_bias:
            shapes[f"{a}.qkv_proj.bias"] = (config.q_size + 2 * config.kv_size,)
        if config.qk_norm:
            shapes[f"{a}.q_norm.weight"] = (d,)
            shapes[f"{a}.k_norm.weight"] = (d,)
        shapes[f"{a}.o_proj.weight"] = (h, config.q_size)
        if config.o_bias:
            shapes[f"{a}.o_proj.bias"] = (h,)
        shapes[f"{m}.gate_up_proj.weight"] = (2 * inter, h)
        shapes[f"{m}.down_proj.weight"] = (h, inter)
    return shapes


def check_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """Validate names, shapes and dtypes; return the activation dtype."""
    want = expected_shapes(config)
    missing = sorted(set(want) - set(weights))
    if missing:
        raise WeightsError(
            f"weights lack {len(missing)} tensor(s) the {config.architecture} decoder needs, e.g. {missing[:3]}; "
            f"were they loaded with the right layout and config?"
        )
    scales = {n for n in weights if n.endswith(".weight_scale")}
    extra = sorted(set(weights) - set(want) - scales)
    if extra:
        raise WeightsError(f"weights hold {len(extra)} tensor(s) this config does not use, e.g. {extra[:3]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise WeightsError(f"{name} has shape {tuple(weights[name].shape)}, the config implies {shape}")
    act = weights["model.embed_tokens.weight"].dtype
    if act not in (torch.float32, torch.float16, torch.bfloat16):
        raise WeightsError(f"model.embed_tokens.weight is {act}; activations must be float32, float16 or bfloat16")
    for name in want:
        t = weights[name]
        quantized = t.dtype == FP8_DTYPE and f"{name.removesuffix('.weight')}.weight_scale" in scales
        if t.dtype != act and not quantized:
            raise WeightsError(f"{name} is {t.dtype} but the model computes in {act}; mixed dtypes are not supported")
    return act


class LlamaDecoderLayer:
    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], index: int,
                 rope_table: torch.Tensor, kernels: Kernels, parallel: Any = None,
                 add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """`add_norm(x, residual, weight) -> (normed, x + residual)`: under TP, x is this
        rank's partial sum and add_norm all-reduces it first (see ReduceAddNorm); None: the
        kernels' fused_add_rms_norm."""
        p = layer_prefix(index)
        a, m = f"{p}.self_attn", f"{p}.mlp"
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.sliding_window = config.sliding_windows[index]
        self.rope_table = rope_table
        self.kernels = kernels
        self.add_norm = add_norm if add_norm is not None else partial(kernels.fused_add_rms_norm, eps=config.rms_norm_eps)
        self.input_layernorm = weights[f"{p}.input_layernorm.weight"]
        self.post_attention_layernorm = weights[f"{p}.post_attention_layernorm.weight"]
        self.qkv_proj = make_linear(weights, f"{a}.qkv_proj", kernels=kernels)
        self.parallel = parallel
        self.o_bias = None
        if parallel is None:
            self.o_proj = make_linear(weights, f"{a}.o_proj", kernels=kernels)
        else:
            # The bias is added once, after the partial sums are reduced.
            self.o_bias = weights.get(f"{a}.o_proj.bias")
            o_weights = {k: v for k, v in weights.items()
                         if k in (f"{a}.o_proj.weight", f"{a}.o_proj.weight_scale")}
            self.o_proj = make_linear(o_weights, f"{a}.o_proj", kernels=kernels)
        self.q_norm = weights[f"{a}.q_norm.weight"] if config.qk_norm else None
        self.k_norm = weights[f"{a}.k_norm.weight"] if config.qk_norm else None
        self.gate_up_proj = make_linear(weights, f"{m}.gate_up_proj", kernels=kernels)
        self.down_proj = make_linear(weights, f"{m}.down_proj", kernels=kernels)
        #: The norms and SiLU-and-mul emit the fp8 inputs of qkv_proj, gate_up_proj and down_proj
        #: (`forward_fp8`): fp8_per_tensor linears, kernels that have the fused ops, and the plain
        #: add + norm (a custom add_norm, TP's all-reduce, must see the normed activations).
        self.fuse_fp8_quant = (add_norm is None and parallel is None
                               and kernels.fused_add_rms_norm_fp8 is not None and kernels.silu_and_mul_fp8 is not None
                               and all(isinstance(lin, Fp8PerTensorLinear)
                                       for lin in (self.qkv_proj, self.gate_up_proj, self.down_proj)))
        #: ... and paged attention emits o_proj's fp8 input (`Kernels.paged_attention_fp8`).
        self.fuse_o_quant = (self.fuse_fp8_quant and kernels.paged_attention_fp8 is not None
                             and self.o_bias is None and isinstance(self.o_proj, Fp8PerTensorLinear))

    def attention(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
                  kv_cache: torch.Tensor, quantized_o: bool = False) -> torch.Tensor:
        """Attention from qkv_proj's output [T, q_size + 2 * kv_size], through o_proj; `quantized_o`:
        the attention kernels quantize o_proj's fp8 input (`fuse_o_quant`)."""
        t = qkv.shape[0]
        kern = self.kernels
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = kern.rms_norm(q, self.q_norm, self.eps), kern.rms_norm(k, self.k_norm, self.eps)
        # The rotation and KV write inside the attention where the backend has it, else before it.
        fused = kern.rotary_paged_attention_fp8 if quantized_o else kern.rotary_paged_attention
        if fused is not None:
            out = fused(positions, q, k, v, self.rope_table, kv_cache, meta, self.scale, self.sliding_window)
        else:
            q = kern.rotary_kv_write(positions, q, k, v, self.rope_table, kv_cache, meta.slot_mapping)
            attend = kern.paged_attention_fp8 if quantized_o else kern.paged_attention
            out = attend(q, kv_cache, meta, self.scale, self.sliding_window)
        if quantized_o:   # out is (x_q, scale_a)
            return self.o_proj.apply_quantized(*out, qkv.dtype)
        out = self.o_proj(out.reshape(t, self.q_size))
        if self.o_bias is not None:   # TP: reduce here, so the bias is added once
            out = self.parallel.all_reduce(out) + self.o_bias
        return out   # under TP (without o_proj bias): this rank's partial sum

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                 meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fuse_fp8_quant:
            return self.forward_fp8(positions, hidden, residual, meta, kv_cache)
        kern = self.kernels
        if residual is None:
            residual = hidden
            hidden = kern.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = self.add_norm(hidden, residual, self.input_layernorm)
        hidden = self.attention(positions, self.qkv_proj(hidden), meta, kv_cache)
        if self.o_bias is not None:   # already reduced
            hidden, residual = kern.fused_add_rms_norm(hidden, residual, self.post_attention_layernorm, self.eps)
        else:
            hidden, residual = self.add_norm(hidden, residual, self.post_attention_layernorm)
        # Under TP a partial sum: the next layer's (or the final) add_norm reduces it.
        return self.down_proj(kern.silu_and_mul(self.gate_up_proj(hidden))), residual

    def forward_fp8(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                    meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`__call__` with the fp8 activation quantization of qkv_proj, gate_up_proj and down_proj
        done by the kernels producing their inputs: bit for bit the same (each fused op is its
        unfused pair, then the linear's own quantization), one launch less per linear — in a
        decode step these launches cost latency, not bandwidth. o_proj's input comes quantized from
        the attention kernels (`Kernels.paged_attention_fp8`: on a GPU, decode skips the maximum pass)."""
        kern, dtype = self.kernels, hidden.dtype
        x_q, scale, residual = kern.fused_add_rms_norm_fp8(hidden, residual, self.input_layernorm, self.eps)
        hidden = self.attention(positions, self.qkv_proj.apply_quantized(x_q, scale, dtype), meta, kv_cache,
                                quantized_o=self.fuse_o_quant)
        x_q, scale, residual = kern.fused_add_rms_norm_fp8(hidden, residual, self.post_attention_layernorm, self.eps)
        x_q, scale = kern.silu_and_mul_fp8(self.gate_up_proj.apply_quantized(x_q, scale, dtype))
        return self.down_proj.apply_quantized(x_q, scale, dtype), residual


class ReduceAddNorm:
    """add_norm under TP: all-reduce this rank's partial, add the residual, RMSNorm. Decode-size
    16-bit batches on GPUs take the fused one-shot CUDA-IPC kernel (`fused`), the rest NCCL
    (or gloo) followed by the fused add + norm kernel."""

    def __init__(self, parallel: Any, kernels: Kernels, eps: float, fused: Any = None) -> None:
        self.parallel, self.kernels, self.eps, self.fused = parallel, kernels, eps, fused

    def __call__(self, x: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and self.fused.handles(x) and weight.dtype == x.dtype:
            return self.fused.all_reduce_add_rms_norm(x, residual, weight, self.eps)
        return self.kernels.fused_add_rms_norm(self.parallel.all_reduce(x), residual, weight, self.eps)


class LlamaForCausalLM:
    """forward(input_ids [T], positions [T], attn_metadata, kv_caches) -> hidden [T, H]."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], kernels: Kernels | None = None,
                 max_position: int | None = None, parallel: Any = None) -> None:
        """`kernels`: default get_kernels(weights' device); `max_position`: rotary table length
        (default max_position_embeddings; the runner passes max(that, max_model_len));
        `parallel`: the tensor-parallel group (None: TP=1)."""
        self.config = config
        tp = parallel.size if parallel is not None else 1
        if tp != config.tensor_parallel_size:
            raise ValueError(f"a tensor-parallel group of {tp} rank(s) needs the rank-local config "
                             f"ModelConfig.for_tp({tp}); got one for {config.tensor_parallel_size}")
        #: None at TP=1: the single-GPU path runs no collective and no masking.
        self.parallel = parallel if tp > 1 else None
        self.vocab_start = parallel.rank * config.vocab_shard_size if self.parallel is not None else 0
        self.dtype = check_weights(config, weights)
        self.device = weights["model.embed_tokens.weight"].device
        self.kernels = kernels if kernels is not None else get_kernels(self.device)
        positions = max(max_position or 0, config.max_position_embeddings)
        # Computed on the CPU and copied: on a GPU each of the table's few elementwise ops would
        # be its kernel's first launch in the process (a lazy module load each, 0.1 s in all
        # on the H200's start-up path), for a table that is computed once.
        self.rope_table = build_cos_sin_cache(compute_inv_freq(config.rope, config.head_dim), positions,
                                              self.dtype).to(self.device)
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.fused_allreduce = None
        if self.parallel is not None and self.parallel.custom_allreduce and self.device.type == "cuda" \
                and self.dtype in (torch.float16, torch.bfloat16):
            from resident.worker.custom_allreduce import CustomAllReduce

            self.fused_allreduce = CustomAllReduce(self.parallel, config.hidden_size, self.dtype, self.device)
        self.add_norm = (partial(self.kernels.fused_add_rms_norm, eps=config.rms_norm_eps) if self.parallel is None
                         else ReduceAddNorm(self.parallel, self.kernels, config.rms_norm_eps, self.fused_allreduce))
        self.layers = [LlamaDecoderLayer(config, weights, i, self.rope_table, self.kernels, self.parallel,
                                         None if self.parallel is None else self.add_norm)
                       for i in range(config.num_layers)]
        self.norm = weights["model.norm.weight"]
        self.eps = config.rms_norm_eps
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else weights["lm_head.weight"]
        methods = {layer.qkv_proj.name for layer in self.layers}
        logger.debug("built %s: %d layers, %s, linear %s, kernels %s", config.architecture, config.num_layers,
                     self.dtype, ",".join(sorted(methods)), self.kernels.backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden = self.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, attn_metadata, kv_cache)
        hidden, _ = self.add_norm(hidden, residual, self.norm)
        return hidden

    __call__ = forward

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H]; vocab-parallel under TP (each rank looks up its own range)."""
        if self.parallel is None:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.config.vocab_shard_size)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
        return self.parallel.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, H] (the full vocabulary on every rank);
        with float32=False in the model's dtype, as the LM head computed them (decode graphs:
        greedy sampling reads them so, and `ModelRunner.forward_logits` converts them otherwise)."""
        logits = self.kernels.linear(hidden, self.lm_head)
        if self.parallel is not None:
            logits = self.parallel.all_gather(logits, dim=-1)
        return logits.to(torch.float32) if float32 else logits

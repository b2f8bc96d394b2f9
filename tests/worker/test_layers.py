"""Reference layers: each against HF transformers' own implementation or a dense oracle."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from resident.daemon.quant import quantize_fp8_per_tensor
from resident.worker.config import RopeConfig
from resident.worker.layers.activation import silu_and_mul
from resident.worker.layers.attention import AttentionMetadata, causal_attention, paged_attention
from resident.worker.layers.linear import (
    FP8_DTYPE, Fp8PerTensorLinear, UnquantizedLinear, fp8_scaled_mm_reference, make_linear,
    quantize_fp8_per_tensor_dynamic,
)
from resident.worker.layers.norm import RMSNorm
from resident.worker.layers.rotary import RotaryEmbedding, compute_inv_freq

transformers = pytest.importorskip("transformers")


# --- linear ----------------------------------------------------------------------------
def _fp8_weights(out_f: int = 48, in_f: int = 64, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    q, scale = quantize_fp8_per_tensor(w)
    weights = {"l.weight": q, "l.weight_scale": scale}
    if bias:
        weights["l.bias"] = torch.randn(out_f, generator=g)
    return w, weights


def test_linear_method_follows_the_weights_present() -> None:
    w, fp8 = _fp8_weights()
    assert isinstance(make_linear(fp8, "l"), Fp8PerTensorLinear)
    assert isinstance(make_linear({"l.weight": w}, "l"), UnquantizedLinear)
    with pytest.raises(ValueError, match="valid: fp8_per_tensor, unquantized"):
        make_linear({"l.weight": w}, "l", method="int4")
    with pytest.raises(ValueError, match="without a l.weight_scale"):
        make_linear({"l.weight": fp8["l.weight"]}, "l")


def test_unquantized_linear_is_f_linear() -> None:
    w, b, x = torch.randn(8, 16), torch.randn(8), torch.randn(5, 16)
    assert torch.equal(make_linear({"l.weight": w, "l.bias": b}, "l")(x), F.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float_matmul_within_fp8_error(dtype: torch.dtype) -> None:
    w, weights = _fp8_weights()
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    layer = make_linear(weights, "l")
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 7, 48)
    exact = F.linear(x.float(), w, weights["l.bias"])
    rel = (y.float() - exact).norm() / exact.norm()
    # e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4) on both operands.
    assert 1e-4 < rel < 0.05, rel


def test_fp8_linear_does_exactly_the_scaled_mm_steps() -> None:
    _, weights = _fp8_weights()
    x = torch.randn(9, 64) * 3
    scale_a = x.abs().amax() / 448.0
    x_q = (x / scale_a).clamp(-448, 448).to(FP8_DTYPE)
    expected = (x_q.float() @ weights["l.weight"].float().T) * (scale_a * weights["l.weight_scale"]) + weights["l.bias"]
    assert torch.equal(make_linear(weights, "l")(x), expected)
    q, s = quantize_fp8_per_tensor_dynamic(x)
    assert torch.equal(q.view(torch.uint8), x_q.view(torch.uint8)) and torch.equal(s, scale_a)


def test_fp8_linear_of_zero_input_is_the_bias() -> None:
    _, weights = _fp8_weights()
    y = make_linear(weights, "l")(torch.zeros(2, 64))
    assert torch.equal(y, weights["l.bias"].expand(2, -1))


@pytest.mark.gpu
def test_fp8_reference_is_the_scaled_mm_oracle() -> None:
    _, weights = _fp8_weights(out_f=64, in_f=128)
    dev = "cuda"
    x = torch.randn(32, 128, device=dev, dtype=torch.bfloat16)
    w_q, s_w, bias = (weights[k].to(dev) for k in ("l.weight", "l.weight_scale", "l.bias"))
    x_q, s_a = quantize_fp8_per_tensor_dynamic(x)
    ref = fp8_scaled_mm_reference(x_q, s_a, w_q, s_w, bias.bfloat16(), torch.bfloat16)
    got = torch._scaled_mm(x_q, w_q.t(), scale_a=s_a, scale_b=s_w, bias=bias.bfloat16(), out_dtype=torch.bfloat16)
    # Equal up to bf16 rounding and the tensor cores' fp8 accumulation (measured on an
    # H200, torch 2.11: ~2e-4 of the output's scale with float32 output).
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


# --- rotary ----------------------------------------------------------------------------
ROPES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, RopeConfig(theta=10000.0)),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
               RopeConfig(theta=10000.0, type="linear", factor=4.0)),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
}


def _hf_inv_freq(params: dict, head_dim: int = 128) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                      max_position_embeddings=131072, rope_parameters=dict(params))
    if params["rope_type"] == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")[0]


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_inv_freq_equals_hf(kind: str) -> None:
    params, rope = ROPES[kind]
    ours = compute_inv_freq(rope, 128)
    theirs = _hf_inv_freq(params)
    assert torch.equal(ours, theirs)
    if kind == "llama3":   # high frequencies kept, low ones divided by the factor
        base = compute_inv_freq(RopeConfig(theta=500000.0), 128)
        assert torch.equal(ours[:4], base[:4])
        assert torch.allclose(ours[-1] * 8.0, base[-1])


def test_rotary_application_equals_hf() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = RotaryEmbedding(ROPES["llama3"][1], 64)
    positions = torch.tensor([0, 1, 5, 17, 900, 4000])
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    ours_q, ours_k = rope(positions, q, k)
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1)) and torch.equal(ours_k, hf_k[0].transpose(0, 1))


# --- norm and activation ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_and_residual_variant_adds_first(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(32))
    weight = hf.weight.detach().to(dtype)
    hf = hf.to(dtype)
    norm = RMSNorm(weight, 1e-5)
    x, r = torch.randn(5, 32).to(dtype), torch.randn(5, 32).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), hf(x))
        normed, residual = norm(x, r)
        assert torch.equal(residual, r + x)
        assert torch.equal(normed, hf(r + x))


def test_silu_and_mul_equals_hf_mlp_activation() -> None:
    gate, up = torch.randn(3, 10), torch.randn(3, 10)
    # Equal up to the last bit or so: on CPU, silu of a strided half and of a contiguous tensor can
    # take the vectorized and the scalar exp for the same element (a flaky torch.equal before).
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], -1)), F.silu(gate) * up, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5))


# --- paged attention -------------------------------------------------------------------
def _dense_reference(q, k, v, scale, window=None):
    """Plain masked softmax attention over one whole sequence (float64 oracle)."""
    t, hq, _ = q.shape
    rep = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    i = torch.arange(t)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cached", [
    [0, 3, 9, 0, 21],       # prefill, chunked prefill and decode mixed in one batch
    [0, 6, 12, 3, 21],      # decodes only (batched), one of them the first token of its sequence
])
def test_paged_attention_equals_dense_causal_attention(window: int | None, cached: list[int]) -> None:
    """Tokens already in the cache are written by an earlier step; the cache starts as NaN,
    so any read outside a sequence's own slots would show."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, block_size, num_blocks = 6, 2, 16, 4, 40
    lens = [1, 7, 13, 4, 22]            # odd lengths, one single-token sequence
    blocks = list(range(num_blocks))
    random.Random(1).shuffle(blocks)
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(blocks[used:used + need])
        used += need
    seqs = [(torch.randn(n, hq, d, generator=g), torch.randn(n, hkv, d, generator=g),
             torch.randn(n, hkv, d, generator=g)) for n in lens]
    kv_cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"))

    def slots(i, positions):
        return [tables[i][p // block_size] * block_size + p % block_size for p in positions]

    def meta(parts):  # parts: (seq index, first position, end position)
        qsl = [0]
        for _, a, b in parts:
            qsl.append(qsl[-1] + b - a)
        width = max(len(tables[i]) for i, _, _ in parts)
        bt = torch.zeros(len(parts), width, dtype=torch.int64)
        for row, (i, _, _) in enumerate(parts):
            bt[row, :len(tables[i])] = torch.tensor(tables[i])
        return AttentionMetadata(
            slot_mapping=torch.tensor([s for i, a, b in parts for s in slots(i, range(a, b))]),
            query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor([b for _, _, b in parts]), block_tables=bt)

    def run(parts):
        q = torch.cat([seqs[i][0][a:b] for i, a, b in parts])
        k = torch.cat([seqs[i][1][a:b] for i, a, b in parts])
        v = torch.cat([seqs[i][2][a:b] for i, a, b in parts])
        return paged_attention(q, k, v, kv_cache, meta(parts), d ** -0.5, window)

    first = [(i, 0, c) for i, c in enumerate(cached) if c]
    run(first)
    second = [(i, c, n) for i, (c, n) in enumerate(zip(cached, lens))]
    out = run(second)
    offset = 0
    for i, (c, n) in enumerate(zip(cached, lens)):
        want = _dense_reference(*seqs[i], d ** -0.5, window)[c:n]
        torch.testing.assert_close(out[offset:offset + n - c].double(), want, rtol=1e-5, atol=1e-5)
        offset += n - c


def test_causal_attention_rejects_mismatched_heads() -> None:
    with pytest.raises(ValueError, match="multiple"):
        causal_attention(torch.randn(2, 5, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8),
                         torch.arange(2), torch.arange(2), 0.3)

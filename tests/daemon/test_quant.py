"""fp8_per_tensor: vLLM's per-tensor fp8, one scale per stored (fused) weight, within fp8 error."""
from __future__ import annotations

import pytest
import torch

from resident.daemon import quant
from resident.daemon.layout import plan
from resident.daemon.loader import LoadSpec, load
from resident.daemon.memory.host_shm import HostShmBackend
from weights_util import read_hf_folder


def vllm_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().max().float().clamp(min=1e-12) / 448.0)
    return (w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="none, fp8_per_tensor"):
        quant.check_quantization("int4")
    with pytest.raises(ValueError, match="auto, bfloat16, float16, float32"):
        quant.check_dtype("fp16")
    with pytest.raises(ValueError, match="valid quantizations"):
        LoadSpec("/x", quantization="awq")
    with pytest.raises(ValueError, match="valid dtypes"):
        LoadSpec("/x", dtype="float64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_vllm_formula(dtype):
    torch.manual_seed(0)
    w = (torch.randn(96, 80) * 0.05).to(dtype)
    q, scale = quant.quantize_fp8_per_tensor(w)
    rq, rscale = vllm_reference(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert torch.equal(scale, rscale)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_chunked_quantization_equals_unchunked(monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(1000, 37)
    whole, s1 = quant.quantize_fp8_per_tensor(w)
    monkeypatch.setattr(quant, "_CHUNK_NUMEL", 1000)
    chunked, s2 = quant.quantize_fp8_per_tensor(w)
    assert torch.equal(s1, s2) and torch.equal(whole.view(torch.uint8), chunked.view(torch.uint8))


def test_error_within_fp8_bounds():
    torch.manual_seed(2)
    w = torch.randn(256, 256) * 0.1
    q, scale = quant.quantize_fp8_per_tensor(w)
    deq = quant.dequantize_fp8(q, scale)
    err = (deq - w).abs()
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4; subnormals add ~scale*2^-9.
    assert bool((err <= w.abs() * 2**-4 + scale * 2**-9 + 1e-12).all())
    assert float((err / w.abs().clamp(min=1e-6)).mean()) < 0.04
    assert float(deq.abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)


def test_all_zero_weight_gets_finite_scale():
    q, scale = quant.quantize_fp8_per_tensor(torch.zeros(4, 4))
    assert torch.isfinite(scale) and float(scale) > 0
    assert float(quant.dequantize_fp8(q, scale).abs().max()) == 0.0


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_loader_quantizes_fused_weights(tiny_model, dtype):
    folder = tiny_model("qwen2")
    config, hf = read_hf_folder(folder)
    m = load(LoadSpec(str(folder), quantization="fp8_per_tensor", dtype=dtype), HostShmBackend())
    try:
        views = m.table.views([s.readable() for s in m.slabs])
        store_dtype = torch.float32 if dtype == "auto" else torch.bfloat16
        assert m.quantization == "fp8_per_tensor"
        num_quantized = 0
        for f in plan(config, set(hf)):
            original = torch.cat([hf[s] for s in f.sources])
            if not f.quantizable:
                # norms, embeddings, lm_head and biases: untouched, only the dtype cast
                assert views[f.name].dtype == store_dtype
                assert torch.equal(views[f.name], original.to(store_dtype)), f.name
                assert f.name.removesuffix(".weight") + ".weight_scale" not in views
                continue
            num_quantized += 1
            q, scale = views[f.name], views[f.name + "_scale"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == original.shape
            assert scale.dtype == torch.float32 and scale.shape == ()
            rq, rscale = vllm_reference(original)  # one scale over the fused tensor
            assert torch.equal(scale, rscale), f.name
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), f.name
            err = (q.float() * scale - original).abs()
            assert bool((err <= original.abs() * 2**-4 + scale * 2**-9 + 1e-12).all()), f.name
        assert num_quantized == 4 * config["num_hidden_layers"]
        assert "model.embed_tokens.weight_scale" not in views and "lm_head.weight_scale" not in views
    finally:
        for s in m.slabs:
            s.close()

"""Tensor-parallel sharding of the stored layout: every rank's shard computes exactly its part
of the full computation, and configs the group cannot split fail naming the field."""
from __future__ import annotations

import pytest
import torch

from resident.daemon import quant
from resident.daemon.layout import LayoutError
from resident.daemon.sharding import check_shardable, shard_dim, shard_shape, shard_tensor

H, NH, NKV, D, I, V = 32, 4, 2, 8, 48, 64
CONFIG = {"hidden_size": H, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": D,
          "intermediate_size": I, "vocab_size": V}
A = "model.layers.0.self_attn"
M = "model.layers.0.mlp"


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_rows_are_q_k_v_of_the_ranks_heads(tp):
    q, k, v = rand(NH * D, H), rand(NKV * D, H) + 10, rand(NKV * D, H) - 10
    full = torch.cat([q, k, v])
    nq, nkv = NH // tp * D, NKV // tp * D
    for r in range(tp):
        s = shard_tensor(f"{A}.qkv_proj.weight", full, CONFIG, r, tp)
        assert s.is_contiguous() and s.shape == shard_shape(f"{A}.qkv_proj.weight", full.shape, CONFIG, tp)
        assert torch.equal(s, torch.cat([q[r * nq:(r + 1) * nq], k[r * nkv:(r + 1) * nkv], v[r * nkv:(r + 1) * nkv]]))


def test_qkv_bias_splits_like_its_rows():
    """Qwen2: the bias of rank r's rows is rank r's part of each of q, k and v."""
    bias = torch.arange(NH * D + 2 * NKV * D, dtype=torch.float32)
    w = rand(NH * D + 2 * NKV * D, H)
    x = rand(3, H)
    for r in range(2):
        sw = shard_tensor(f"{A}.qkv_proj.weight", w, CONFIG, r, 2)
        sb = shard_tensor(f"{A}.qkv_proj.bias", bias, CONFIG, r, 2)
        full_out = x @ w.T + bias
        q, k, v = full_out.split([NH * D, NKV * D, NKV * D], dim=-1)
        nq, nkv = NH // 2 * D, NKV // 2 * D
        want = torch.cat([q[:, r * nq:(r + 1) * nq], k[:, r * nkv:(r + 1) * nkv], v[:, r * nkv:(r + 1) * nkv]], -1)
        torch.testing.assert_close(x @ sw.T + sb, want)


def test_gate_up_shard_is_gate_r_then_up_r():
    gate, up = rand(I, H), rand(I, H) + 5
    full = torch.cat([gate, up])
    n = I // 2
    for r in range(2):
        s = shard_tensor(f"{M}.gate_up_proj.weight", full, CONFIG, r, 2)
        assert torch.equal(s, torch.cat([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]]))


@pytest.mark.parametrize("name,in_features", [(f"{A}.o_proj.weight", NH * D), (f"{M}.down_proj.weight", I)])
def test_row_parallel_partial_products_sum_to_the_full_product(name, in_features):
    w = rand(H, in_features)
    x = rand(5, in_features)
    assert shard_dim(name) == 1
    n = in_features // 2
    partial = [x[:, r * n:(r + 1) * n] @ shard_tensor(name, w, CONFIG, r, 2).T for r in range(2)]
    torch.testing.assert_close(partial[0] + partial[1], x @ w.T)
    assert shard_shape(name, w.shape, CONFIG, 2) == (H, n)


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_vocab_parallel_split_is_contiguous_vocab_ranges(name):
    full = rand(V, H)
    shards = [shard_tensor(name, full, CONFIG, r, 2) for r in range(2)]
    assert shard_dim(name) == 0
    assert torch.equal(torch.cat(shards), full)
    assert shards[1].shape == (V // 2, H)


@pytest.mark.parametrize("name", [
    "model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
    f"{A}.q_norm.weight", f"{A}.k_norm.weight", f"{A}.o_proj.bias",
    f"{A}.qkv_proj.weight_scale", f"{M}.down_proj.weight_scale", "draft.model.embed_tokens.weight",
    "draft.model.layers.0.self_attn.qkv_proj.weight",
])
def test_replicated_tensors_are_whole_on_every_rank(name):
    full = rand(H) if not name.endswith("_scale") else torch.tensor(0.01)
    assert shard_dim(name) is None
    assert shard_shape(name, tuple(full.shape), CONFIG, 2) == tuple(full.shape)
    for r in range(2):
        assert torch.equal(shard_tensor(name, full, CONFIG, r, 2), full)


def test_fp8_shard_dequantizes_with_the_replicated_scale():
    w = rand(NH * D + 2 * NKV * D, H)
    q, scale = quant.quantize_fp8_per_tensor(w)
    name = f"{A}.qkv_proj.weight"
    for r in range(2):
        qs = shard_tensor(name, q, CONFIG, r, 2)
        ss = shard_tensor(quant.scale_name(name), scale, CONFIG, r, 2)
        assert qs.dtype == quant.FP8_DTYPE
        want = shard_tensor(name, quant.dequantize_fp8(q, scale), CONFIG, r, 2)
        assert torch.equal(quant.dequantize_fp8(qs, ss), want)


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 9), ("num_key_value_heads", 3), ("intermediate_size", 47), ("vocab_size", 63),
])
def test_indivisible_config_fails_naming_the_field(field, value):
    cfg = dict(CONFIG, **{field: value})
    if field == "num_attention_heads":
        cfg["num_key_value_heads"] = 3
    with pytest.raises(LayoutError, match=field) as e:
        check_shardable(cfg, 2)
    assert "tensor-parallel size" in str(e.value)
    with pytest.raises(LayoutError, match=field):
        shard_shape("model.norm.weight", (H,), cfg, 2)


def test_nine_heads_suggest_the_sizes_that_work():
    cfg = dict(CONFIG, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
    check_shardable(cfg, 3)
    with pytest.raises(LayoutError, match=r"num_attention_heads \(9\).*: 1, 3$"):
        check_shardable(cfg, 2)


def test_bad_tp_size_and_rank():
    with pytest.raises(LayoutError, match=">= 1"):
        check_shardable(CONFIG, 0)
    with pytest.raises(ValueError, match="rank 2"):
        shard_tensor("lm_head.weight", rand(V, H), CONFIG, 2, 2)


def test_fused_rows_that_disagree_with_the_config_fail():
    with pytest.raises(LayoutError, match="do not belong together"):
        shard_tensor(f"{A}.qkv_proj.weight", rand(NH * D + NKV * D, H), CONFIG, 0, 2)

"""Each Triton kernel against its PyTorch reference, in Triton's CPU interpreter (float32, float16).

Triton decides at import time whether its kernels are interpreted (TRITON_INTERPRET=1),
and that must not leak into the GPU tests of the same pytest process, so the kernel cases
run in one subprocess (this file run as a script) and each pytest test reports one case.
bfloat16 does not compute correctly in the interpreter: it is covered by test_kernels_gpu.py.
The fp8 linear and the dispatch registry need no Triton and run in-process.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kernel_batches import make_paged_batch  # noqa: E402

from resident.worker.config import RopeConfig  # noqa: E402
from resident.worker.kernels import reference as ref  # noqa: E402
from resident.worker.layers import activation as layer_activation  # noqa: E402
from resident.worker.layers.attention import paged_attention as layer_paged_attention  # noqa: E402
from resident.worker.layers.norm import RMSNorm  # noqa: E402
from resident.worker.layers.rotary import RotaryEmbedding, compute_inv_freq  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Tolerances against the float32-math reference: attention casts probabilities to the
# cache dtype for P @ V (as flash attention does); elementwise kernels differ by ulps.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3}
#: Rotary: the kernel rounds once where the reference rounds three times (about one ulp).
ROTARY_ATOL = {torch.float32: 1e-6, torch.float16: 2 ** -8, torch.bfloat16: 2 ** -6}
ROTARY_RTOL = {torch.float32: 1e-6, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7}


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for dname, dtype in DTYPES.items():
        for name, fn in (("rms_norm", _rms_norm), ("fused_add_rms_norm", _fused_add_rms_norm),
                         ("silu_and_mul", _silu_and_mul), ("rotary_kv_write", _rotary_kv_write),
                         ("attention_mixed_batch", _attention_mixed), ("attention_gqa_shapes", _attention_shapes),
                         ("attention_sliding_window", _attention_window), ("decode_split_k", _decode_split_k),
                         ("decode_amax_slots", _decode_amax_slots), ("rotary_in_attention", _rotary_in_attention),
                         ("decode_ignores_garbage_slots", _decode_garbage)):
            cases[f"{name}[{dname}]"] = (lambda fn=fn, dtype=dtype: fn(dtype))
    cases["validation_errors"] = _validation_errors
    cases["static_decode_metadata[float32]"] = _static_decode
    return cases


# --- the cases (run in the interpreter subprocess) --------------------------------------------
def _rms_norm(dtype: torch.dtype) -> None:
    from resident.worker.kernels import rmsnorm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    torch.testing.assert_close(rmsnorm.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), atol=ATOL[dtype], rtol=0)
    # Qwen3's per-head q norm: [T, H, D] views of a wider fused qkv row, hidden not a power of 2.
    qkv = torch.randn(5, 3 * 4 * 24, generator=g).to(dtype)
    q = qkv[:, : 4 * 24].view(5, 4, 24)
    wq = torch.randn(24, generator=g).to(dtype)
    got = rmsnorm.rms_norm(q, wq, 1e-5)
    assert got.shape == q.shape
    torch.testing.assert_close(got, ref.rms_norm(q, wq, 1e-5), atol=ATOL[dtype] * 4, rtol=0)
    # A float32 weight promotes the output, as the reference's `weight * h` does.
    got32 = rmsnorm.rms_norm(x, w.float(), 1e-6)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, ref.rms_norm(x, w.float(), 1e-6), atol=ATOL[dtype], rtol=0)


def _fused_add_rms_norm(dtype: torch.dtype) -> None:
    from resident.worker.kernels import rmsnorm

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 130, generator=g).to(dtype)
    r = torch.randn(2, 3, 130, generator=g).to(dtype)
    w = torch.randn(130, generator=g).to(dtype)
    x0, r0 = x.clone(), r.clone()
    out, res = rmsnorm.fused_add_rms_norm(x, r, w, 1e-6)
    want_out, want_res = RMSNorm(w, 1e-6)(x, r)
    assert torch.equal(res, want_res), "the new residual must be exactly x + residual in the activation dtype"
    torch.testing.assert_close(out, want_out, atol=ATOL[dtype] * 4, rtol=0)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must be left untouched"


def _silu_and_mul(dtype: torch.dtype) -> None:
    from resident.worker.kernels import activation

    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(3, 4, 2 * 1100, generator=g)).to(dtype)   # I = 1100 spans two column blocks
    got = activation.silu_and_mul(x)
    assert got.shape == (3, 4, 1100)
    torch.testing.assert_close(got, layer_activation.silu_and_mul(x), atol=ATOL[dtype] * 4, rtol=1e-3)
    try:
        activation.silu_and_mul(x[..., :-1])
    except ValueError as e:
        assert "even" in str(e)
    else:
        raise AssertionError("an odd last dimension must be refused")


def _rotary_kv_write(dtype: torch.dtype) -> None:
    from resident.worker.kernels import rotary

    hq, hkv, d, bs = 6, 2, 24, 4
    rope = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)
    batch = make_paged_batch([5, 1, 3], [0, 9, 30], num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, seed=4)
    t = batch.meta.num_tokens
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)     # strided views, as the runner has them
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    table = ref.build_cos_sin_cache(compute_inv_freq(rope, d), 64, dtype)
    slots = batch.meta.slot_mapping.clone()
    slots[2] = -1                                                 # a padded token: not cached
    cache = batch.kv_cache.clone()
    q_rot = rotary.rotary_kv_write(batch.positions, q, k, v, table, cache, slots)

    want_q, want_k = RotaryEmbedding(rope, d)(batch.positions, q, k)
    # One rounding where the reference rounds each op: within an ulp of the activation dtype.
    tol = {"atol": ROTARY_ATOL[dtype], "rtol": ROTARY_RTOL[dtype]}
    torch.testing.assert_close(q_rot, want_q, **tol)
    keep = slots >= 0
    flat = cache.view(2, -1, hkv, d)
    torch.testing.assert_close(flat[0, slots[keep]], want_k[keep], **tol)
    assert torch.equal(flat[1, slots[keep]], v[keep]), "values must be cached unchanged"
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(flat[:, untouched], batch.kv_cache.view(2, -1, hkv, d)[:, untouched]), \
        "slots outside slot_mapping (and the padded token's) must not be written"


def _rotary_in_attention(dtype: torch.dtype) -> None:
    """`rotary_paged_attention` (the decode kernel rotating q and the new keys and caching them
    itself) equals `rotary_kv_write` then `paged_attention` bit for bit — output and whole cache —
    unsplit and split (the new key's split writes it, then attends over it), with a sliding
    window, a sequence whose only key is the new one, a padded token (slot -1: not cached) and
    an odd head_dim (24: BLOCK_D 32); its fp8 form equals rotary then paged_attention_fp8; a
    mixed batch takes the two ops."""
    from resident.worker.kernels import paged_attention, rotary

    hq, hkv, d, bs = 8, 2, 24, 4
    rope = RopeConfig(theta=10000.0)
    table = ref.build_cos_sin_cache(compute_inv_freq(rope, d), 128, dtype)
    for q_lens, ctx in (([1, 1, 1, 1], [0, 9, 30, 70]), ([3, 1], [4, 9])):
        batch = make_paged_batch(q_lens, ctx, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype, seed=31)
        t = batch.meta.num_tokens
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(32)).to(dtype)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        meta = batch.meta
        if len(q_lens) == 4:
            slots = meta.slot_mapping.clone()
            slots[1] = -1                                           # a padded token: not cached
            meta = dataclasses.replace(meta, slot_mapping=slots)
        for splits, window in ((None, None), (1, None), (3, None), (3, 7)):
            if splits is not None and len(q_lens) != 4:
                continue
            want_cache, got_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
            q_rot = rotary.rotary_kv_write(batch.positions, q, k, v, table, want_cache, meta.slot_mapping)
            if splits is None:
                want = paged_attention.paged_attention(q_rot, want_cache, meta, d ** -0.5, window)
                got = paged_attention.rotary_paged_attention(batch.positions, q, k, v, table, got_cache, meta,
                                                             d ** -0.5, window)
            else:
                want = paged_attention.decode_attention(q_rot, want_cache, meta.block_tables, meta.seq_lens,
                                                        d ** -0.5, window, num_splits=splits)
                got = paged_attention._decode(q, got_cache, meta.block_tables, meta.seq_lens, d ** -0.5, window,
                                              None, splits, rope=paged_attention.Rope(
                                                  batch.positions, k, v, table, meta.slot_mapping))[0]
            assert torch.equal(got, want), (q_lens, splits, window, (got - want).abs().max())
            assert torch.equal(got_cache, want_cache), (q_lens, splits, window)
        want_cache, got_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
        q_rot = rotary.rotary_kv_write(batch.positions, q, k, v, table, want_cache, meta.slot_mapping)
        want_q, want_s = paged_attention.paged_attention_fp8(q_rot, want_cache, meta, d ** -0.5)
        got_q, got_s = paged_attention.rotary_paged_attention_fp8(batch.positions, q, k, v, table, got_cache, meta,
                                                                  d ** -0.5)
        assert torch.equal(got_s, want_s) and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got_cache, want_cache)


def _attend_both(batch, q: torch.Tensor, scale: float, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    from resident.worker.kernels import paged_attention

    got = paged_attention.paged_attention(q, batch.kv_cache, batch.meta, scale, window)
    # The reference writes this step's k/v first: hand it the values already in their slots.
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    k, v = flat[0][batch.meta.slot_mapping], flat[1][batch.meta.slot_mapping]
    want = layer_paged_attention(q, k, v, batch.kv_cache.clone(), batch.meta, scale, window)
    return got, want


def _attention_mixed(dtype: torch.dtype) -> None:
    # A fresh prefill, a chunk over cached context, decodes, and a chunk longer than one query tile.
    hq, hkv, d = 8, 2, 32
    batch = make_paged_batch([9, 1, 6, 1, 20], [0, 37, 11, 1, 70], num_kv_heads=hkv, head_dim=d, block_size=16,
                             dtype=dtype, seed=6)
    q = torch.randn(batch.meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    got, want = _attend_both(batch, q, d ** -0.5, None)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)


def _attention_shapes(dtype: torch.dtype) -> None:
    # GQA group of 3 (not a power of 2), MHA, MQA; head_dim 24 (masked), block sizes 1 and 8.
    for hq, hkv, d, bs in ((9, 3, 24, 8), (4, 4, 16, 1), (8, 1, 32, 8)):
        batch = make_paged_batch([3, 1, 17], [5, 12, 0], num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                                 seed=hq + bs)
        q = torch.randn(batch.meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(8)).to(dtype)
        got, want = _attend_both(batch, q, d ** -0.5, None)
        torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0, msg=lambda m: f"{(hq, hkv, d, bs)}: {m}")


def _attention_window(dtype: torch.dtype) -> None:
    hq, hkv, d = 4, 2, 16
    for q_lens, ctx in (([7, 1, 12], [20, 30, 3]), ([1, 1], [40, 2])):   # mixed, then decode-only
        batch = make_paged_batch(q_lens, ctx, num_kv_heads=hkv, head_dim=d, block_size=4, dtype=dtype, seed=9)
        q = torch.randn(batch.meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(10)).to(dtype)
        got, want = _attend_both(batch, q, 0.3, 6)
        torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)


def _decode_split_k(dtype: torch.dtype) -> None:
    from resident.worker.kernels import paged_attention

    hq, hkv, d = 8, 2, 32
    batch = make_paged_batch([1, 1, 1, 1], [0, 63, 64, 300], num_kv_heads=hkv, head_dim=d, block_size=16,
                             dtype=dtype, seed=11)
    q = torch.randn(4, hq, d, generator=torch.Generator().manual_seed(12)).to(dtype)
    _, want = _attend_both(batch, q, d ** -0.5, None)
    for splits in (1, 2, 5, 8):   # more splits than key tiles leaves some splits empty
        got = paged_attention.decode_attention(q, batch.kv_cache, batch.meta.block_tables, batch.meta.seq_lens,
                                               d ** -0.5, num_splits=splits)
        torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0, msg=lambda m: f"{splits} splits: {m}")
    for cfg in (paged_attention.DecodeConfig(block_n=128, num_splits=3), paged_attention.DecodeConfig(block_n=128),
                paged_attention.DecodeConfig(num_stages=3, num_splits=1),
                paged_attention.DecodeConfig(num_warps=2, num_splits=1)):   # pick_decode_config's shapes, 3 stages
        got = paged_attention._decode(q, batch.kv_cache, batch.meta.block_tables, batch.meta.seq_lens, d ** -0.5,
                                      None, 300, None, config=cfg)[0]
        torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0, msg=lambda m: f"{cfg}: {m}")


def _decode_amax_slots(dtype: torch.dtype) -> None:
    """The decode kernels' |out| maxima (paged_attention_fp8's partials): one slot per (sequence, kv
    head), or per (sequence, query head) after a split, each the maximum of what that program
    stored; quantize_from_partials over them gives fp8_quant's scale and values (float32 output:
    the interpreter's fp8 cast is not exact)."""
    from resident.worker.kernels import fp8_quant, paged_attention
    from resident.worker.layers.linear import FP8_MAX, quantize_fp8_per_tensor_dynamic

    hq, hkv, d = 8, 2, 32
    batch = make_paged_batch([1, 1, 1], [5, 40, 70], num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype,
                             seed=21)
    q = (4 * torch.randn(3, hq, d, generator=torch.Generator().manual_seed(22))).to(dtype)
    for splits in (1, 3):
        out, buf, x_q = paged_attention._decode(q, batch.kv_cache, batch.meta.block_tables, batch.meta.seq_lens,
                                                  d ** -0.5, None, None, splits, amax=True)
        assert x_q is None   # (the interpreter runs no cooperative grid: the merge never quantizes here)
        assert torch.equal(out, paged_attention.decode_attention(q, batch.kv_cache, batch.meta.block_tables,
                                                                 batch.meta.seq_lens, d ** -0.5, num_splits=splits))
        parts = out.float().abs().view(3, hkv, -1) if splits == 1 else out.float().abs().view(3, hq, -1)
        want_slots = parts.amax(dim=-1).flatten()
        assert buf.shape == (1 + want_slots.numel(),) and torch.equal(buf[1:], want_slots), (splits, buf, want_slots)
        x = out.view(3, hq * d)
        got = torch.empty(x.shape, dtype=torch.float32)
        fp8_quant.quantize_from_partials(x, got, buf, buf.numel() - 1)
        _, want_scale = quantize_fp8_per_tensor_dynamic(x)
        assert torch.equal(buf[0], want_scale)
        assert torch.equal(got, (x.float() / want_scale).clamp(-FP8_MAX, FP8_MAX))
    # Rows of a program's tile past its query heads (REP 1 of BLOCK_M 16) attend with q = 0, so
    # uniformly: a value the real query avoids (its key opposite to q) would dominate them.
    one = make_paged_batch([1], [4], num_kv_heads=2, head_dim=d, block_size=16, dtype=dtype, seed=23)
    q1 = torch.randn(1, 2, d, generator=torch.Generator().manual_seed(24)).to(dtype)
    first = one.meta.block_tables[0, 0]
    one.kv_cache[0, first, 0] = (-8 * q1[0]).to(dtype)       # key of token 0: score -8 |q|^2
    one.kv_cache[1, first, 0] = 100.0                        # its value
    out, buf, _ = paged_attention._decode(q1, one.kv_cache, one.meta.block_tables, one.meta.seq_lens, d ** -0.5,
                                          None, None, 1, amax=True)
    assert float(out.float().abs().max()) < 20, out
    assert torch.equal(buf[1:], out.float().abs().amax(dim=-1).flatten())


def _decode_garbage(dtype: torch.dtype) -> None:
    # Slots past each context (block tails, spare blocks, padded table entries) hold NaN.
    hq, hkv, d = 8, 2, 32
    for q_lens, ctx in (([1, 1, 1], [4, 20, 33]), ([1, 5], [8, 13])):
        batch = make_paged_batch(q_lens, ctx, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype, seed=13,
                                 nan_unused=True)
        q = torch.randn(batch.meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(14)).to(dtype)
        got, want = _attend_both(batch, q, d ** -0.5, None)
        assert bool(torch.isfinite(got).all()), "stale cache contents leaked into the output"
        torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=0)


def _static_decode() -> None:
    """CUDA-graph decode metadata: no host copies, block tables as wide as max_model_len."""
    import dataclasses

    from resident.worker.kernels import paged_attention
    from resident.worker.layers.attention import AttentionMetadata

    if "static_decode" not in {f.name for f in dataclasses.fields(AttentionMetadata)}:
        raise _Skip("AttentionMetadata has no static_decode field in this tree")
    hq, hkv, d, bs = 8, 2, 32, 4
    batch = make_paged_batch([1, 1, 1], [6, 0, 50], num_kv_heads=hkv, head_dim=d, block_size=bs,
                             dtype=torch.float32, seed=15, nan_unused=True)
    m = batch.meta
    wide = torch.zeros(3, 40, dtype=torch.int64)        # 160 positions of max_model_len
    wide[:, : m.block_tables.shape[1]] = m.block_tables
    static = AttentionMetadata(slot_mapping=m.slot_mapping, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                               block_tables=wide, static_decode=True)
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(16))
    got = paged_attention.paged_attention(q, batch.kv_cache, static, d ** -0.5)
    _, want = _attend_both(batch, q, d ** -0.5, None)
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


def _validation_errors() -> None:
    from resident.worker.kernels import paged_attention, rmsnorm

    batch = make_paged_batch([1], [3], num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    q = torch.randn(1, 4, 16, dtype=torch.float16)
    for call, words in (
        (lambda: paged_attention.paged_attention(q, batch.kv_cache, batch.meta, 1.0), "must match"),
        (lambda: paged_attention.paged_attention(torch.randn(1, 3, 16), batch.kv_cache, batch.meta, 1.0), "multiple"),
        (lambda: rmsnorm.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-6), "contiguous"),
        (lambda: rmsnorm.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-6), "does not match"),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            assert words in str(e), f"error {e!r} should say {words!r}"
        else:
            raise AssertionError(f"expected an error mentioning {words!r}")


# --- the subprocess and its pytest face ---------------------------------------------------
class _Skip(Exception):
    """A case that cannot run in this tree; reported as a pytest skip with its reason."""


def _install_interpreter_numpy_shim() -> None:
    """Triton 3.6's interpreter turns scalars into Python ints with int(ndarray), which numpy >= 2.4
    refuses for the 1-element arrays it uses, so a loop bounded by a loaded value fails there
    (compiled kernels are unaffected). Read the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def run_cases(cases: dict[str, Callable[[], None]], out_path: str) -> None:
    """Run each case (under TRITON_INTERPRET=1) and write {name: "ok" | "skip: why" | traceback} to out_path."""
    _install_interpreter_numpy_shim()
    results = {}
    for name, fn in cases.items():
        try:
            fn()
            results[name] = "ok"
        except _Skip as e:
            results[name] = f"skip: {e}"
        except Exception:  # noqa: BLE001 - reported back to the pytest test of this case
            results[name] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(results))


def run_in_interpreter(script: str, out_dir: Path) -> dict[str, str]:
    """Run `python script OUT` under the Triton CPU interpreter (a subprocess: TRITON_INTERPRET is read
    at import) and return its run_cases results."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the Triton kernels cannot be tested (pip install triton)")
    out = out_dir / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, script, str(out)], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"the interpreter subprocess failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_kernel_matches_reference_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    if result.startswith("skip: "):
        pytest.skip(result.removeprefix("skip: "))
    assert result == "ok", f"{case}:\n{result}"


# --- in-process: compile for Hopper (no GPU needed), fp8 (torch._scaled_mm), the registry -------
def _hopper_builds() -> dict[str, tuple[str, dict[str, str], dict[str, object], dict[str, int]]]:
    """name -> (kernel, pointer arg types, constexprs, launch options) as the wrappers launch them
    for Llama-3-8B in bf16 (other int args i32, `qk_scale`/`eps` fp32)."""
    bf = "*bf16"
    attn = {"q_ptr": bf, "k_cache": bf, "v_cache": bf, "bt_ptr": "*i64", "seq_lens_ptr": "*i64", "out_ptr": bf}
    split = {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "amax_ptr": "*fp32"}
    merge_quant = {"xq_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "state_ptr": "*i32"}
    merge = {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_D": 128, "SPLITS_P2": 64, "QUANT": False, "BLOCK_P": 1}
    dec = {"REP": 4, "BLOCK_M": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64, "BLOCK_SIZE": 16, "PREC": "tf32",
           "ROPE": False}
    rope = {"pos_ptr": "*i64", "k_ptr": bf, "v_ptr": bf, "cs_ptr": bf, "slot_ptr": "*i64"}
    pre = {"REP": 4, "REP_P2": 4, "BLOCK_Q": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64, "BLOCK_SIZE": 16,
           "PREC": "tf32"}
    attn_opts = {"num_warps": 4, "num_stages": 2}
    return {
        "decode": ("paged_attention_kernels._decode_kernel", {**attn, **split},
                   {**dec, "SPLIT": False, "USE_WINDOW": False, "AMAX": False}, attn_opts),
        "decode_amax": ("paged_attention_kernels._decode_kernel", {**attn, **split},
                        {**dec, "SPLIT": False, "USE_WINDOW": False, "AMAX": True}, attn_opts),
        "decode_split_rope": ("paged_attention_kernels._decode_kernel", {**attn, **split, **rope},
                              {**dec, "SPLIT": True, "USE_WINDOW": False, "AMAX": False, "ROPE": True}, attn_opts),
        "decode_rope_amax": ("paged_attention_kernels._decode_kernel", {**attn, **split, **rope},
                             {**dec, "SPLIT": False, "USE_WINDOW": False, "AMAX": True, "ROPE": True},
                             {"num_warps": 2, "num_stages": 2}),
        "decode_split_window": ("paged_attention_kernels._decode_kernel", {**attn, **split},
                                {**dec, "SPLIT": True, "USE_WINDOW": True, "AMAX": False}, attn_opts),
        # pick_decode_config's other shapes: unsplit in two warps, long splits in 128-key tiles
        "decode_2_warps": ("paged_attention_kernels._decode_kernel", {**attn, **split},
                           {**dec, "SPLIT": False, "USE_WINDOW": False, "AMAX": False},
                           {"num_warps": 2, "num_stages": 2}),
        "decode_amax_2_warps": ("paged_attention_kernels._decode_kernel", {**attn, **split},
                                {**dec, "SPLIT": False, "USE_WINDOW": False, "AMAX": True},
                                {"num_warps": 2, "num_stages": 2}),
        "decode_split_128": ("paged_attention_kernels._decode_kernel", {**attn, **split},
                             {**dec, "BLOCK_N": 128, "SPLIT": True, "USE_WINDOW": False, "AMAX": False}, attn_opts),
        # (QUANT, the cooperative merge that quantizes: test_kernels_fp8_fused.py's sm_90 build test)
        "merge_splits": ("paged_attention_kernels._merge_splits_kernel", {**split, **merge_quant, "out_ptr": bf},
                         {**merge, "AMAX": False}, {"num_warps": 4}),
        "merge_splits_amax": ("paged_attention_kernels._merge_splits_kernel", {**split, **merge_quant, "out_ptr": bf},
                              {**merge, "AMAX": True}, {"num_warps": 4}),
        "prefill_window": ("paged_attention_kernels._prefill_kernel", {**attn, "qsl_ptr": "*i64"},
                           {**pre, "USE_WINDOW": True}, attn_opts),
        "prefill_gqa3_d64": ("paged_attention_kernels._prefill_kernel", {**attn, "qsl_ptr": "*i64"},
                             {**pre, "REP": 3, "HEAD_DIM": 64, "BLOCK_D": 64, "USE_WINDOW": False}, attn_opts),
        "rotary_kv": ("rotary._rotary_kv_kernel",
                      {"pos_ptr": "*i64", "slot_ptr": "*i64", **{n: bf for n in (
                          "q_ptr", "k_ptr", "v_ptr", "cs_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr")}},
                      {"BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_HALF": 64}, {"num_warps": 4}),
        "fused_add_rms_norm": ("rmsnorm._rms_norm_kernel", {n: bf for n in (
                                   "x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")},
                               {"HAS_RESIDUAL": True, "BLOCK_N": 4096}, {"num_warps": 8}),
        "silu_and_mul": ("activation._silu_and_mul_kernel", {"x_ptr": bf, "out_ptr": bf}, {"BLOCK": 1024},
                         {"num_warps": 4}),
    }


def _build_for_hopper(build: str, **more_constexprs: object):
    """`_hopper_builds()[build]` built for sm_90 (skips where Triton cannot build here)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel_path, pointers, constexprs, options = _hopper_builds()[build]
    constexprs = {**constexprs, **more_constexprs}
    module_name, fn_name = kernel_path.split(".")
    fn = getattr(importlib.import_module(f"resident.worker.kernels.{module_name}"), fn_name)
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in ("qk_scale", "eps") else "i32")
                 for n in fn.arg_names}
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip(f"this triton has no bundled ptxas: {e}")
        raise


@pytest.mark.parametrize("build", sorted(_hopper_builds()))
def test_kernel_compiles_for_hopper(build: str) -> None:
    """Triton's front end and ptxas (bundled with triton) build each kernel for sm_90 here, so
    errors the interpreter cannot see (e.g. a non-constexpr global) fail in CI, not on the GPU."""
    compiled = _build_for_hopper(build)
    assert compiled.asm.get("cubin"), f"{build}: no sm_90 binary produced"


@pytest.mark.parametrize("build", ["decode_split_rope", "decode_rope_amax", "decode_split_window"])
def test_decode_attention_reads_only_the_steps_metadata_before_the_pdl_wait(build: str) -> None:
    """Under PDL the sequence length, position, cache slot and rotary row (written before the
    step's first kernel, never by a PDL kernel) are read before griddepcontrol.wait; q, k, v and
    the cache after it, and nothing is stored before it."""
    ptx = _build_for_hopper(build, PDL=True).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert "griddepcontrol.launch_dependents" in before and "st.global" not in before
    rope = "rope" in build
    # the int64 seq_len, with the rotation also the position and the slot (then the table row's halves)
    assert before.count("ld.global.b64") == (3 if rope else 1), before[-3000:]
    assert before.count("ld.global") == before.count("ld.global.b64") + rope * before.count("ld.global.b16")
    assert after.count("ld.global") > before.count("ld.global")


def test_pick_decode_config() -> None:
    """Unsplit batches run two warps, two stages (the fp8 variant's best, taken by the plain
    kernel too so that the two stay bit-identical); splits of >= LONG_SPLIT_KEYS keys take 128-key
    tiles; short splits keep session 10's shape. (On the CPU default_num_splits counts 4 SMs: two
    waves are 8 programs.)"""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from resident.worker.kernels.paged_attention import DecodeConfig, pick_decode_config

    cpu = torch.device("cpu")
    assert pick_decode_config(8, 1, 1024, cpu) == DecodeConfig(num_warps=2, num_stages=2, num_splits=1)
    assert pick_decode_config(64, 8, 4096, cpu) == DecodeConfig(num_warps=2, num_stages=2, num_splits=1)
    assert pick_decode_config(1, 1, 8192, cpu) == DecodeConfig(block_n=128, num_splits=8)
    assert pick_decode_config(1, 1, 1536, cpu) == DecodeConfig(block_n=128, num_splits=8)   # 192 keys a split
    assert pick_decode_config(1, 1, 1528, cpu) == DecodeConfig(num_splits=8)
    assert pick_decode_config(1, 1, 256, cpu) == DecodeConfig(num_splits=4)                  # 64 keys a split
    assert pick_decode_config(1, 2, 100, cpu) == DecodeConfig(num_splits=2)


# --- in-process: fp8 (torch._scaled_mm, no Triton) and the registry ------------------------------
def _fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    scale = (w.abs().amax() / 448.0).to(torch.float32)
    return (w / scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_reference(dtype: torch.dtype, bias: bool) -> None:
    from resident.worker.kernels import fp8

    w, s = _fp8_weight(48, 64, 0)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    try:
        got = fp8.fp8_linear(x, w, s, b)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build ({e}); covered on GPU")
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    torch.testing.assert_close(got, ref.fp8_linear(x, w, s, b), atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_fp8_linear_unaligned_shape_uses_reference_math() -> None:
    from resident.worker.kernels import fp8

    w, s = _fp8_weight(24, 40, 2)           # 40 and 24 are not multiples of 16
    x = torch.randn(3, 40)
    assert torch.equal(fp8.fp8_linear(x, w, s), ref.fp8_linear(x, w, s))
    with pytest.raises(ValueError, match="row-major"):
        fp8.fp8_linear(torch.randn(3, 24), w.t(), s)


def test_get_kernels_rejects_unknown_backend_listing_valid_ones() -> None:
    from resident.worker.kernels.dispatch import get_kernels

    with pytest.raises(ValueError, match="auto, triton, torch"):
        get_kernels("cpu", "cuda-magic")


def test_get_kernels_on_cpu(monkeypatch) -> None:
    from resident.worker.kernels.dispatch import get_kernels, triton_available

    assert get_kernels("cpu").backend == "torch"
    assert get_kernels("cpu", "torch").backend == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not triton_available():
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="CUDA devices"):
        get_kernels("cpu", "triton")


def test_torch_backend_is_the_reference_layers() -> None:
    """The torch backend run as the engine would (rotary + cache write, then attention) equals
    RotaryEmbedding + the reference paged_attention."""
    from resident.worker.kernels.dispatch import get_kernels

    k = get_kernels("cpu", "torch")
    hq, hkv, d = 4, 2, 16
    rope = RopeConfig(theta=10000.0)
    batch = make_paged_batch([4, 1], [0, 9], num_kv_heads=hkv, head_dim=d, block_size=4, dtype=torch.float32)
    t = batch.meta.num_tokens
    g = torch.Generator().manual_seed(3)
    q, kk, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    table = ref.build_cos_sin_cache(compute_inv_freq(rope, d), 32, torch.float32)
    cache = batch.kv_cache.clone()
    out = k.paged_attention(k.rotary_kv_write(batch.positions, q, kk, v, table, cache, batch.meta.slot_mapping),
                            cache, batch.meta, d ** -0.5)
    qr, kr = RotaryEmbedding(rope, d)(batch.positions, q, kk)
    want = layer_paged_attention(qr, kr, v, batch.kv_cache.clone(), batch.meta, d ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    x = torch.randn(3, 16)
    assert torch.equal(k.silu_and_mul(x), layer_activation.silu_and_mul(x))


if __name__ == "__main__":
    run_cases(_cases(), sys.argv[1])

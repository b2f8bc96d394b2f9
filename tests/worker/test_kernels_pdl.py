"""Programmatic dependent launch (kernels/pdl.py): the RESIDENT_PDL switch, which launches take it,
and — on a GPU of compute capability 9.0+ — that a CUDA graph of PDL launches (the decode step's
kernels, rows <= MAX_ROWS = 32) computes bit for bit what the same kernels compute launched plainly.
The sm_90 build of the GEMV under PDL (its wait before every load) is checked in test_kernels_gemv.py.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from resident.worker.kernels import pdl  # noqa: E402


def test_mode_parsing_and_default() -> None:
    assert pdl.DEFAULT_PDL_MODE == "on"             # faster at batch 1 on the H200 (docs/benchmarks.md, session 12)
    assert pdl.pdl_mode({}) == pdl.pdl_mode({"RESIDENT_PDL": " "}) == "on"
    assert [pdl.pdl_mode({"RESIDENT_PDL": v}) for v in ("off", "ON ", "all")] == ["off", "on", "all"]
    with pytest.raises(ValueError, match="RESIDENT_PDL='yes' is not a PDL mode; valid: off, on, all"):
        pdl.pdl_mode({"RESIDENT_PDL": "yes"})


def test_which_launches_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`on`: decode-sized launches (rows <= MAX_ROWS) on a 9.0+ GPU; `all`: any rows; `off` and the
    CPU (Triton's interpreter) and older GPUs: never."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "sm90_or_later", lambda device: True)
    monkeypatch.setattr(pdl, "PDL_MODE", "on")
    assert pdl.enabled(cuda, 1) and pdl.enabled(cuda, pdl.MAX_ROWS)
    assert not pdl.enabled(cuda, pdl.MAX_ROWS + 1)
    assert not pdl.enabled(torch.device("cpu"), 1)
    monkeypatch.setattr(pdl, "PDL_MODE", "all")
    assert pdl.enabled(cuda, 4096)
    monkeypatch.setattr(pdl, "PDL_MODE", "off")
    assert not pdl.enabled(cuda, 1)
    monkeypatch.setattr(pdl, "PDL_MODE", "on")
    monkeypatch.setattr(pdl, "sm90_or_later", lambda device: False)      # an A100: no griddepcontrol
    assert not pdl.enabled(cuda, 1)
    monkeypatch.setattr(pdl, "sm90_or_later", lambda device: True)
    monkeypatch.setattr(pdl, "TRITON_HAS_PDL", False)                 # Triton 3.2: no launch_pdl option
    assert not pdl.enabled(cuda, 1)


def test_launch_keywords_name_launch_pdl_only_when_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, a launch passes no PDL option at all (Triton before 3.3 rejects unknown launch
    keywords); the kernel's PDL constexpr always agrees with the launch option."""
    monkeypatch.setattr(pdl, "sm90_or_later", lambda device: True)
    monkeypatch.setattr(pdl, "PDL_MODE", "on")
    assert pdl.launch(torch.device("cuda", 0), 1) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch(torch.device("cuda", 0), pdl.MAX_ROWS + 1) == {"PDL": False}
    assert pdl.launch(torch.device("cpu"), 1) == {"PDL": False}


def _needs_hopper() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0+")


def _layer_chain(rows: int):
    """A decode layer's kernels at small Llama shapes, each output the next one's input: add +
    RMSNorm, the GEMV (split-K), rotary + KV write, decode attention (split, then merged), the GEMV,
    SiLU-and-mul, argmax."""
    from resident.worker.kernels import activation, argmax, gemv, paged_attention as pa, rmsnorm, rotary
    from resident.worker.kernels.reference import build_cos_sin_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, n_qh, n_kh, head_dim, block, ctx = 512, 8, 2, 64, 16, 300

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)
    x, res, norm_w = rand(rows, hidden), rand(rows, hidden), rand(hidden, scale=0.1) + 1
    w_qkv, w_up = (rand(n, hidden, scale=hidden ** -0.5) for n in ((n_qh + 2 * n_kh) * head_dim, 2 * 1024))
    w_down = rand(hidden, 1024, scale=1024 ** -0.5)
    blocks = -(-ctx // block)
    kv = rand(2, rows * blocks, block, n_kh, head_dim)
    tables = torch.arange(rows * blocks, device="cuda").view(rows, blocks)
    seq_lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int64)
    positions = torch.full((rows,), ctx - 1, device="cuda", dtype=torch.int64)
    slots = tables[:, (ctx - 1) // block] * block + (ctx - 1) % block
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, 2 * ctx, torch.bfloat16)

    def step() -> tuple[torch.Tensor, ...]:
        normed, r = rmsnorm.fused_add_rms_norm(x, res, norm_w, 1e-5)
        qkv = gemv.gemv(normed, w_qkv).view(rows, n_qh + 2 * n_kh, head_dim)
        q = rotary.rotary_kv_write(positions, qkv[:, :n_qh], qkv[:, n_qh:n_qh + n_kh], qkv[:, n_qh + n_kh:],
                                   cos_sin, kv, slots)
        attn = pa._decode(q, kv, tables, seq_lens, head_dim ** -0.5, None, ctx, None)[0]
        up = gemv.gemv(attn.reshape(rows, n_qh * head_dim)[:, :hidden].contiguous(), w_up)
        out = gemv.gemv(activation.silu_and_mul(up), w_down)
        return out, r, argmax.argmax_rows(out)
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_graph_of_pdl_launches_matches_plain_launches(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same chain captured in a CUDA graph with PDL launches (the default `on`, rows <= MAX_ROWS)
    and without (`off`), replayed many times: the same bits every replay. A kernel reading before
    its wait would see the previous kernel's output half written, which shows as a differing bit."""
    _needs_hopper()
    from resident.worker.kernels import gemv

    results = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(pdl, "PDL_MODE", mode)
        step = _layer_chain(rows)
        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        replays = []
        for _ in range(50):
            graph.replay()
            replays.append([t.clone() for t in captured])
        torch.cuda.synchronize()
        for got in replays:
            for a, b in zip(got, eager):
                assert torch.equal(a, b), f"PDL {mode}: a replay differs from the eager chain"
        results[mode] = eager
    for a, b in zip(results["on"], results["off"]):
        assert torch.equal(a, b)
    kernels = [k for cache in gemv._gemv_kernel.device_caches.values() for k in cache[0].values()]
    assert any(k.metadata.launch_pdl for k in kernels) and any(not k.metadata.launch_pdl for k in kernels)

"""Greedy sampling's argmax kernel (`kernels/argmax.py`) against `torch.argmax(dim=-1)`: in Triton's
CPU interpreter (a subprocess), and on a GPU through the sampler and the runner's greedy path;
the sampler's fallback to torch when the kernel cannot build."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_kernels import run_cases, run_in_interpreter  # noqa: E402


def _rows(vocab: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Rows that pin the semantics: random; a tie between two columns (first wins); a tie split
    across lanes and iterations of the kernel's loop; NaN after and before the maximum (first
    NaN wins); all -inf (0); +inf and -0.0/+0.0 ties; the maximum in the last, ragged column."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=g).to(dtype)
    x[1, 7] = x[1, vocab - 3] = 50
    x[2, 1] = x[2, 5] = 60                               # lanes 1 and 5 of the first block
    if vocab > 4096 + 5:
        x[2, 4096 + 5] = 60                              # lane 5 again, in the second block
    x[3, vocab // 2] = float("nan")
    x[3, vocab - 1] = float("nan")
    x[4, 3] = 70
    x[4, vocab - 2] = float("nan")
    x[5] = float("-inf")
    x[6, 9] = x[6, 2] = float("inf")
    x[7] = 0.0
    x[7, 4] = -0.0
    x[8, vocab - 1] = 80
    x[9, 0] = 90
    return x.to(device)


def _matches_torch(vocab: int, dtype: torch.dtype) -> None:
    from resident.worker.kernels.argmax import argmax_rows

    x = _rows(vocab, dtype)
    got, want = argmax_rows(x), x.argmax(dim=-1)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got.tolist(), want.tolist())


def _strided_rows_and_one_row() -> None:
    from resident.worker.kernels.argmax import argmax_rows

    x = _rows(300, torch.float32)
    wide = torch.zeros(10, 512)
    wide[:, :300] = x
    view = wide[:, :300]                                 # row stride 512
    assert torch.equal(argmax_rows(view), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[8:9]), torch.tensor([299]))
    assert argmax_rows(x[:0]).shape == (0,)


def _cases() -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for vocab in (10, 37, 4096, 4096 * 2 + 5):            # under one block, one, several + ragged
        for dname, dtype in (("float32", torch.float32), ("float16", torch.float16)):
            cases[f"matches_torch[{vocab}-{dname}]"] = lambda vocab=vocab, dtype=dtype: _matches_torch(vocab, dtype)
    cases["strided_rows_and_one_row"] = _strided_rows_and_one_row
    cases["one_column"] = _one_column
    return cases


def _one_column() -> None:
    from resident.worker.kernels.argmax import argmax_rows

    x = torch.tensor([[3.0], [float("nan")], [float("-inf")]])
    assert argmax_rows(x).tolist() == [0, 0, 0]


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, str]:
    return run_in_interpreter(__file__, tmp_path_factory.mktemp("argmax"))


@pytest.mark.parametrize("case", sorted(_cases()))
def test_argmax_matches_torch_in_interpreter(case: str, interpreted_results: dict[str, str]) -> None:
    result = interpreted_results.get(case, "case did not run")
    assert result == "ok", f"{case}:\n{result}"


def test_argmax_rejects_bad_logits_naming_the_fix() -> None:
    pytest.importorskip("triton")
    from resident.worker.kernels.argmax import argmax_rows

    for bad, err, match in ((torch.zeros(4), ValueError, r"\[rows, vocab\]"),
                            (torch.zeros(2, 0), ValueError, "no columns"),
                            (torch.zeros(2, 8, dtype=torch.int32), TypeError, "float16, bfloat16 or float32"),
                            (torch.zeros(8, 2).t(), ValueError, "contiguous")):
        with pytest.raises(err, match=match):
            argmax_rows(bad)


def test_greedy_tokens_is_torch_argmax_on_cpu_and_falls_back_when_the_kernel_fails(monkeypatch, caplog) -> None:
    """CPU logits never reach the kernel; on a GPU a kernel that fails to build is logged once and
    greedy sampling goes on with torch.argmax (simulated: a fake CUDA tensor check)."""
    from resident.worker.layers import sampler

    x = _rows(50, torch.float32)
    assert torch.equal(sampler.greedy_tokens(x), x.argmax(dim=-1))
    if pytest.importorskip("triton") is None:
        return
    from triton.errors import TritonError

    from resident.worker.kernels import argmax

    calls = []

    def broken(logits):
        calls.append(1)
        raise TritonError("no GPU compiler here")

    class Cuda(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(argmax, "argmax_rows", broken)
    monkeypatch.setattr(sampler, "_argmax_kernel_failed", False)
    fake = x.as_subclass(Cuda)
    with caplog.at_level("WARNING", logger=sampler.__name__):
        assert torch.equal(sampler.greedy_tokens(fake), x.argmax(dim=-1))
        assert torch.equal(sampler.greedy_tokens(fake), x.argmax(dim=-1))
    assert calls == [1] and sampler._argmax_kernel_failed
    assert sum("argmax kernel is unavailable" in r.message for r in caplog.records) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [4096 * 2 + 5, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_argmax_matches_torch_and_replays_in_a_graph(vocab: int, dtype: torch.dtype) -> None:
    from resident.worker.kernels.argmax import argmax_rows

    x = _rows(vocab, dtype, "cuda")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    big = torch.randn(64, vocab, device="cuda").to(dtype)
    assert torch.equal(argmax_rows(big), big.argmax(dim=-1))
    static = torch.randn(3, vocab, device="cuda").to(dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(static)
    for seed in range(3):
        static.copy_(torch.randn(3, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, static.argmax(dim=-1))


@pytest.mark.gpu
def test_gpu_sampler_greedy_paths_use_the_kernel(monkeypatch) -> None:
    from resident.worker.kernels import argmax
    from resident.worker.layers.sampler import Sampler, SamplingRow
    from resident.worker.sampling_params import SamplingParams

    calls = []
    real = argmax.argmax_rows
    monkeypatch.setattr(argmax, "argmax_rows", lambda t: calls.append(tuple(t.shape)) or real(t))
    x = _rows(1000, torch.float32, "cuda")
    assert Sampler.greedy(x) == x.argmax(dim=-1).tolist()
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], []) for _ in range(x.shape[0])]
    assert Sampler("cuda", seed=0).choose(x, rows).tolist() == x.argmax(dim=-1).tolist()
    assert calls == [(10, 1000), (10, 1000)]


if __name__ == "__main__":
    run_cases(_cases(), sys.argv[1])

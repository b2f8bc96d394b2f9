"""`checksum.wsum32_spans`: the per-slab checksum pass of the GPU loader must give, for every
tensor of a slab, exactly the wsum32 that verifiers compute tensor by tensor (`crc32_of` on
the device, `wsum32_reference` from the definition) — whatever lies between the tensors."""
from __future__ import annotations

import random

import pytest
import torch

from resident.daemon import checksum


def _random_slab(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _packed_spans(sizes: list[int], alignment: int) -> list[tuple[int, int]]:
    spans, off = [], 0
    for n in sizes:
        spans.append((off, n))
        off = (off + n + alignment - 1) // alignment * alignment
    return spans


def _expected(slab: torch.Tensor, spans: list[tuple[int, int]]) -> list[int]:
    return [checksum.wsum32_reference(slab[o : o + n].numpy().tobytes()) for o, n in spans]


def _got(slab: torch.Tensor, spans: list[tuple[int, int]]) -> list[int]:
    parts = checksum.wsum32_spans(slab, spans).tolist()
    return [checksum.wsum32_finish(p, n) for p, (_, n) in zip(parts, spans)]


@pytest.mark.parametrize("alignment", [256, 64, 8, 4])
def test_spans_equal_the_definition_for_packed_tensors_with_odd_sizes(alignment):
    rng = random.Random(alignment)
    # Odd sizes (fp8 scales of 4 bytes, 1- and 2-byte tails), exact rows, empty tensors, large ones.
    sizes = [4, 0, 1, 2, 3, 255, 256, 257, 512, 1000, 4096 * 3 + 2, 70_001]
    sizes += [rng.randrange(0, 9000) for _ in range(40)]
    spans = _packed_spans(sizes, alignment)
    slab = _random_slab(spans[-1][0] + spans[-1][1] + 300, seed=alignment)   # garbage in every gap
    assert _got(slab, spans) == _expected(slab, spans)


def test_spans_ignore_the_bytes_between_tensors():
    spans = _packed_spans([10, 300, 7, 1030], 256)
    slab = _random_slab(4096, seed=1)
    before = _got(slab, spans)
    for (o, n), (o2, _) in zip(spans, spans[1:] + [(4096, 0)]):
        slab[o + n : o2] = 0xAB      # rewrite only the gaps
    assert _got(slab, spans) == before


def test_a_changed_byte_changes_only_its_own_tensors_checksum():
    spans = _packed_spans([512, 513, 100, 4096], 256)
    slab = _random_slab(8192, seed=2)
    before = _got(slab, spans)
    o, n = spans[1]
    slab[o + n - 1] ^= 0x10          # the last byte of tensor 1 (in its partial row)
    after = _got(slab, spans)
    assert after[1] != before[1] and after[:1] == before[:1] and after[2:] == before[2:]


def test_extreme_words_do_not_overflow(monkeypatch):
    # Many rows of 0xFF..FF and 0x80000000 words, in several blocks of rows.
    monkeypatch.setattr(checksum, "_SPAN_BLOCK_ROWS", 3)
    slab = torch.full((256 * 40 + 12,), 0xFF, dtype=torch.uint8)
    slab.view(torch.int32)[::3] = torch.iinfo(torch.int32).min
    spans = [(0, 256 * 40 + 12), (256, 256 * 17 + 5), (256 * 39, 268)]
    assert _got(slab, spans) == _expected(slab, spans)


def test_unaligned_offsets_fall_back_and_still_agree():
    slab = _random_slab(3000, seed=3)
    spans = [(1, 100), (103, 998), (2001, 999)]
    assert _got(slab, spans) == _expected(slab, spans)


def test_spans_outside_the_slab_are_refused():
    with pytest.raises(ValueError, match="outside the slab"):
        checksum.wsum32_spans(torch.zeros(100, dtype=torch.uint8), [(64, 40)])


@pytest.mark.parametrize("alignment", [256, 64, 4])
def test_a_window_over_a_group_of_spans_gives_the_same_sums(alignment):
    """The loader checksums groups of tensors as their copies finish (`wsum32_spans_in`):
    it must give what the whole-slab pass gives, reading no byte before the group's row."""
    rng = random.Random(alignment + 7)
    sizes = [rng.randrange(0, 5000) for _ in range(30)] + [4, 1, 256, 4096 * 2 + 3]
    spans = _packed_spans(sizes, alignment)
    slab = _random_slab(spans[-1][0] + spans[-1][1] + 64, seed=alignment + 7)
    whole = checksum.wsum32_spans(slab, spans).tolist()
    for lo, hi in [(0, 5), (5, 6), (6, 20), (20, len(spans)), (3, len(spans) - 2)]:
        group = spans[lo:hi]
        first = min(o for o, _ in group) // 256 * 256
        scrambled = slab.clone()
        scrambled[:first] = 0x5A                      # bytes before the group's window: not read
        assert checksum.wsum32_spans_in(scrambled, group).tolist() == whole[lo:hi], (lo, hi)
    assert checksum.wsum32_spans_in(slab, []).shape == (0, 2)
    with pytest.raises(ValueError, match="outside the slab"):
        checksum.wsum32_spans_in(slab, [(slab.numel() - 4, 8)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spans_on_gpu_equal_the_cpu_oracle():
    sizes = [4, 3, 4096 * 4096 * 2 + 6, 1, 256 * 1000, 70_001]
    spans = _packed_spans(sizes, 256)
    slab = _random_slab(spans[-1][0] + spans[-1][1] + 100, seed=4)
    got = checksum.wsum32_spans(slab.cuda(), spans).cpu().tolist()
    assert [checksum.wsum32_finish(p, n) for p, (_, n) in zip(got, spans)] == _expected(slab, spans)
    assert got == checksum.wsum32_spans(slab, spans).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_windows_on_gpu_equal_the_cpu_oracle():
    spans = _packed_spans([4, 3, 4096 * 4096 + 6, 1, 256 * 1000, 70_001, 2 << 20], 2 << 20)
    slab = _random_slab(spans[-1][0] + spans[-1][1] + 100, seed=5)
    expected = _expected(slab, spans)
    for lo, hi in [(0, 3), (3, 5), (5, len(spans))]:
        got = checksum.wsum32_spans_in(slab.cuda(), spans[lo:hi]).cpu().tolist()
        assert [checksum.wsum32_finish(p, n) for p, (_, n) in zip(got, spans[lo:hi])] == expected[lo:hi]

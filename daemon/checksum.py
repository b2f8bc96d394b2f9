"""Per-tensor checksums of stored weights, and which algorithm applies where.

Two algorithms, chosen by where a tensor's bytes live (the slab's device):

- `crc32` (host memory): zlib's CRC-32 of the tensor's bytes. Computed by the loader's
  reader threads right after each read (zlib releases the GIL), combined across chunks
  with `crc32_combine` so a large tensor can be read by several threads at once.
- `wsum32` (GPU memory): a position-weighted sum of 32-bit words, computed with a handful
  of integer torch ops on the GPU right where the bytes are, after any cast or fp8
  quantization (CRC-32 is sequential and would need the bytes back on the host). The CPU
  implementation is the same torch code, so both give identical results (integer math,
  no overflow: see `wsum32_parts`).

`checksum_of(t)` dispatches on `t.device`; `tensor_table.crc32_of` is that function, so
every verifier (the worker's `verify`, `Client.attach(verify_checksums=True)`, the
daemon's state checks) computes the algorithm the loader recorded for that slab's device.

wsum32 definition: pad the bytes with zeros to a multiple of 4, read them as
little-endian unsigned 32-bit words w_0 … w_{n-1};
  s1 = Σ w_i mod 2^32,  s2 = Σ (i + 1)·w_i mod 2^32,
  wsum32 = s1 XOR (s2·0x9E3779B1 mod 2^32) XOR (nbytes·0x85EBCA77 mod 2^32).
It catches flipped bits, zeroed or shifted regions and swapped words (not adversaries).
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

CRC32 = "crc32"
WSUM32 = "wsum32"
ALGORITHMS = (CRC32, WSUM32)

_MASK = 0xFFFFFFFF
#: Words per row when wsum32 reduces a tensor as a [rows, _ROW_WORDS] matrix.
_ROW_WORDS = 4096
#: Rows reduced at once (64 MiB of words).
_BLOCK_ROWS = 4096
_K2 = 0x9E3779B1
_KN = 0x85EBCA77
#: Reflected CRC-32 polynomial (zlib's).
_CRC_POLY = 0xEDB88320


def algorithm_for(device: str | torch.device) -> str:
    """The checksum algorithm of tensors stored on `device` ("cpu", "cuda:0", ...)."""
    return CRC32 if torch.device(device).type == "cpu" else WSUM32


def checksum_of(t: torch.Tensor) -> int:
    """The checksum of a tensor's bytes, by the algorithm of its device (see module doc)."""
    return crc32(t) if t.device.type == "cpu" else wsum32(t)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def crc32(t: torch.Tensor) -> int:
    """zlib CRC-32 of a CPU tensor's bytes."""
    if t.device.type != "cpu":
        raise ValueError(f"crc32 is computed on the host; this tensor is on {t.device} (use wsum32 there)")
    flat = _flat_bytes(t)
    return zlib.crc32(flat.numpy().data) & _MASK if flat.numel() else 0


def _words(flat: torch.Tensor) -> torch.Tensor:
    """int32 view of a uint8 tensor whose length is a multiple of 4 (copying if misaligned)."""
    if flat.storage_offset() % 4 or flat.data_ptr() % 4:
        flat = flat.clone()
    return flat.view(torch.int32)


def wsum32_parts(t: torch.Tensor) -> torch.Tensor:
    """(s1, s2) of `t`'s bytes as an int64 tensor of shape [2] on t's device (no host sync).

    Values stay below 2^63 throughout: row and column sums of int32 words over at most
    2^31 words, each reduced mod 2^32 before it is multiplied by a position.
    """
    flat = _flat_bytes(t)
    n = flat.numel()
    dev = flat.device
    s = torch.zeros(2, dtype=torch.int64, device=dev)
    if n == 0:
        return s
    if n >= 1 << 33:
        raise ValueError(f"wsum32: tensors over 8 GiB are not supported ({n} bytes)")
    rows = (n // 4) // _ROW_WORDS
    main_words = rows * _ROW_WORDS
    if rows:
        x = _words(flat[: main_words * 4]).view(rows, _ROW_WORDS)
        col_sums = torch.zeros(_ROW_WORDS, dtype=torch.int64, device=dev)
        by_row = torch.zeros((), dtype=torch.int64, device=dev)
        # Blocks of rows bound the int64 temporaries (the reductions may widen their input).
        for r0 in range(0, rows, _BLOCK_ROWS):
            xb = x[r0 : r0 + _BLOCK_ROWS]
            row_sums = xb.sum(dim=1, dtype=torch.int64)
            col_sums += xb.sum(dim=0, dtype=torch.int64)
            s[0] += row_sums.sum()
            # position i = r*C + c: (i+1)·w = C·r·w + (c+1)·w
            r = torch.arange(r0, r0 + xb.shape[0], dtype=torch.int64, device=dev)
            by_row += (((row_sums & _MASK) * r) & _MASK).sum()
        c = torch.arange(1, _ROW_WORDS + 1, dtype=torch.int64, device=dev)
        by_col = (((col_sums & _MASK) * c) & _MASK).sum()
        s[1] += ((by_row & _MASK) * _ROW_WORDS + by_col) & _MASK
    rest = flat[main_words * 4 :]
    if rest.numel():
        padded = torch.zeros((rest.numel() + 3) // 4 * 4, dtype=torch.uint8, device=dev)
        padded[: rest.numel()] = rest
        w = padded.view(torch.int32).to(torch.int64)
        pos = torch.arange(main_words + 1, main_words + 1 + w.numel(), dtype=torch.int64, device=dev)
        s[0] += w.sum()
        s[1] += (((w & _MASK) * pos) & _MASK).sum()
    return s & _MASK


#: Bytes per row when `wsum32_spans` reduces a whole slab (spans start on row boundaries).
_SPAN_ROW_BYTES = 256
#: Rows reduced at once by `wsum32_spans`: 128 MiB of slab, so a 256 MiB float64 temporary;
#: fewer, larger blocks mean fewer launches (the loader enqueues them while its readers run).
_SPAN_BLOCK_ROWS = (128 << 20) // _SPAN_ROW_BYTES


def wsum32_spans(slab: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """(s1, s2) of every span (byte offset, nbytes) of a uint8 `slab`, as an int64 tensor of
    shape [len(spans), 2] on the slab's device, in a number of torch ops that does not grow
    with the number of spans (no host sync): equal to `wsum32_parts` of each span's bytes.

    How: the slab is read as rows of R bytes (R = 256, or the largest power of two down to 4
    dividing every offset); per row r the sums a1[r] = Σ w and a2[r] = Σ (c+1)·w over its
    words. A span starting at row r0 with k whole rows then has
      s1 = Σ a1[r],  s2 = W·(Σ r·a1[r] − r0·Σ a1[r]) + Σ a2[r]   (r in [r0, r0+k), W words/row)
    read off prefix sums at its two ends, plus its last partial row (fewer than R bytes),
    gathered for all spans at once with the bytes past the span's end masked to zero. So the
    bytes between spans (alignment gaps, never written) do not matter. Every value is
    reduced mod 2^32 before it is multiplied or summed, so int64 never overflows.
    """
    if slab.dtype != torch.uint8 or slab.dim() != 1:
        raise ValueError(f"wsum32_spans needs a 1-D uint8 tensor, got {slab.dtype} of shape {tuple(slab.shape)}")
    dev = slab.device
    n = len(spans)
    out = torch.zeros(n, 2, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    size = slab.numel()
    _check_spans(spans, size)
    row_bytes = _SPAN_ROW_BYTES
    while row_bytes > 4 and any(off % row_bytes for off, _ in spans):
        row_bytes //= 2
    if any(off % 4 for off, _ in spans) or slab.data_ptr() % 4:
        for i, (off, nb) in enumerate(spans):   # not word-aligned: one span at a time
            out[i] = wsum32_parts(slab[off : off + nb])
        return out
    offs = torch.tensor([off for off, _ in spans], dtype=torch.int64)
    nbs = torch.tensor([nb for _, nb in spans], dtype=torch.int64)
    r0 = offs // row_bytes
    k = nbs // row_bytes                      # whole rows of each span
    rem = nbs - k * row_bytes                 # bytes in its last partial row
    # The per-span indices reach the device in one copy (each host-to-device copy of a
    # pageable tensor waits for the stream: the loader calls this while copies run).
    lo, hi, start, rem_d, k_d = torch.stack([r0, r0 + k, offs + k * row_bytes, rem, k]).to(dev)
    last_row = int((r0 + k).max())
    if last_row:
        _add_whole_rows(out, slab, row_bytes, last_row, lo, hi)
    if int(rem.max()):
        _add_partial_rows(out, slab, row_bytes, start, rem_d, k_d)
    return out & _MASK


def _check_spans(spans: list[tuple[int, int]], size: int) -> None:
    """Every span within the slab's `size` bytes, and none over 8 GiB."""
    for off, nb in spans:
        if off < 0 or nb < 0 or off + nb > size:
            raise ValueError(f"wsum32_spans: span ({off}, {nb}) outside the slab of {size} bytes")
        if nb >= 1 << 33:
            raise ValueError(f"wsum32: tensors over 8 GiB are not supported ({nb} bytes)")


def _add_whole_rows(out: torch.Tensor, slab: torch.Tensor, row_bytes: int, last_row: int,
                    lo: torch.Tensor, hi: torch.Tensor) -> None:
    """`wsum32_spans`' whole rows: per-row sums over the rows any span covers (the first
    `last_row`), then the sums of each span's rows [lo, hi) off their prefix sums, into `out`."""
    row_words = row_bytes // 4
    a1, a2, ar = _row_sums(slab, row_bytes, last_row)
    # Exclusive prefix sums: p[j] = Σ over rows < j (each term < 2^32, at most 2^31 rows).
    p1, p2, pr = a1.cumsum_(0), a2.cumsum_(0), ar.cumsum_(0)
    s1 = (p1[hi] - p1[lo]) & _MASK
    sr = (pr[hi] - pr[lo]) & _MASK
    s2 = ((((sr - ((lo * s1) & _MASK)) & _MASK) * row_words) + ((p2[hi] - p2[lo]) & _MASK)) & _MASK
    out[:, 0] = s1
    out[:, 1] = s2


def _row_sums(slab: torch.Tensor, row_bytes: int, last_row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row r's sums (r < last_row) at index r + 1 (index 0 stays 0): a1 = Σ w, a2 = Σ (c+1)·w
    and ar = r·a1[r], each mod 2^32, as int64 tensors of last_row + 1 on the slab's device."""
    dev = slab.device
    row_words = row_bytes // 4
    x = slab[: last_row * row_bytes].view(torch.int32).view(last_row, row_words)
    a1 = torch.zeros(last_row + 1, dtype=torch.int64, device=dev)
    a2 = torch.zeros(last_row + 1, dtype=torch.int64, device=dev)
    ar = torch.zeros(last_row + 1, dtype=torch.int64, device=dev)
    # Both row sums in one matrix product, in float64, where it is exact: the words are
    # read signed (equal to the unsigned ones mod 2^32, |w| < 2^31), so every product
    # (c+1)·w and every partial sum over a row is an integer below 2^43 < 2^53 whatever
    # the order of summation.
    weights = torch.stack([torch.ones(row_words, dtype=torch.float64, device=dev),
                           torch.arange(1, row_words + 1, dtype=torch.float64, device=dev)], dim=1)
    for b0 in range(0, last_row, _SPAN_BLOCK_ROWS):
        xb = x[b0 : b0 + _SPAN_BLOCK_ROWS].to(torch.float64)
        b1 = b0 + 1 + xb.shape[0]
        both = (xb @ weights).to(torch.int64)
        del xb
        torch.bitwise_and(both[:, 0], _MASK, out=a1[b0 + 1 : b1])
        torch.bitwise_and(both[:, 1], _MASK, out=a2[b0 + 1 : b1])
        rows = torch.arange(b0, b1 - 1, dtype=torch.int64, device=dev)
        torch.bitwise_and(rows * a1[b0 + 1 : b1], _MASK, out=ar[b0 + 1 : b1])
    return a1, a2, ar


def _add_partial_rows(out: torch.Tensor, slab: torch.Tensor, row_bytes: int, start: torch.Tensor,
                      rem_d: torch.Tensor, k_d: torch.Tensor) -> None:
    """`wsum32_spans`' last partial row of every span (`rem_d` bytes from byte `start`, after
    `k_d` whole rows), masked past the span's end, added into `out`."""
    dev = slab.device
    row_words = row_bytes // 4
    size = slab.numel()
    j = torch.arange(row_bytes, dtype=torch.int64, device=dev)
    idx = (start[:, None] + j).clamp_(max=size - 1)
    tail = torch.where(j < rem_d[:, None], slab[idx], 0).to(torch.uint8)
    w = tail.view(torch.int32).to(torch.int64) & _MASK          # [n, row_words]
    pos = k_d[:, None] * row_words + torch.arange(1, row_words + 1, dtype=torch.int64, device=dev)
    out[:, 0] += w.sum(dim=1)
    out[:, 1] += (((pos & _MASK) * w) & _MASK).sum(dim=1)


def wsum32_spans_in(slab: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """`wsum32_spans` reading only the bytes from the first span's row to the last span's end,
    so a group of tensors can be checksummed while other parts of the slab are still being
    written (the loader checksums each group as soon as its copies are done). Same result:
    a span's sums depend only on its own bytes, and the window starts on a row boundary."""
    if not spans:
        return wsum32_spans(slab[:0], [])
    base = min(off for off, _ in spans) // _SPAN_ROW_BYTES * _SPAN_ROW_BYTES
    end = max(off + nb for off, nb in spans)
    if base < 0 or end > slab.numel():
        raise ValueError(f"wsum32_spans: spans reach [{base}, {end}) outside the slab of {slab.numel()} bytes")
    return wsum32_spans(slab[base:end], [(off - base, nb) for off, nb in spans])


def wsum32_placed(views: list[torch.Tensor], places: list[tuple[int, int]], nbytes: list[int]) -> list[int]:
    """The wsum32 of every tensor stored at `places[i]` = (slab, byte offset) with `nbytes[i]`
    bytes in the uint8 slab tensors `views`: one `wsum32_spans` pass per slab, one copy of all
    results to the host."""
    by_slab: dict[int, list[int]] = {}
    for i, (slab, _) in enumerate(places):
        by_slab.setdefault(slab, []).append(i)
    order: list[int] = []
    parts = []
    for slab, idxs in sorted(by_slab.items()):
        parts.append(wsum32_spans(views[slab], [(places[i][1], nbytes[i]) for i in idxs]))
        order += idxs
    sums = torch.cat(parts).cpu().tolist() if parts else []
    out = [0] * len(places)
    for i, s in zip(order, sums):
        out[i] = wsum32_finish(s, nbytes[i])
    return out


def wsum32_finish(parts: tuple[int, int] | list[int], nbytes: int) -> int:
    """The wsum32 value from (s1, s2) and the byte count."""
    s1, s2 = int(parts[0]) & _MASK, int(parts[1]) & _MASK
    return (s1 ^ ((s2 * _K2) & _MASK) ^ ((nbytes * _KN) & _MASK)) & _MASK


def wsum32(t: torch.Tensor) -> int:
    """wsum32 of a tensor's bytes, on whatever device it lives (one host sync)."""
    nbytes = t.numel() * t.element_size()
    return wsum32_finish(wsum32_parts(t).tolist(), nbytes)


def wsum32_reference(data: bytes) -> int:
    """wsum32 straight from its definition (numpy, for tests and cross-checks)."""
    n = len(data)
    padded = data + b"\0" * (-n % 4)
    w = np.frombuffer(padded, dtype="<u4").astype(np.uint64)
    pos = np.arange(1, len(w) + 1, dtype=np.uint64)
    s1 = int(w.sum(dtype=np.uint64)) & _MASK  # uint64 wraps mod 2^64: fine mod 2^32
    s2 = int(((w * pos) & _MASK).sum(dtype=np.uint64)) & _MASK
    return wsum32_finish((s1, s2), n)


# --- CRC-32 of a concatenation from the CRCs of its pieces -------------------------------
def _gf2_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.int64) @ b.astype(np.int64)) & 1


def _zeros_operator(num_bytes: int) -> np.ndarray:
    """The 32x32 GF(2) matrix that feeds `num_bytes` zero bytes through the CRC register."""
    one_bit = np.zeros((32, 32), dtype=np.int64)
    for j in range(32):  # column j: the register after one zero bit when only bit j was set
        col = _CRC_POLY if j == 0 else 1 << (j - 1)
        one_bit[:, j] = [(col >> i) & 1 for i in range(32)]
    op = one_bit
    for _ in range(3):  # 8 zero bits = one zero byte
        op = _gf2_matmul(op, op)
    result = np.eye(32, dtype=np.int64)
    n = num_bytes
    while n:
        if n & 1:
            result = _gf2_matmul(op, result)
        op = _gf2_matmul(op, op)
        n >>= 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1 & _MASK
    bits = np.array([(crc1 >> i) & 1 for i in range(32)], dtype=np.int64)
    shifted = (_zeros_operator(len2) @ bits) & 1
    value = int(sum(int(b) << i for i, b in enumerate(shifted)))
    return (value ^ crc2) & _MASK


def crc32_of_pieces(pieces: list[tuple[int, int]]) -> int:
    """CRC-32 of consecutive pieces given as (crc32, length) in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length)
    return crc


"""Header validation: every malformed file fails with CheckpointError naming file, tensor and problem."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from resident.daemon.safetensors_io import CheckpointError, read_header


def write_raw(path, header: dict | bytes, data: bytes = b"", header_len: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def test_valid_file_from_safetensors_library(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16), "c": torch.ones(0)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    h = read_header(tmp_path / "m.safetensors")
    assert set(h.tensors) == {"a", "b", "c"}
    assert h.tensors["a"].shape == (3, 4) and h.tensors["a"].dtype == "F32" and h.tensors["a"].nbytes == 48
    assert h.tensors["b"].torch_dtype == torch.bfloat16
    assert h.metadata == {"format": "pt"}
    # The stored offsets point at the tensor's bytes.
    data = (tmp_path / "m.safetensors").read_bytes()
    off = h.file_offset("a")
    assert data[off : off + 48] == tensors["a"].numpy().tobytes()


def test_gaps_between_tensors_are_allowed(tmp_path):
    hdr = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
           "b": {"dtype": "U8", "shape": [2], "data_offsets": [6, 8]}}
    h = read_header(write_raw(tmp_path / "g.safetensors", hdr, bytes(8)))
    assert h.tensors["b"].begin == 6


def check_fails(path, *words):
    with pytest.raises(CheckpointError) as e:
        read_header(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "re-download or re-save" in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_truncated_file(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(b"\x10\x00\x00")
    check_fails(p, "shorter than the 8-byte header length")


def test_truncated_data(tmp_path):
    save_file({"w": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    p = tmp_path / "m.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    check_fails(p, "'w'", "beyond", "data section")


def test_header_length_beyond_file(tmp_path):
    p = write_raw(tmp_path / "h.safetensors", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
                  b"\0", header_len=10_000)
    check_fails(p, "header length 10000", "beyond the end")


def test_absurd_header_length(tmp_path):
    p = write_raw(tmp_path / "h.safetensors", b"{}", header_len=1 << 40)
    check_fails(p, "exceeds")


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe{}", b"[1, 2]", b'{"a": 1, "a": 2}'])
def test_invalid_json_header(tmp_path, raw):
    p = write_raw(tmp_path / "j.safetensors", raw)
    msg = check_fails(p)
    assert "JSON" in msg or "not an object" in msg or "entry is not an object" in msg


def test_offsets_out_of_range(tmp_path):
    hdr = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    check_fails(write_raw(tmp_path / "o.safetensors", hdr, bytes(8)), "'w'", "beyond the 8-byte data section")


@pytest.mark.parametrize("offsets", [[8, 4], [-4, 0], [0], "0-4", [0, 4.0], [True, 4]])
def test_malformed_offsets(tmp_path, offsets):
    hdr = {"w": {"dtype": "U8", "shape": [4], "data_offsets": offsets}}
    check_fails(write_raw(tmp_path / "o.safetensors", hdr, bytes(16)), "'w'", "data_offsets")


def test_overlapping_tensors(tmp_path):
    hdr = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    msg = check_fails(write_raw(tmp_path / "ov.safetensors", hdr, bytes(24)), "overlap")
    assert "'a'" in msg and "'b'" in msg


def test_dtype_shape_nbytes_mismatch(tmp_path):
    hdr = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}}
    check_fails(write_raw(tmp_path / "m.safetensors", hdr, bytes(24)), "'w'", "needs 24", "mismatch")


@pytest.mark.parametrize("shape", [[-1, 2], [2.5], "2x2", [None]])
def test_bad_shape(tmp_path, shape):
    hdr = {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 4]}}
    check_fails(write_raw(tmp_path / "s.safetensors", hdr, bytes(4)), "'w'", "shape")


def test_unknown_dtype(tmp_path):
    hdr = {"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}
    check_fails(write_raw(tmp_path / "d.safetensors", hdr, bytes(1)), "'w'", "unknown dtype 'F7'")


def test_metadata_must_be_strings(tmp_path):
    hdr = {"__metadata__": {"format": 1}}
    check_fails(write_raw(tmp_path / "md.safetensors", hdr), "__metadata__")


def test_all_dtypes_accepted(tmp_path):
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
             "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
    hdr, off = {}, 0
    for d, n in sizes.items():
        hdr[d.lower()] = {"dtype": d, "shape": [3], "data_offsets": [off, off + 3 * n]}
        off += 3 * n
    h = read_header(write_raw(tmp_path / "all.safetensors", hdr, bytes(off)))
    assert {t.dtype for t in h.tensors.values()} == set(sizes)
    for t in h.tensors.values():
        assert t.torch_dtype.itemsize == sizes[t.dtype]

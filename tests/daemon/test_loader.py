"""The loader: dtype casts, model keys, checksums, progress, packing, and failing before allocating."""
from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from fake_hub import COMMIT, fake_hub
from recording_backend import recording_backend
from resident.daemon import loader, tensor_reader
from resident.daemon.load_plan import key_for
from resident.daemon.loader import LoadSpec, load, pack
from resident.daemon.safetensors_io import CheckpointError
from resident.daemon.tensor_table import crc32_of


@pytest.fixture
def backend():
    yield from recording_backend(64 << 10)


def views_of(m):
    return m.table.views([s.readable() for s in m.slabs])


@pytest.mark.parametrize(
    "src,requested,stored",
    [("float32", "bfloat16", torch.bfloat16), ("float32", "float16", torch.float16),
     ("bfloat16", "float32", torch.float32), ("bfloat16", "auto", torch.bfloat16),
     ("float16", "auto", torch.float16), ("float32", "auto", torch.float32)],
)
def test_dtype_cast(tiny_model, backend, src, requested, stored):
    folder = tiny_model("llama", dtype=src)
    hf = load_file(str(folder / "model.safetensors"))
    m = load(LoadSpec(str(folder), dtype=requested), backend)
    v = views_of(m)
    assert m.dtype == str(stored).removeprefix("torch.")
    assert all(t.dtype == stored for t in v.values())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(v[name], hf[name].to(stored)), name
    a = "model.layers.0.self_attn"
    want = torch.cat([hf[f"{a}.{x}_proj.weight"] for x in "qkv"]).to(stored)
    assert torch.equal(v[f"{a}.qkv_proj.weight"], want)


def test_cast_in_chunks_equals_whole(tiny_model, backend, monkeypatch):
    folder = tiny_model("llama")
    monkeypatch.setattr(tensor_reader, "_CAST_CHUNK_BYTES", 1000)  # many partial reads per tensor
    v = views_of(load(LoadSpec(str(folder), dtype="bfloat16"), backend))
    hf = load_file(str(folder / "model.safetensors"))
    assert torch.equal(v["model.embed_tokens.weight"], hf["model.embed_tokens.weight"].to(torch.bfloat16))


def test_checksums_and_accounting(tiny_model, backend):
    folder = tiny_model("qwen3", max_shard_size="100KB")
    events = []
    m = load(LoadSpec(str(folder), name="tiny"), backend, events.append)
    v = views_of(m)
    for e in m.table.entries:
        assert e.crc32 == crc32_of(v[e.name]), e.name
        assert e.offset % backend.alignment == 0
        assert e.strides == tuple(v[e.name].stride())
    assert m.name == "tiny" and m.source == str(folder.resolve())
    assert m.nbytes == sum(s.desc.nbytes for s in m.slabs) >= m.table.nbytes
    hf_bytes = sum(t.numel() * t.element_size() for f in folder.glob("*.safetensors")
                   for t in load_file(str(f)).values())
    assert m.bytes_read == hf_bytes  # every stored tensor read exactly once
    phases = [e.phase for e in events]
    assert phases[0] == "validate" and phases[-2:] == ["pack", "done"] and "read" in phases
    assert all(e.bytes_total == m.bytes_read for e in events)
    done = [e.bytes_done for e in events]
    assert done == sorted(done) and done[-1] == m.bytes_read
    assert m.content_checksum == loader.content_checksum(m.table.entries)
    assert all(s.sealed for s in m.slabs)


def test_content_checksum_tracks_content(tiny_model, backend):
    a = load(LoadSpec(str(tiny_model("llama", name="a", seed=0))), backend)
    b = load(LoadSpec(str(tiny_model("llama", name="b", seed=0))), backend)
    c = load(LoadSpec(str(tiny_model("llama", name="c", seed=1))), backend)
    assert a.content_checksum == b.content_checksum != c.content_checksum


def test_model_key(tiny_model, backend):
    folder = tiny_model("llama")
    spec = LoadSpec(str(folder))
    k1, src = key_for(spec)
    assert key_for(spec)[0] == k1  # nothing changed
    assert load(spec, backend).key == k1
    assert src.folder == folder.resolve()
    assert key_for(LoadSpec(str(folder), dtype="bfloat16"))[0] != k1
    assert key_for(LoadSpec(str(folder), quantization="fp8_per_tensor"))[0] != k1
    assert key_for(LoadSpec(str(folder), dtype="float32"))[0] == k1  # auto resolves to float32 here
    q = LoadSpec(str(folder), quantization="fp8_per_tensor", dtype="bfloat16")
    assert load(q, backend).key == key_for(q)[0]

    f = folder / "model.safetensors"
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touch
    k2 = key_for(spec)[0]
    assert k2 != k1
    tensors = load_file(str(f))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(f), metadata={"format": "pt"})  # rewrite
    k3 = key_for(spec)[0]
    assert k3 not in (k1, k2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (folder / "config.json").write_text(json.dumps(cfg))
    assert key_for(spec)[0] not in (k1, k2, k3)


def test_hub_key_uses_the_revision(tiny_model, tmp_path, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    snap = fake_hub(tmp_path / "hub", "org/tiny", tiny_model("llama"))
    spec = LoadSpec("org/tiny", hub_cache=str(tmp_path / "hub"))
    k1, src = key_for(spec)
    assert src.revision == COMMIT
    m = load(spec, backend)
    assert m.key == k1
    # Another commit with the same files is another key.
    other = "f" * 40
    os.symlink(snap, snap.parent / other)
    (snap.parent.parent / "refs" / "main").write_text(other)
    assert key_for(spec)[0] != k1


def test_corrupt_checkpoint_fails_before_allocating(tiny_model, backend):
    folder = tiny_model("llama", max_shard_size="100KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10])  # truncated
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        load(LoadSpec(str(folder)), backend)
    assert backend.slabs == []
    (n,) = struct.unpack("<Q", data[:8])
    shard.write_bytes(struct.pack("<Q", n + 10_000_000) + data[8:])  # header length beyond the file
    with pytest.raises(CheckpointError, match="beyond the end"):
        key_for(LoadSpec(str(folder)))
    with pytest.raises(CheckpointError):
        load(LoadSpec(str(folder)), backend)
    assert backend.slabs == []


def test_tensor_in_two_shards_is_refused(tiny_model, backend):
    folder = tiny_model("llama")
    save_file({"model.norm.weight": torch.ones(64)}, str(folder / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="stored twice"):
        load(LoadSpec(str(folder)), backend)


def test_failure_while_reading_releases_slabs(tiny_model, backend, monkeypatch):
    folder = tiny_model("llama")
    real = tensor_reader._load_tensor
    calls = []

    def flaky(t, *a):
        calls.append(t.name)
        if len(calls) == 5:
            raise CheckpointError("disk went away")
        return real(t, *a)

    monkeypatch.setattr(tensor_reader, "_load_tensor", flaky)
    with pytest.raises(CheckpointError, match="disk went away"):
        load(LoadSpec(str(folder)), backend, num_threads=1)
    assert backend.slabs and all(s._fd is None for s in backend.slabs)  # every memfd closed


def test_pack():
    places, sizes = pack([100, 300, 50, 5000, 10], alignment=256, limit=1024)
    assert places == [(0, 0), (0, 256), (0, 768), (1, 0), (2, 0)]
    assert sizes == [818, 5000, 256]
    assert pack([0], 256, 1024) == ([(0, 0)], [256])


def test_crc_of_zero_copy_views_matches_file_bytes(tiny_model, backend):
    folder = tiny_model("mistral")
    m = load(LoadSpec(str(folder)), backend)
    e = next(e for e in m.table.entries if e.name == "model.norm.weight")
    raw = load_file(str(folder / "model.safetensors"))["model.norm.weight"].numpy().tobytes()
    assert e.crc32 == zlib.crc32(raw)



def test_a_load_gives_the_allocators_free_gpu_memory_back(tmp_path, monkeypatch):
    """After every load (also a failed one) the caching allocator's free blocks go back to the
    driver when CUDA is in use: the daemon would hold its staging temporaries for nothing."""
    import torch

    from resident.daemon import loader as loader_module
    from resident.daemon.memory import get_backend

    backend = get_backend("host_shm")
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    with pytest.raises(Exception, match="missing"):
        loader_module.load(LoadSpec(model=str(tmp_path / "missing")), backend)
    assert calls == [1]

"""`resident bench checkpoint OUT`: a random-weight HF Llama checkpoint for benchmarks.

`--shape llama3-8b` is Llama-3-8B's shape (hidden 4096, 32 layers, 32/8 heads of 128,
intermediate 14336, vocab 128256, untied; ~16 GB in bf16); `tiny` is a few hundred KB for
tests. Weights are N(0, 0.02) like HF's initialisation (norms 1), so logits are not flat.
They are generated on the GPU where there is one and streamed into safetensors files
written here directly (header first, then each tensor's bytes with pwrite from a few
threads), in ~5 GB shards with an index — the format HF and resident read. Beside them:
config.json (LlamaForCausalLM), generation_config.json and a tokenizer of the shape's
size (cli/bench_tokenizer.py): Llama-3's for llama3-8b (128,256 ids, random merges, so
its load on a worker's start-up costs what a real one does), a byte-level one with a
ChatML template for tiny; the folder can be served as it is.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click

from resident.cli.bench_tokenizer import LLAMA3_BOS_ID, LLAMA3_EOS_IDS, write_byte_tokenizer, write_llama3_tokenizer

log = logging.getLogger(__name__)

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=2048, rope_theta=500000.0),
}
#: Each shape's tokenizer (cli/bench_tokenizer.py) and the BOS / EOS ids its config names.
TOKENIZERS = {"llama3-8b": "llama3", "tiny": "byte"}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
INIT_STD = 0.02
DEFAULT_SHARD_BYTES = 5_000_000_000
#: Bytes generated and written per piece (rows of a tensor).
_PIECE_BYTES = 256 << 20


@dataclass(frozen=True)
class Placed:
    name: str
    shape: tuple[int, ...]
    shard: int
    offset: int       # within the shard's data section
    nbytes: int


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Llama checkpoint (untied), in the order HF writes them."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def place(shapes: dict[str, tuple[int, ...]], itemsize: int, num_shards: int) -> list[Placed]:
    """Assign tensors to shards in order: `num_shards` of about equal size (0: ~5 GB each)."""
    total = sum(math.prod(s) * itemsize for s in shapes.values())
    if num_shards <= 0:
        num_shards = max(1, math.ceil(total / DEFAULT_SHARD_BYTES))
    target = math.ceil(total / num_shards)
    out: list[Placed] = []
    shard, offset = 0, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if offset and offset + n > target and shard < num_shards - 1:
            shard, offset = shard + 1, 0
        out.append(Placed(name, shape, shard, offset, n))
        offset += n
    return out


def shard_names(num: int) -> list[str]:
    if num == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{num:05d}.safetensors" for k in range(num)]


def _header(entries: list[Placed], dtype_tag: str) -> bytes:
    doc: dict = {"__metadata__": {"format": "pt"}}
    for e in entries:
        doc[e.name] = {"dtype": dtype_tag, "shape": list(e.shape), "data_offsets": [e.offset, e.offset + e.nbytes]}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _special_ids(shape: str) -> dict:
    if TOKENIZERS[shape] == "llama3":
        return {"bos_token_id": LLAMA3_BOS_ID, "eos_token_id": list(LLAMA3_EOS_IDS)}
    return {"bos_token_id": 1, "eos_token_id": 2}   # the byte tokenizer's <|im_start|>, <|im_end|>


def write_tokenizer(folder: Path, shape: str, seed: int = 0) -> None:
    """The shape's tokenizer files (TOKENIZERS) and generation_config.json with its ids."""
    if TOKENIZERS[shape] == "llama3":
        write_llama3_tokenizer(folder, seed)
    else:
        write_byte_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps(_special_ids(shape)) + "\n")


def hf_config(shape: str, dtype: str) -> dict:
    s = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **s, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": INIT_STD, **_special_ids(shape), "torch_dtype": dtype,
        "use_cache": True,
    }


def write_checkpoint(out: Path, shape: str = "llama3-8b", dtype: str = "bfloat16", device: str = "auto",
                     num_shards: int = 0, seed: int = 0, progress=None) -> dict:
    """Write the checkpoint to `out` (which must not exist or be empty); returns a summary."""
    import torch

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid shapes: {', '.join(SHAPES)}")
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(SAFETENSORS_DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is usable here; use --device cpu")
    cfg = hf_config(shape, dtype)
    tdtype = getattr(torch, dtype)
    placed = place(tensor_shapes(cfg), tdtype.itemsize, num_shards)
    num = max(p.shard for p in placed) + 1
    names = shard_names(num)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    fds, data_start = [], []
    try:
        for k in range(num):
            entries = [p for p in placed if p.shard == k]
            header = _header(entries, SAFETENSORS_DTYPES[dtype])
            fd = os.open(out / names[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            fds.append(fd)
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + sum(p.nbytes for p in entries))
            data_start.append(len(header))
        _fill(placed, fds, data_start, tdtype, torch.device(device), seed, progress)
    finally:
        for fd in fds:
            os.close(fd)
    total = sum(p.nbytes for p in placed)
    if num > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {p.name: names[p.shard] for p in placed}}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(out, shape, seed)
    elapsed = time.monotonic() - t0
    return {"path": str(out), "shape": shape, "dtype": dtype, "device": device, "num_shards": num,
            "num_tensors": len(placed), "bytes": total, "seconds": elapsed}


def _fill(placed: list[Placed], fds: list[int], data_start: list[int], dtype, device, seed: int, progress) -> None:
    """Generate each tensor in row pieces on `device`, stage it in (pinned) host buffers and
    pwrite it from a few threads."""
    import torch

    pinned = device.type == "cuda"
    free: queue.SimpleQueue = queue.SimpleQueue()
    num_buffers = 6
    for _ in range(num_buffers):
        free.put(None)
    gen = torch.Generator(device=device)
    done = 0
    total = sum(p.nbytes for p in placed)

    def write(buf, nbytes: int, fd: int, pos: int):
        view = memoryview(buf.numpy())[:nbytes]
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, view[written:], pos + written)
        return buf

    with ThreadPoolExecutor(max_workers=num_buffers, thread_name_prefix="resident-ckpt") as pool:
        futures = []
        for idx, p in enumerate(placed):
            gen.manual_seed(seed * 1_000_003 + idx)
            rows = p.shape[0]
            row_bytes = p.nbytes // rows
            step = max(1, _PIECE_BYTES // row_bytes)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                shape = (r1 - r0, *p.shape[1:])
                if len(p.shape) == 1:  # norms: ones
                    piece = torch.ones(shape, dtype=dtype, device=device)
                else:
                    piece = (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * INIT_STD).to(dtype)
                item = free.get()  # a write that will hand its buffer back, or None: allocate one
                buf = item.result() if item is not None else torch.empty(_PIECE_BYTES, dtype=torch.uint8,
                                                                          pin_memory=pinned)
                n = piece.numel() * piece.element_size()
                buf[:n].copy_(piece.reshape(-1).view(torch.uint8))  # synchronous: the buffer holds the bytes
                fut = pool.submit(write, buf, n, fds[p.shard], data_start[p.shard] + p.offset + r0 * row_bytes)
                free.put(fut)
                futures.append(fut)
                done += n
                if progress is not None:
                    progress(done, total)
        for f in futures:
            f.result()


def _remove_partial(out: Path, existed: bool) -> None:
    """Remove what a failed write left in OUT (it was empty or replaced): a partial checkpoint loads as garbage."""
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
    elif out.is_dir():
        for p in out.iterdir():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


@click.command("checkpoint")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--shape", default="llama3-8b", show_default=True, type=click.Choice(sorted(SHAPES)))
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(sorted(SAFETENSORS_DTYPES)))
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]),
              help="Where to generate the random weights (auto: cuda if available).")
@click.option("--shards", default=0, show_default=True, type=click.IntRange(min=0),
              help="Number of safetensors files (0: about 5 GB each).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def bench_checkpoint(out: Path, shape: str, dtype: str, device: str, shards: int, seed: int, force: bool) -> None:
    """Write a random-weight Llama checkpoint (Llama-3-8B shape by default) to OUT."""
    if out.exists() and any(out.iterdir()):
        if not force:
            raise click.UsageError(f"{out} exists and is not empty; pass --force to replace it")
        shutil.rmtree(out)
    existed = out.exists()
    last = [0.0]
    t0 = time.monotonic()

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 1.0 or done == total:
            last[0] = now
            click.echo(f"\r{done / 1e9:6.2f}/{total / 1e9:.2f} GB  {done / 1e9 / max(now - t0, 1e-9):5.2f} GB/s",
                       nl=done == total, err=True)

    try:
        summary = write_checkpoint(out, shape, dtype, device, shards, seed, progress)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except OSError as e:   # a read-only place, a full disk (the default shape is 16 GB): a message, not a traceback
        _remove_partial(out, existed)
        fix = "free some space or choose another OUT" if e.errno == errno.ENOSPC else "choose another OUT"
        raise click.ClickException(f"cannot write the checkpoint to {out}: {e.strerror or e}; nothing was kept; "
                                   f"{fix}") from None
    click.echo(f"wrote {summary['bytes'] / 1e9:.2f} GB ({summary['num_tensors']} tensors, {summary['num_shards']} "
               f"shard(s), {dtype}, generated on {summary['device']}) to {out} in {summary['seconds']:.1f} s")

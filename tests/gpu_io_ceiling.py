"""The I/O ceiling of a GPU load on this host, measured without resident's loader: how fast
the page cache can be read into pinned host memory by N threads, and how fast pinned
memory reaches the GPU. The preload goal (GB/s) cannot beat the slower of the two.

Run on the GPU machine after the checkpoint was written (its files are in the page cache):
    python3 tests/gpu_io_ceiling.py CHECKPOINT_DIR --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

MiB = 1 << 20


def page_cache_read(files: list[Path], threads: int, chunk: int) -> float:
    """GB/s of preads of every file (chunk-sized pieces, round-robin over threads) into one
    pinned buffer per thread."""
    jobs = []
    for f in files:
        size = f.stat().st_size
        jobs.extend((f, off, min(chunk, size - off)) for off in range(0, size, chunk))
    pin = torch.cuda.is_available()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(threads)]
    lock = threading.Lock()
    it = iter(jobs)
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    total = sum(n for _, _, n in jobs)

    def worker(i: int) -> None:
        view = memoryview(bufs[i].numpy())
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            f, off, n = job
            got = os.preadv(fds[f], [view[:n]], off)
            assert got == n

    t = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    dt = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return total / dt / 1e9


def h2d(nbytes: int, streams: int, repeats: int = 4) -> float:
    """GB/s of pinned host -> device copies, the buffer split over `streams` streams."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ss = [torch.cuda.Stream() for _ in range(streams)]
    part = nbytes // streams
    best = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i, s in enumerate(ss):
            with torch.cuda.stream(s):
                dst[i * part:(i + 1) * part].copy_(src[i * part:(i + 1) * part], non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    files = sorted(Path(args.checkpoint).glob("*.safetensors"))
    out: dict = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "cpus": os.cpu_count()}
    out["page_cache_read_gb_s"] = {}
    for threads, chunk_mib in ((1, 16), (8, 16), (16, 16), (16, 64)):
        rate = page_cache_read(files, threads, chunk_mib * MiB)
        out["page_cache_read_gb_s"][f"{threads}x{chunk_mib}MiB"] = rate
        print(f"page cache -> pinned, {threads} threads, {chunk_mib} MiB chunks: {rate:.1f} GB/s", flush=True)
    out["h2d_gb_s"] = {}
    for streams in (1, 2, 4):
        rate = h2d(1 << 30, streams)
        out["h2d_gb_s"][str(streams)] = rate
        print(f"pinned -> GPU, {streams} stream(s): {rate:.1f} GB/s", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

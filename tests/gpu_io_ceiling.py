"""The I/O ceiling of a GPU load on this host, measured without resident's loader: how fast
the page cache can be read into pinned host memory by N threads, and how fast pinned
memory reaches the GPU. The preload goal (GB/s) cannot beat the slower of the two.

Run on the GPU machine after the checkpoint was written (its files are in the page cache):
    python3 tests/gpu_io_ceiling.py CHECKPOINT_DIR --json OUT.json

`--sweep` measures resident's own staged GPU load instead, once per staging configuration
(threads x chunk MiB x buffers x streams, the knobs of $RESIDENT_STAGING_*) and way of pinning
(`--pins`, $RESIDENT_STAGING_PIN's values): each is loaded twice into cuda_vmm slabs — the
first load pins a fresh staging pool alongside its reads, the second reuses it, as the daemon's
loads do — then fp8_per_tensor with the best one. Before the loads, `--pins` also times pinning
the default pool alone (each way, alternating, three times) and pinned -> GPU copies out of it.
    python3 tests/gpu_io_ceiling.py CHECKPOINT_DIR --sweep --json OUT.json   (~30-60 s for 16 GB)

`--direct` measures the other way round the staging buffers: the files mapped (read-only,
shared: the page cache itself), page-aligned windows of the mapping locked with
`cudaHostRegister(..., cudaHostRegisterReadOnly)`, copied to the GPU straight out of the page
cache, unlocked again — per window size and thread count; and the locking alone.
    python3 tests/gpu_io_ceiling.py CHECKPOINT_DIR --direct --json OUT.json
"""
from __future__ import annotations

import argparse
import dataclasses
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


#: threads x chunk MiB x buffers (0: threads + 8) x streams; the first is the default config.
SWEEP = "16x16x0x4,16x32x0x4,16x64x0x4,12x32x0x4,14x32x0x4,16x32x48x4,16x32x0x2,16x32x0x8"


def direct(files: list[Path], out: dict, windows_mib=(16, 64, 256), threads_list=(4, 8, 16)) -> None:
    """GB/s of page cache -> GPU copies out of the registered file mappings (see the docstring)."""
    import mmap
    import warnings

    cudart = torch.cuda.cudart()
    flags = 1 | 8          # cudaHostRegisterPortable | cudaHostRegisterReadOnly
    maps = []
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            maps.append((mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), size))
        finally:
            os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # "not writable": only read from here
        srcs = [torch.frombuffer(mm, dtype=torch.uint8) for mm, _ in maps]
    total = sum(size for _, size in maps)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    rows = out["direct"] = []

    def run(window: int, threads: int, copy: bool) -> float:
        jobs, base = [], 0
        for src, (_, size) in zip(srcs, maps):
            jobs.extend((src, off, min(window, size - off), base + off) for off in range(0, size, window))
            base += size
        it, lock, errors = iter(jobs), threading.Lock(), []

        def worker() -> None:
            stream = torch.cuda.Stream()
            while True:
                with lock:
                    job = next(it, None)
                if job is None or errors:
                    return
                src, off, n, at = job
                ptr = src.data_ptr() + off
                err = cudart.cudaHostRegister(ptr, n, flags)
                if err != cudart.cudaError.success:
                    errors.append(f"cudaHostRegister({n} bytes of a file mapping): {cudart.cudaGetErrorString(err)}")
                    return
                if copy:
                    with torch.cuda.stream(stream):
                        dst[at : at + n].copy_(src[off : off + n], non_blocking=True)
                    stream.synchronize()
                cudart.cudaHostUnregister(ptr)

        torch.cuda.synchronize()
        t = time.perf_counter()
        ts = [threading.Thread(target=worker) for _ in range(threads)]
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        torch.cuda.synchronize()
        if errors:
            raise RuntimeError(errors[0])
        return total / (time.perf_counter() - t) / 1e9

    try:
        for window_mib in windows_mib:
            for threads in threads_list:
                for copy in (False, True):
                    rate = run(window_mib * MiB, threads, copy)
                    rows.append({"window_mib": window_mib, "threads": threads, "copy": copy, "gb_s": rate})
                    print(f"DIRECT {'register+copy' if copy else 'register only'}, {window_mib} MiB windows, "
                          f"{threads} threads: {rate:.1f} GB/s", flush=True)
    except RuntimeError as e:
        out["direct_error"] = str(e)
        print(f"DIRECT failed: {e}", flush=True)
        return
    # the copies' bytes are the files' (each file's first and last MiB checked)
    start = 0
    for src, (_, size) in zip(srcs, maps):
        for lo in (0, max(0, size - MiB)):
            hi = min(size, lo + MiB)
            assert torch.equal(dst[start + lo : start + hi].cpu(), src[lo:hi]), "a copied window differs from its file"
        start += size
    print("DIRECT copies equal the files", flush=True)


def _parse_configs(text: str) -> list:
    from resident.daemon.staging import StagingConfig

    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            threads, chunk_mib, buffers, streams = (int(v) for v in item.split("x"))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not THREADSxCHUNK_MIBxBUFFERSxSTREAMS (e.g. 16x32x0x4)") from None
        out.append(StagingConfig(buffer_bytes=chunk_mib * MiB, num_buffers=buffers, num_streams=streams,
                                 num_threads=threads))
    return out


def _timed_load(model: str, backend, config, quantization: str = "none") -> tuple[float, float, int]:
    """(seconds, GB/s, slabs) of one load into `backend`; its slabs are closed again."""
    from resident.daemon.loader import LoadSpec, load

    t = time.perf_counter()
    m = load(LoadSpec(model, quantization=quantization), backend, staging=config, staged=True)
    dt = time.perf_counter() - t
    n = len(m.slabs)
    for slab in m.slabs:
        slab.close()
    return dt, m.bytes_read / dt / 1e9, n


def pin_probe(pins: list[str], out: dict, rounds: int = 3) -> None:
    """Seconds to pin the default staging pool (24 x 16 MiB on 16 CPUs) each way, and GB/s of
    copies out of it into the GPU (4 streams)."""
    from resident.daemon.staging import HostBuffers, StagingConfig

    config = StagingConfig()
    rows = out["pin_probe"] = []
    dst = torch.empty(config.buffers() * config.buffer_bytes, dtype=torch.uint8, device="cuda")
    ss = [torch.cuda.Stream() for _ in range(4)]
    for r in range(rounds):
        for pin in pins:
            t = time.perf_counter()
            host = HostBuffers(config.buffers(), config.buffer_bytes, pinned=True, pin=pin)
            host.join()
            pin_s = time.perf_counter() - t
            bufs = [host.get(i) for i in range(len(host.buffers))]
            best = 0.0
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for i, b in enumerate(bufs):
                    with torch.cuda.stream(ss[i % len(ss)]):
                        dst[i * b.numel() : (i + 1) * b.numel()].copy_(b, non_blocking=True)
                torch.cuda.synchronize()
                best = max(best, dst.numel() / (time.perf_counter() - t) / 1e9)
            rows.append({"round": r, "pin": pin, "how": host.describe(), "pin_s": pin_s, "h2d_gb_s": best})
            print(f"PIN {pin} ({host.describe()}): {config.buffers()} x {config.buffer_bytes >> 20} MiB in "
                  f"{pin_s * 1e3:.1f} ms, pinned -> GPU {best:.1f} GB/s", flush=True)
            del bufs
            host.release()
            if pin == "torch":
                torch._C._host_emptyCache()


def sweep(model: str, configs: list, out: dict, backend_name: str = "cuda_vmm") -> None:
    """GB/s of `resident`'s staged load (page cache -> GPU slabs, checksums included) per config."""
    import logging

    from resident.daemon.memory import get_backend
    from resident.daemon.staging import StagingPool

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    backend = get_backend(backend_name)
    rows = out["sweep"] = []
    for config in configs:
        backend.staging_pool = pool = StagingPool()
        try:
            first = _timed_load(model, backend, config)     # pins the pool alongside its reads
            again = _timed_load(model, backend, config)     # the pool kept, as in the daemon
        finally:
            pool.close()
        rows.append({"config": config.describe(), "pin": config.pin, "first_s": first[0], "first_gb_s": first[1],
                     "again_s": again[0], "again_gb_s": again[1]})
        print(f"SWEEP {config.describe()}, pinned by {config.pin}: {again[1]:.1f} GB/s ({again[0]:.3f} s) "
              "with the pool kept, "
              f"{first[1]:.1f} GB/s ({first[0]:.3f} s) pinning it", flush=True)
    best = max(range(len(configs)), key=lambda i: rows[i]["again_gb_s"])
    for i in sorted({0, best}):
        backend.staging_pool = pool = StagingPool()
        try:
            _timed_load(model, backend, configs[i], "fp8_per_tensor")
            dt, rate, _ = _timed_load(model, backend, configs[i], "fp8_per_tensor")
        finally:
            pool.close()
        out.setdefault("fp8_per_tensor", []).append({"config": configs[i].describe(), "s": dt, "gb_s": rate})
        print(f"SWEEP fp8_per_tensor {configs[i].describe()}: {rate:.1f} GB/s ({dt:.3f} s)", flush=True)
    print("SWEEP best: " + rows[best]["config"] + f" {rows[best]['again_gb_s']:.1f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--json", required=True)
    ap.add_argument("--sweep", action="store_true", help="time resident's staged load per staging config instead")
    ap.add_argument("--backend", default="cuda_vmm", help="for --sweep: the slabs' backend (host_shm: a CPU "
                    "smoke test of this script)")
    ap.add_argument("--configs", default=SWEEP, help="for --sweep: THREADSxCHUNK_MIBxBUFFERSxSTREAMS,... "
                    f"[default: {SWEEP}]")
    ap.add_argument("--direct", action="store_true", help="time copies straight out of the registered page cache")
    ap.add_argument("--pins", default="register", help="for --sweep: each config once per way of pinning "
                    "(register,torch), alternating; also times pinning alone")
    args = ap.parse_args()
    files = sorted(Path(args.checkpoint).glob("*.safetensors"))
    if args.direct:
        out = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "cpus": os.cpu_count()}
        out["page_cache_read_gb_s"] = page_cache_read(files, 16, 64 * MiB)
        print(f"page cache -> pinned, 16 threads, 64 MiB chunks: {out['page_cache_read_gb_s']:.1f} GB/s", flush=True)
        try:
            direct(files, out)
        finally:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return
    if args.sweep:
        pins = [p.strip() for p in args.pins.split(",") if p.strip()]
        configs = [dataclasses.replace(c, pin=p) for c in _parse_configs(args.configs) for p in pins]
        out = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "cpus": os.cpu_count()}
        # Bring the files into the page cache (and report the ceiling the loads run against).
        out["page_cache_read_gb_s"] = page_cache_read(files, 16, 64 * MiB)
        print(f"page cache -> pinned, 16 threads, 64 MiB chunks: {out['page_cache_read_gb_s']:.1f} GB/s", flush=True)
        try:
            if args.backend.startswith("cuda"):
                pin_probe(pins, out)
            sweep(args.checkpoint, configs, out, args.backend)
        finally:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return
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

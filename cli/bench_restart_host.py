"""What `resident bench restart` does around its timed starts: warm the page cache with the
checkpoint, have the preload daemon load the model (its read throughput), read the daemon's
Attach time from its /metrics, and name the GPU for the report.
"""
from __future__ import annotations

import logging
import re
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)


def warm_page_cache(folder: Path) -> float:
    """Read the checkpoint's files once, so cold starts measure page-cache reads."""
    t = time.monotonic()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.monotonic() - t


def daemon_preload(model: str, sock: str, dtype: str, quantization: str, tensor_parallel_size: int = 1) -> dict:
    """Load MODEL into the daemon at `sock`: its load time, bytes read and GB/s."""
    from resident.daemon.client import Client

    t = time.monotonic()
    final = None
    read = 0
    with Client(sock, client_name="resident-bench") as client:
        for event in client.load(model, dtype=dtype, quantization=quantization,
                                 tensor_parallel_size=tensor_parallel_size):
            if event.done:
                final = event
            else:
                read = event.bytes_total
    wall = time.monotonic() - t
    if final is None:
        raise RuntimeError("the daemon ended the load without a result")
    out = {"load_s": final.elapsed_s, "wall_s": wall, "resident_bytes": final.model.nbytes,
           "bytes_read": read if not final.already_resident else 0, "already_resident": final.already_resident}
    out["gb_s"] = out["bytes_read"] / 1e9 / final.elapsed_s if final.elapsed_s > 0 else 0.0
    return out


def daemon_attach_s(sock: str) -> tuple[float, int] | None:
    """(total seconds, count) the daemon spent in Attach RPCs, from its /metrics (None if unreadable)."""
    import urllib.request

    try:
        address = Path(sock + ".http").read_text().strip()
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (OSError, ValueError) as e:
        log.warning("could not read the daemon's metrics: %s", e)
        return None
    found = {m.group(1): float(m.group(2))
             for m in re.finditer(r"^resident_attach_seconds_(sum|count) ([0-9.e+-]+)$", text, re.M)}
    return (found["sum"], int(found["count"])) if len(found) == 2 else None


def gpu_name() -> str:
    """nvidia-smi's "name, memory" of the first GPU ("" without one)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""

"""How much of the daemon client's import an attaching start could hide behind `import torch`
(tried in session 18 as process_prep.start_client_import, reverted in 5897bfe: docs/benchmarks.md):
fresh interpreters, alternating, each timing `import torch` then `import resident.daemon.client`,
serially or with the client imported in a thread started first. Prints one line per run and the
medians.
    python3 tests/import_overlap_probe.py [RUNS]        (default 6 of each; ~4 s a run on the H200 hosts)
"""
from __future__ import annotations

import statistics
import subprocess
import sys

_RUN = r"""
import importlib, sys, threading, time
t0 = time.perf_counter()
if sys.argv[1] == "thread":
    threading.Thread(target=importlib.import_module, args=("resident.daemon.client",), daemon=True).start()
import torch
t1 = time.perf_counter()
import resident.daemon.client
print(f"{t1 - t0:.4f} {time.perf_counter() - t0:.4f}")
"""


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    totals: dict[str, list[float]] = {"serial": [], "thread": []}
    for _ in range(runs):
        for mode in totals:
            out = subprocess.run([sys.executable, "-c", _RUN, mode], capture_output=True, text=True, check=True)
            torch_s, total_s = (float(x) for x in out.stdout.split())
            totals[mode].append(total_s)
            print(f"{mode}: import torch {torch_s:.3f} s, with the client {total_s:.3f} s", flush=True)
    for mode, values in totals.items():
        print(f"MEDIAN {mode}: {statistics.median(values):.3f} s over {len(values)} runs", flush=True)


if __name__ == "__main__":
    main()

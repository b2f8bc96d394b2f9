"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A batch-1 decode step is ~330 dependent kernels, most of them short; between two of them the
GPU drains the first grid, then launches and ramps up the second — a gap of a few microseconds
per boundary, the same inside a CUDA graph. With PDL a kernel is launched with the
`PROGRAMMATIC_STREAM_SERIALIZATION` attribute (Triton: `launch_pdl=True`): its programs may be
scheduled as soon as every program of the kernel before it has executed
`griddepcontrol.launch_dependents`, and they wait in `griddepcontrol.wait` until that kernel has
completed and its memory is visible. The launch and the programs' start-up then overlap the
previous kernel's tail instead of following it. CUDA graphs keep the relation (stream capture
records it as a programmatic edge).

The protocol every PDL kernel here follows (`enter`, the first thing each program does):

1. `griddepcontrol.launch_dependents` — the next kernel may start launching;
2. `griddepcontrol.wait` — before any load of a PDL kernel's output and before any store.

So a kernel never writes memory, nor reads what a PDL kernel writes, while the kernel before it
still runs, and since every program waits before it ends, a kernel that has passed its wait
knows that all earlier kernels of the stream have completed (each of them waited for its own
predecessor). A kernel launched without the attribute (cuBLAS, torch's own, a copy) waits for
everything before it as usual, and a PDL kernel after it launches once it completes (it never
triggers early): mixing is safe, and what such work wrote before the first PDL kernel of a run
of them is complete before any of them starts. Before its wait a kernel may therefore read
memory no PDL kernel writes — weights, constant tables, and a step's metadata (sequence
lengths, positions, slots, block tables: written by copies and torch ops before the step's
first kernel) — which takes those reads off the chain of round trips that follows the previous
kernel's completion: the row GEMV's first weight tile and scales, the norm weight, the decode
attention's metadata and rotary row (docs/benchmarks.md, "Session 17"). Only small reads: more
of a weight stream moved under the kernel before slows that kernel down (measured there too).

Where it pays (H200, Llama-3-8B shape, 1k-token contexts, same host, 96 steps; docs/benchmarks.md
"Session 12"): decode steps of few rows. With every launch under PDL, batch 1 bf16 4.60 -> 4.37 ms
a step, fp8 3.21 -> 3.14; batch 32 bf16 6.12 -> 6.01 (fp8 level); batches 8 and 16 level; batch 64
lost (bf16 6.94 -> 7.09 ms, fp8 5.55 -> 5.71). So a launch takes it only for at most MAX_ROWS rows
(tokens, sequences): decode batches up to 32 and prefill chunks as short as the warm-up's.

One switch, RESIDENT_PDL, read once when this module is imported (`PDL_MODE`): `on` (the
default: launches of at most MAX_ROWS rows), `all` (every launch: for measurements) or `off`.
GPUs before compute capability 9.0 have no griddepcontrol and never take it; neither does
Triton's CPU interpreter, nor a Triton without the `launch_pdl` option (before 3.3). Launch
sites pass `**launch(device, rows)`: the kernel's PDL constexpr and, only when on, the option.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from resident.worker.kernels._util import env_mode, sm90_or_later

try:   # Triton 3.3+; the project allows 3.2, whose launcher has no PDL option: PDL is then never used
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    TRITON_HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:
    TRITON_HAS_PDL = False

    @triton.jit
    def gdc_launch_dependents():   # never reached: `enabled` is False without TRITON_HAS_PDL
        pass

    @triton.jit
    def gdc_wait():
        pass

#: RESIDENT_PDL values.
PDL_MODES = ("off", "on", "all")
DEFAULT_PDL_MODE = "on"
#: `on` launches with PDL only work of at most this many rows.
MAX_ROWS = 32


def pdl_mode(env: Mapping[str, str]) -> str:
    """The RESIDENT_PDL value in `env` (unset or empty: DEFAULT_PDL_MODE)."""
    return env_mode(env, "RESIDENT_PDL", "PDL mode", PDL_MODES, DEFAULT_PDL_MODE)


#: Read once per process; `enabled` consults it.
PDL_MODE = pdl_mode(os.environ)


def enabled(device: torch.device, rows: int) -> bool:
    """Whether a kernel over `rows` rows (tokens, sequences) on `device` launches with PDL: by
    RESIDENT_PDL (`on`: rows <= MAX_ROWS), on a CUDA GPU of compute capability 9.0+ (never on the
    CPU, where only Triton's interpreter runs these kernels)."""
    if (PDL_MODE == "off" or not TRITON_HAS_PDL or device.type != "cuda"
            or (PDL_MODE == "on" and rows > MAX_ROWS)):
        return False
    return sm90_or_later(device)


def launch(device: torch.device, rows: int) -> dict[str, bool]:
    """A PDL kernel's launch keywords for `rows` rows on `device` (`kernel[grid](..., **launch(...))`):
    its PDL constexpr and, when on, `launch_pdl` — the two always agree; off, no `launch_pdl` at all
    (Triton before 3.3 rejects it)."""
    on = enabled(device, rows)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def enter(PDL: tl.constexpr = False):
    """A PDL kernel's first step (see the module's protocol): let the next kernel launch, then
    wait for the previous one. Nothing when PDL is off."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def launch_next(PDL: tl.constexpr = False):
    """`enter`'s first half alone, for kernels that do something before their wait (only loads of
    memory no kernel writes, such as `prefetch_l2` of a weight)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_previous(PDL: tl.constexpr = False):
    """`enter`'s second half (see `launch_next`)."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` (a tensor of pointers) to be brought into L2
    (`prefetch.global.L2`: no registers, no wait; read-only memory only)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


__all__ = ["DEFAULT_PDL_MODE", "MAX_ROWS", "PDL_MODE", "PDL_MODES", "TRITON_HAS_PDL", "enabled", "enter",
           "launch", "launch_next", "pdl_mode", "prefetch_l2", "wait_previous"]

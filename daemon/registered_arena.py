"""Pinned host memory made outside the driver (`RegisteredArena`, the "register" way of
staging.py's module docstring): one anonymous mapping aligned to 2 MiB with transparent huge
pages asked for, each piece faulted in by a few threads, then page-locked with
`cudaHostRegister`.

The CUDA calls (`_cuda_register`, `_cuda_unregister`) need a GPU; tests replace them (there is
no GPU in CI), so the rest runs anywhere.
"""
from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable

import torch

log = logging.getLogger("resident.daemon.staging")   # its lines kept their logger name

HUGE_PAGE = 2 << 20   # 2 MiB


def _cuda_register(ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 1)      # cudaHostRegisterPortable: every context's
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {cudart.cudaGetErrorString(err)}")


def _cuda_unregister(ptr: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(ptr)
    if err != cudart.cudaError.success:
        log.warning("staging pool: cudaHostUnregister failed: %s", cudart.cudaGetErrorString(err))


def _fault_in(piece: torch.Tensor, threads: int) -> None:
    """Write one byte of every 4 KiB page of `piece` from `threads` threads (torch releases the
    GIL in the write, so the page faults run in parallel)."""
    parts = max(1, min(threads, piece.numel() // HUGE_PAGE))
    step = -(-piece.numel() // parts // HUGE_PAGE) * HUGE_PAGE
    spans = [piece[lo : lo + step] for lo in range(0, piece.numel(), step)]
    workers = [threading.Thread(target=lambda t=t: t[::4096].zero_(), name="resident-staging-fault") for t in spans[1:]]
    for w in workers:
        w.start()
    spans[0][::4096].zero_()
    for w in workers:
        w.join()


class RegisteredArena:
    """Pinned host memory made outside the driver ("register", the module docstring): one
    anonymous mapping, its 2 MiB-aligned part asked for transparent huge pages; `take(n)` faults
    in the next n bytes and page-locks them with cudaHostRegister. `release()` unlocks every
    piece; the mapping goes when the last tensor viewing it does (torch keeps the mmap object
    alive through the buffer it exports). `register`/`unregister`: the CUDA calls (tests pass
    their own: there is no GPU in CI)."""

    def __init__(self, nbytes: int, fault_threads: int = 4, register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None) -> None:
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        offset = -whole.data_ptr() % HUGE_PAGE
        self.huge_pages = True
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
        except (AttributeError, OSError, ValueError):   # no THP in this kernel: 4 KiB pages, still correct
            self.huge_pages = False
        self.tensor = whole[offset : offset + nbytes]
        self.fault_threads = fault_threads
        self._register, self._unregister = register or _cuda_register, unregister or _cuda_unregister
        self._next = 0
        self._locked: list[int] = []

    def take(self, nbytes: int) -> torch.Tensor:
        piece = self.tensor[self._next : self._next + nbytes]
        if piece.numel() != nbytes:
            raise ValueError(f"the arena has {self.tensor.numel() - self._next} bytes left, not {nbytes}")
        _fault_in(piece, self.fault_threads)
        self._register(piece.data_ptr(), nbytes)
        self._locked.append(piece.data_ptr())
        self._next += nbytes
        return piece

    def release(self) -> None:
        locked, self._locked = self._locked, []
        for ptr in locked:
            self._unregister(ptr)


"""The staging ring one load reads through (`StagingRing`): the pool's buffers handed out to
reader threads, each only once every copy that last read it has completed, and the copy
streams of each device of the load.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from resident.daemon.staging import HostBuffers
    from resident.daemon.staging_config import StagingConfig


class StagingRing:
    """The staging buffers of one load and the copy streams of each of its devices (one for a
    whole-model load; every GPU that receives a copy for a sharded one, shard_gpu.py).

    A buffer is handed out only after every copy that last read it has completed (its event
    on each device), so a reader never overwrites bytes a copy engine is still reading; and,
    on a fresh pool, only once it is pinned. Events and streams are made once per load, not
    per chunk.
    """

    def __init__(self, config: StagingConfig, devices: torch.device | Sequence[torch.device],
                 host: HostBuffers) -> None:
        self.config = config
        self.devices = [devices] if isinstance(devices, torch.device) else list(devices)
        self.device = self.devices[0]
        self.cuda = self.device.type == "cuda"
        self.host = host
        n = len(host.buffers)
        self.buffers: list[torch.Tensor | None] = [None] * n
        self.memoryviews: list[memoryview | None] = [None] * n
        # blocking=True: waiters sleep instead of spinning on a core. One list per device.
        self._events = [[torch.cuda.Event(blocking=True) for _ in range(n)] for _ in self.devices] if self.cuda \
            else []
        self._recorded = [False] * n
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(n):
            self._free.put(i)
        #: per device, its copy streams (None on the CPU)
        self.device_streams = [[torch.cuda.Stream(device=d) if self.cuda else None for _ in range(config.num_streams)]
                               for d in self.devices]
        self.streams = self.device_streams[0]   # the first device's
        self._lock = threading.Lock()
        self.wait_s = 0.0    # time readers waited for a free (or not yet pinned) buffer, summed over threads

    def acquire(self) -> int:
        t0 = time.monotonic()
        i = self._free.get()
        try:
            if self.buffers[i] is None:   # first use in this load: maybe still being pinned
                buf = self.host.get(i)
                self.memoryviews[i] = memoryview(buf.numpy())
                self.buffers[i] = buf
            if self._recorded[i]:
                for events in self._events:
                    events[i].synchronize()
        except BaseException:
            self._free.put(i)
            raise
        dt = time.monotonic() - t0
        with self._lock:
            self.wait_s += dt
        return i

    def release(self, i: int, stream_index: int) -> None:
        """Return buffer `i` once the work enqueued so far on stream `stream_index` of every
        device is done with it."""
        if self.cuda:
            for events, streams in zip(self._events, self.device_streams):
                events[i].record(streams[stream_index])
            self._recorded[i] = True
        self._free.put(i)

    def on_stream(self, index: int, device: int = 0) -> contextlib.AbstractContextManager:
        """Stream `index` of the `device`-th device made current (nothing on the CPU)."""
        s = self.device_streams[device][index]
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    def synchronize(self) -> None:
        for streams in self.device_streams:
            for s in streams:
                if s is not None:
                    s.synchronize()

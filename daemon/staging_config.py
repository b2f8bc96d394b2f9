"""The sizes of the GPU load's host staging (`StagingConfig`) and the environment variables
they are read from, once, where a daemon or a bench starts (`StagingConfig.from_env`). The
buffers themselves are staging.py's; the pinning modes (`PIN_MODES`) are described there.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MiB = 1 << 20

#: The environment variables `StagingConfig.from_env` reads (once, where a daemon or a bench starts).
ENV_VARS = {
    "RESIDENT_STAGING_THREADS": "num_threads",
    "RESIDENT_STAGING_CHUNK_MIB": "buffer_bytes",
    "RESIDENT_STAGING_BUFFERS": "num_buffers",
    "RESIDENT_STAGING_STREAMS": "num_streams",
}
#: How pinned buffers are made ($RESIDENT_STAGING_PIN; staging.py's module docstring says what each does).
PIN_MODES = ("register", "torch")
PIN_ENV = "RESIDENT_STAGING_PIN"


@dataclass(frozen=True)
class StagingConfig:
    """Sizes of the GPU load pipeline. Pinned host memory = num_buffers x buffer_bytes; a
    buffer holds one chunk (a tensor is read in chunks of buffer_bytes)."""

    buffer_bytes: int = 16 * MiB
    num_buffers: int = 0            # 0: reader threads + 8
    num_streams: int = 4
    num_threads: int = 0            # 0: min(16, CPU count)
    pin: str = "register"           # PIN_MODES

    def __post_init__(self) -> None:
        if self.pin not in PIN_MODES:
            raise ValueError(f"staging pin must be one of {', '.join(PIN_MODES)}, got {self.pin!r}")
        if self.buffer_bytes < 64 << 10 or self.buffer_bytes % (64 << 10):
            raise ValueError(f"staging buffer_bytes must be a positive multiple of 64 KiB, got {self.buffer_bytes}")
        for name in ("num_buffers", "num_streams", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"staging {name} must be >= 0, got {getattr(self, name)}")
        if self.num_streams == 0:
            raise ValueError("staging num_streams must be at least 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: int) -> StagingConfig:
        """`defaults` overridden by $RESIDENT_STAGING_THREADS, _CHUNK_MIB, _BUFFERS, _STREAMS, _PIN
        (unset or empty: the default). Read once at start (daemon, bench), never per load."""
        env = os.environ if env is None else env
        values: dict = dict(defaults)
        pin = env.get(PIN_ENV, "").strip()
        if pin:
            if pin not in PIN_MODES:
                raise ValueError(f"${PIN_ENV}={pin!r} is not one of {', '.join(PIN_MODES)}; unset it or pick one")
            values["pin"] = pin
        for var, field_name in ENV_VARS.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                n = int(raw)
            except ValueError:
                raise ValueError(f"${var}={raw!r} is not an integer; unset it or give a number") from None
            if n < 0 or (field_name == "buffer_bytes" and n == 0):
                raise ValueError(f"${var}={raw!r} must be {'positive' if field_name == 'buffer_bytes' else '>= 0'}")
            values[field_name] = n * MiB if field_name == "buffer_bytes" else n
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{e} (from ${', $'.join([*ENV_VARS, PIN_ENV])})") from None

    def threads(self) -> int:
        return self.num_threads or min(16, os.cpu_count() or 1)

    def buffers(self) -> int:
        return self.num_buffers or self.threads() + 8

    def describe(self) -> str:
        return (f"{self.threads()} threads x {self.buffer_bytes // MiB} MiB chunks, {self.buffers()} buffers, "
                f"{self.num_streams} streams")

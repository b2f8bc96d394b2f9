"""`resident snapshot doctor`: can this host snapshot a worker, and if not, what fixes it.

Checks: a usable CRIU (system ≥ 4.2, else the managed tree), privileges (root, or
CAP_SYS_ADMIN / CAP_CHECKPOINT_RESTORE), `criu check`, the kernel, and on hosts with an NVIDIA
driver the driver's checkpoint API. `create` and `restore` run the same checks first.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from resident.worker.criu import INSTALL_HINT, CriuBinary, find_criu

CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def privileges() -> Check:
    caps = _cap_eff()
    names = [n for bit, n in ((CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_CHECKPOINT_RESTORE, "CAP_CHECKPOINT_RESTORE"))
             if caps & (1 << bit)]
    if caps & (1 << CAP_SYS_ADMIN):
        return Check("privileges", True, "root" if os.geteuid() == 0 else ", ".join(names))
    have = ", ".join(names) or "no checkpoint capabilities"
    return Check("privileges", False, f"uid {os.geteuid()} with {have}",
                 "run as root (sudo resident snapshot ...); CRIU needs CAP_SYS_ADMIN to dump and restore")


def _cap_eff() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def criu_check(binary: CriuBinary | None, privileged: bool) -> Check:
    if binary is None:
        return Check("criu check", False, "no usable CRIU", INSTALL_HINT)
    if not privileged:
        return Check("criu check", False, "not run: needs privileges", "run as root")
    ok, text = binary.check()
    return Check("criu check", ok, "Looks good." if ok else text[-300:],
                 "" if ok else "see `criu check --all`; the kernel may lack checkpoint/restore support")


def cuda_check() -> Check | None:
    """The driver checkpoint API; None on hosts without an NVIDIA driver (CPU snapshots only)."""
    if shutil.which("nvidia-smi") is None and not Path("/proc/driver/nvidia").exists():
        return None
    from resident.worker.cuda_checkpoint import driver_support

    ok, detail = driver_support()
    return Check("cuda checkpoint", ok, detail, "" if ok else "needs NVIDIA driver >= 570 and cuda-python >= 12.8")


def run_checks() -> list[Check]:
    found = find_criu()
    if found.binary is not None:
        criu = Check("criu", True, f"{found.binary.describe()}: {found.reason()}")
    else:
        criu = Check("criu", False, found.reason(), INSTALL_HINT)
    priv = privileges()
    checks = [criu, priv, criu_check(found.binary, priv.ok),
              Check("kernel", True, os.uname().release, required=False)]
    gpu = cuda_check()
    if gpu is not None:
        checks.append(gpu)
    return checks


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        mark = "ok" if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"{c.name:<{width}}  {mark:<4}  {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{'':<{width}}        fix: {c.fix}")
    return "\n".join(lines)


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.required and not c.ok]


__all__ = ["Check", "criu_check", "cuda_check", "failures", "format_table", "privileges", "run_checks"]

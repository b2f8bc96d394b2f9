"""CRIU for snapshots: find a usable criu (the system's if ≥ 4.2, else the project-managed
tree installed by `resident snapshot install-criu`), and run `dump`, `restore` and `check`.

The managed tree is Debian testing's criu with its own libc, so it runs through the tree's
dynamic loader: `<tree>/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path <libs>
<tree>/usr/sbin/criu`. Only the standard library here (the CLI imports it without torch).

Pitfalls this module handles (see issue 6): a dumped tree's PIDs must be free again before a
restore (else "File exists"); stdout/stderr pipes and external Unix sockets are outside the
dumped tree (`--ext-unix-sk`, and the CLI refuses pipes); a process that is not its own
session leader needs `--shell-job`; live TCP connections need `--tcp-established`.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_CRIU_VERSION = (4, 2)
STAMP_FILE = "resident-criu.json"
_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")
_LOADER = "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
_VERSION = re.compile(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?")
INSTALL_HINT = "resident snapshot install-criu"
#: How long `criu --version` and `criu check` may take before the criu counts as unusable.
VERSION_TIMEOUT_S = 30.0
CHECK_TIMEOUT_S = 60.0


class CriuError(RuntimeError):
    """CRIU is missing or failed; the message names the log to read or the fix."""


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def default_criu_dir(env: Mapping[str, str] | None = None) -> Path:
    """$RESIDENT_CRIU_DIR, else ~/.cache/resident/criu (XDG_CACHE_HOME respected)."""
    env = os.environ if env is None else env
    if env.get("RESIDENT_CRIU_DIR"):
        return Path(env["RESIDENT_CRIU_DIR"]).expanduser().resolve()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache, "resident", "criu").resolve()


@dataclass(frozen=True)
class CriuBinary:
    """How to run one criu: argv prefix, its version and where it came from."""
    argv: tuple[str, ...]
    version: tuple[int, ...]
    source: str            # "system" | "managed"
    path: str              # the criu executable (inside the tree for "managed")

    def __post_init__(self) -> None:
        if self.source not in ("system", "managed"):
            raise ValueError(f"source must be 'system' or 'managed', got {self.source!r}")
        if not self.argv:
            raise ValueError("argv must not be empty")

    @classmethod
    def from_path(cls, path: str) -> CriuBinary:
        argv = (path,)
        return cls(argv, _probe_version(argv), "system", path)

    @classmethod
    def from_tree(cls, tree: Path) -> CriuBinary:
        criu = tree / "usr/sbin/criu"
        loader = tree / _LOADER
        for needed in (criu, loader):
            if not needed.is_file():
                raise CriuError(f"{needed} is missing: the CRIU tree at {tree} is incomplete; "
                                f"run `{INSTALL_HINT} --force`")
        libs = ":".join(str(tree / d) for d in _LIB_DIRS if (tree / d).is_dir())
        argv = (str(loader), "--library-path", libs, str(criu))
        return cls(argv, _probe_version(argv), "managed", str(criu))

    def describe(self) -> str:
        return f"{self.path} ({self.source}, version {format_version(self.version)})"

    def run(self, args: Sequence[str], timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        return run_group([*self.argv, *args], timeout_s)

    def check(self) -> tuple[bool, str]:
        """`criu check`: (ok, its message)."""
        try:
            proc = self.run(["check"], timeout_s=CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False, f"`{self.path} check` did not finish within {CHECK_TIMEOUT_S:g} s"
        text = (proc.stdout + proc.stderr).strip()
        return proc.returncode == 0 and "Looks good" in text, text


#: After killing a timed-out criu's process group: how long to wait for its output pipes to close.
_KILLED_DRAIN_S = 5.0


def run_group(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s), but criu (or a wrapper
    script) runs in a session of its own, and past its timeout — or when we are interrupted — the
    whole process group is killed: subprocess.run kills only the direct child, so a wrapper's
    criu, or the children criu forks, kept running. Raises TimeoutExpired as run does."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as e:
        _kill_group(proc)
        try:   # what the group wrote; a process that left the group may hold the pipes open
            out, err = proc.communicate(timeout=_KILLED_DRAIN_S)
        except subprocess.TimeoutExpired:
            out, err = None, None
        finally:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(list(argv), timeout_s, output=out, stderr=err) from None
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (its session's; start_new_session made it leader)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()   # the group is gone (or not ours): at least the child


def _probe_version(argv: Sequence[str]) -> tuple[int, ...]:
    try:
        proc = run_group([*argv, "--version"], VERSION_TIMEOUT_S)
    except OSError as e:
        raise CriuError(f"cannot run {argv[-1]}: {e}") from None
    except subprocess.TimeoutExpired:   # a wrapper waiting for a password, say: `snapshot doctor` said nothing
        raise CriuError(f"{argv[-1]} --version did not answer within {VERSION_TIMEOUT_S:g} s") from None
    m = _VERSION.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or m is None:
        output = (proc.stderr or proc.stdout).strip()[-500:]
        raise CriuError(f"{argv[-1]} --version failed (exit {proc.returncode}): {output}")
    return tuple(int(g) for g in m.groups() if g is not None)


@dataclass(frozen=True)
class CriuLookup:
    """The usable criu (or None) and, for each candidate, why it was taken or passed over."""
    binary: CriuBinary | None
    notes: tuple[str, ...]

    def reason(self) -> str:
        return "; ".join(self.notes)


def find_criu(env: Mapping[str, str] | None = None) -> CriuLookup:
    """The system criu if ≥ MIN_CRIU_VERSION, else the managed tree's (default_criu_dir)."""
    env = os.environ if env is None else env
    notes: list[str] = []
    want = format_version(MIN_CRIU_VERSION)
    system = shutil.which("criu", path=env.get("PATH"))
    if system is not None:
        try:
            binary = CriuBinary.from_path(system)
        except CriuError as e:
            notes.append(f"system criu unusable: {e}")
        else:
            if binary.version >= MIN_CRIU_VERSION:
                return CriuLookup(binary, (f"system criu {format_version(binary.version)} at {system}",))
            notes.append(f"system criu {format_version(binary.version)} at {system} is older than {want} "
                         "(kernels >= 6.13 need >= 4.2)")
    else:
        notes.append("no criu on PATH")
    tree = default_criu_dir(env)
    if not tree.is_dir():
        notes.append(f"no managed CRIU at {tree}; install it with `{INSTALL_HINT}`")
        return CriuLookup(None, tuple(notes))
    try:
        binary = CriuBinary.from_tree(tree)
    except CriuError as e:
        notes.append(str(e))
        return CriuLookup(None, tuple(notes))
    if binary.version < MIN_CRIU_VERSION:
        notes.append(f"managed criu {format_version(binary.version)} at {tree} is older than {want}; "
                     f"run `{INSTALL_HINT} --force`")
        return CriuLookup(None, tuple(notes))
    notes.append(f"managed criu {format_version(binary.version)} at {tree}")
    return CriuLookup(binary, tuple(notes))


@dataclass(frozen=True)
class CriuOptions:
    """The options a dump was taken with; restore repeats the ones that must match."""
    shell_job: bool = False
    tcp_established: bool = True
    ext_unix_sk: bool = True
    file_locks: bool = True
    extra: tuple[str, ...] = ()

    def common_args(self) -> list[str]:
        args = []
        if self.shell_job:
            args.append("--shell-job")
        if self.tcp_established:
            args.append("--tcp-established")
        if self.ext_unix_sk:
            args.append("--ext-unix-sk")
        if self.file_locks:
            args.append("--file-locks")
        return [*args, *self.extra]

    def to_json(self) -> dict:
        return {"shell_job": self.shell_job, "tcp_established": self.tcp_established,
                "ext_unix_sk": self.ext_unix_sk, "file_locks": self.file_locks, "extra": list(self.extra)}

    @classmethod
    def from_json(cls, data: Mapping) -> CriuOptions:
        return cls(bool(data["shell_job"]), bool(data["tcp_established"]), bool(data["ext_unix_sk"]),
                   bool(data["file_locks"]), tuple(str(x) for x in data.get("extra", ())))


def options_for(pid: int) -> CriuOptions:
    """Dump options for the tree rooted at `pid`: --shell-job when it is not its own session leader
    (started from a shell without setsid) or holds a terminal."""
    shell_job = os.getsid(pid) != pid or any(_is_tty(t) for t in fd_targets(pid).values())
    return CriuOptions(shell_job=shell_job)


def _is_tty(target: str) -> bool:
    return target.startswith(("/dev/pts/", "/dev/tty", "/dev/console"))


def fd_targets(pid: int) -> dict[int, str]:
    """fd -> what /proc/PID/fd/N points at ('pipe:[123]', 'socket:[45]', a path)."""
    out = {}
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            out[int(name)] = os.readlink(os.path.join(base, name))
        except OSError:
            continue  # closed meanwhile
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (threads excluded), from /proc/*/task/*/children."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split())
            except OSError:
                pass
    return tree


@dataclass(frozen=True)
class CriuResult:
    seconds: float
    log_path: Path
    pid: int = 0                       # restore: the root pid of the restored tree
    args: tuple[str, ...] = field(default=())


def _log_tail(path: Path, n: int = 15, max_bytes: int = 1 << 20) -> str:
    # Only the end is read: a criu stuck in a loop at -v4 writes gigabytes of log.
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return "\n".join((errors or lines)[-n:])


def _run(binary: CriuBinary, args: list[str], timeout_s: float, what: str, log_path: Path) -> float:
    """Run criu with args; its seconds, or CriuError naming `what` with the log's errors."""
    t = time.monotonic()
    try:
        proc = binary.run(args, timeout_s)
    except subprocess.TimeoutExpired:   # run() has killed criu; the caller cleans up what it left
        raise CriuError(f"{what} did not finish within {timeout_s:g} s (criu was killed); from {log_path}:\n"
                        f"{_log_tail(log_path)}") from None
    seconds = time.monotonic() - t
    if proc.returncode != 0:
        raise CriuError(f"{what} failed (exit {proc.returncode}); from {log_path}:\n{_log_tail(log_path)}")
    return seconds


def dump(binary: CriuBinary, pid: int, images_dir: Path, options: CriuOptions, log_path: Path,
         leave_running: bool, timeout_s: float = 600.0) -> CriuResult:
    """`criu dump` of the tree rooted at `pid` into images_dir (which must exist and be empty)."""
    args = ["dump", "--tree", str(pid), "--images-dir", str(images_dir), "--log-file", str(log_path),
            "-v4", *options.common_args()]
    if leave_running:
        args.append("--leave-running")
    seconds = _run(binary, args, timeout_s, f"criu dump of pid {pid}", log_path)
    logger.info("criu dump of pid %d: %.2f s", pid, seconds)
    return CriuResult(seconds, log_path, pid, tuple(args))


def restore(binary: CriuBinary, images_dir: Path, options: CriuOptions, log_path: Path,
            timeout_s: float = 600.0) -> CriuResult:
    """`criu restore --restore-detached`; the restored tree is reparented away from us."""
    pidfile = log_path.with_suffix(".pid")
    args = ["restore", "--images-dir", str(images_dir), "--log-file", str(log_path), "-v4",
            "--restore-detached", "--pidfile", str(pidfile), *options.common_args()]
    seconds = _run(binary, args, timeout_s, f"criu restore from {images_dir}", log_path)
    pid = int(pidfile.read_text().strip())
    logger.info("criu restore of pid %d: %.2f s", pid, seconds)
    return CriuResult(seconds, log_path, pid, tuple(args))


def pid_state(pid: int) -> str | None:
    """The one-letter /proc state ('R', 'S', 'Z', ...) or None when the pid is free."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2]


def kill_tree(pids: Sequence[int], wait_s: float = 0.0) -> None:
    """SIGKILL each of pids (gone ones are fine); with wait_s, wait up to that long until each is
    gone or a zombie (its parent may never reap it)."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while any(pid_state(p) not in (None, "Z") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def wait_pids_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` exists (zombies count as existing); returns those still there."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if pid_state(p) is not None]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


__all__ = ["CriuBinary", "CriuError", "CriuLookup", "CriuOptions", "CriuResult", "INSTALL_HINT", "MIN_CRIU_VERSION",
           "STAMP_FILE", "default_criu_dir", "dump", "fd_targets", "find_criu", "format_version", "kill_tree",
           "options_for", "pid_state", "process_tree", "restore", "wait_pids_gone"]

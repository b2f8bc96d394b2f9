"""Install the project-managed CRIU: criu ≥ 4.2 from Debian's testing suite, unpacked into a
private tree, with no change to the system.

Kernels ≥ 6.13 need CRIU ≥ 4.2 (3.17 trips over the vDSO layout, 4.1 over sockets on ≥ 6.16),
and Debian 12 ships 3.17. Debian testing ships 4.2.x built against a newer glibc, so the tree
carries that suite's libc6 too and criu runs through the tree's own dynamic loader
(`ld-linux-x86-64.so.2 --library-path ...`, see resident.worker.criu.CriuBinary).

Steps, all under a temporary directory: a private apt configuration (own sources list,
lists, status and cache dirs) pointing at the suite; `apt-get update`; the dependency closure
of criu from `apt-cache depends --recurse`; `apt-get download` (apt checks every .deb against
the signed index); `dpkg-deb -x` of each into a new tree; `criu --version` run from the tree
must report ≥ 4.2; the tree is renamed into place and stamped (`resident-criu.json`: version,
suite, sha256 of every .deb). Running it again with a working tree does nothing.

Only the standard library and the apt/dpkg tools (present on Debian and Ubuntu).
Run as `resident snapshot install-criu` or `python -m resident.cli.criu_install`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from resident.worker.criu import (MIN_CRIU_VERSION, STAMP_FILE, CriuBinary, CriuError, default_criu_dir,
                                  format_version)

logger = logging.getLogger(__name__)

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SUITE = "testing"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")


class InstallError(RuntimeError):
    pass


@dataclass(frozen=True)
class InstallConfig:
    target_dir: Path
    mirror: str = DEFAULT_MIRROR
    suite: str = DEFAULT_SUITE
    keyring: str = DEBIAN_KEYRING
    force: bool = False

    def __post_init__(self) -> None:
        if not self.target_dir.is_absolute():
            raise ValueError(f"target_dir must be absolute, got {self.target_dir}")
        if not self.mirror.startswith(("http://", "https://", "file:/")):
            raise ValueError(f"mirror must be an http(s) or file URL, got {self.mirror!r}")


def installed_binary(target_dir: Path) -> CriuBinary | None:
    """The tree's criu if it is stamped, runs and is new enough; else None."""
    if not (target_dir / STAMP_FILE).is_file():
        return None
    try:
        binary = CriuBinary.from_tree(target_dir)
    except CriuError as e:
        logger.info("the CRIU tree at %s is not usable (%s); reinstalling", target_dir, e)
        return None
    return binary if binary.version >= MIN_CRIU_VERSION else None


def install(config: InstallConfig) -> CriuBinary:
    """Install (or keep) the managed CRIU tree at config.target_dir; returns its binary."""
    if not config.force:
        existing = installed_binary(config.target_dir)
        if existing is not None:
            logger.info("CRIU %s already installed at %s", format_version(existing.version), config.target_dir)
            return existing
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise InstallError(f"{tool} not found: the CRIU installer needs a Debian or Ubuntu host; elsewhere "
                               "install criu >= 4.2 from your distribution, or copy an installed tree to "
                               "$RESIDENT_CRIU_DIR")
    if not os.path.isfile(config.keyring):
        raise InstallError(f"{config.keyring} is missing: install the debian-archive-keyring package")
    config.target_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="resident-criu-apt-") as work:
        apt_conf = _write_apt_config(Path(work), config)
        env = dict(os.environ, APT_CONFIG=str(apt_conf), LC_ALL="C")
        _run(["apt-get", "-q", "update"], env, "apt-get update (can this host reach " + config.mirror + "?)")
        packages = dependency_closure("criu", env)
        debs_dir = Path(work) / "debs"
        debs_dir.mkdir()
        _run(["apt-get", "-q", "download", *packages], env, "apt-get download", cwd=debs_dir)
        debs = sorted(debs_dir.glob("*.deb"))
        if len(debs) != len(packages):
            raise InstallError(f"apt-get download fetched {len(debs)} packages, expected {len(packages)}")
        tree = Path(tempfile.mkdtemp(prefix=config.target_dir.name + ".tmp-", dir=config.target_dir.parent))
        try:
            for deb in debs:
                _run(["dpkg-deb", "-x", str(deb), str(tree)], env, f"dpkg-deb -x {deb.name}")
            binary = CriuBinary.from_tree(tree)
            if binary.version < MIN_CRIU_VERSION:
                raise InstallError(f"{config.suite} ships criu {format_version(binary.version)}, older than "
                                   f"{format_version(MIN_CRIU_VERSION)}; try --suite sid")
            stamp = {"version": format_version(binary.version), "suite": config.suite, "mirror": config.mirror,
                     "debs": {d.name: hashlib.sha256(d.read_bytes()).hexdigest() for d in debs}}
            (tree / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
            tree.chmod(0o755)
            _replace_dir(tree, config.target_dir)
        except BaseException:
            shutil.rmtree(tree, ignore_errors=True)
            raise
    binary = CriuBinary.from_tree(config.target_dir)
    logger.info("installed CRIU %s at %s (%d packages from %s)", format_version(binary.version),
                config.target_dir, len(debs), config.suite)
    return binary


def dependency_closure(package: str, env: dict[str, str]) -> list[str]:
    """`package` and everything it depends on (no recommends), as concrete package names."""
    out = _run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                "--no-breaks", "--no-replaces", "--no-enhances", package], env, "apt-cache depends")
    return parse_depends(out, package)


def parse_depends(output: str, package: str) -> list[str]:
    """The package names of `apt-cache depends --recurse` output: its unindented lines, less
    virtual packages (written <name>; their providers are listed on their own lines)."""
    names = sorted({line.strip() for line in output.splitlines() if line.strip() and not line[0].isspace()
                    and not line.startswith("<")})
    bad = [n for n in names if not _PACKAGE.match(n)]
    if package not in names or bad:
        raise InstallError(f"unexpected apt-cache depends output for {package}: {bad or output[:500]!r}")
    return names


def _write_apt_config(work: Path, config: InstallConfig) -> Path:
    for sub in ("lists/partial", "cache/archives/partial", "etc"):
        (work / sub).mkdir(parents=True)
    (work / "status").touch()
    (work / "etc/sources.list").write_text(
        f"deb [signed-by={config.keyring}] {config.mirror} {config.suite} main\n")
    conf = work / "etc/apt.conf"
    conf.write_text("\n".join([
        f'Dir::State::Lists "{work}/lists";',
        f'Dir::State::status "{work}/status";',
        f'Dir::Etc::SourceList "{work}/etc/sources.list";',
        'Dir::Etc::SourceParts "/nonexistent";',
        f'Dir::Cache "{work}/cache";',
        'APT::Architecture "amd64";',
        'Acquire::Languages "none";',
        # apt drops to _apt for downloads, which cannot write into a root-owned temp dir.
        'APT::Sandbox::User "root";' if os.geteuid() == 0 else "",
    ]) + "\n")
    return conf


def _run(cmd: list[str], env: dict[str, str], what: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def _replace_dir(new: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    new.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install CRIU >= 4.2 into a private tree (no system change).")
    parser.add_argument("--dir", default=None, help="target tree [default: $RESIDENT_CRIU_DIR or "
                                                   "~/.cache/resident/criu]")
    parser.add_argument("--suite", default=DEFAULT_SUITE)
    parser.add_argument("--mirror", default=DEFAULT_MIRROR)
    parser.add_argument("--force", action="store_true", help="reinstall even if a working tree is there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = Path(args.dir).resolve() if args.dir else default_criu_dir(os.environ)
    try:
        binary = install(InstallConfig(target, mirror=args.mirror, suite=args.suite, force=args.force))
    except (InstallError, CriuError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"CRIU {format_version(binary.version)}: {binary.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The project-managed CRIU installer (cli/criu_install.py): dependency parsing, idempotence,
and the tree it leaves behind being what `find_criu` uses. The download itself runs in
.ci/setup (it needs the Debian mirror)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from resident.cli.criu_install import InstallConfig, InstallError, install, installed_binary, parse_depends
from resident.worker import criu

DEPENDS = """criu
  Depends: libc6
  Depends: libnet9
  Depends: <libnftables-virtual>
libc6
  Depends: libgcc-s1
libnet9
<libnftables-virtual>
libnftables1
libgcc-s1
"""


def test_the_dependency_closure_is_every_concrete_package() -> None:
    assert parse_depends(DEPENDS, "criu") == ["criu", "libc6", "libgcc-s1", "libnet9", "libnftables1"]


def test_unexpected_apt_output_is_refused() -> None:
    with pytest.raises(InstallError, match="unexpected"):
        parse_depends("E: No packages found\n", "criu")
    with pytest.raises(InstallError, match="unexpected"):
        parse_depends("criu\nrm -rf /\n", "criu")


def test_config_wants_an_absolute_target_and_a_url_mirror(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        InstallConfig(Path("relative"))
    with pytest.raises(ValueError, match="mirror"):
        InstallConfig(tmp_path, mirror="ftp://example.org/debian")


def test_an_unstamped_or_broken_tree_is_not_taken_as_installed(tmp_path: Path) -> None:
    assert installed_binary(tmp_path) is None
    (tmp_path / "resident-criu.json").write_text("{}")
    assert installed_binary(tmp_path) is None  # stamped, but no criu in it


def test_installing_again_over_a_working_tree_changes_nothing() -> None:
    tree = criu.default_criu_dir()
    if installed_binary(tree) is None:
        pytest.skip(f"no managed CRIU at {tree} (run `resident snapshot install-criu`)")
    before = {p: p.stat().st_mtime_ns for p in tree.rglob("*") if p.is_file()}
    binary = install(InstallConfig(tree, mirror="http://127.0.0.1:9/unreachable"))  # no network needed
    assert binary.version >= criu.MIN_CRIU_VERSION and binary.source == "managed"
    assert {p: p.stat().st_mtime_ns for p in tree.rglob("*") if p.is_file()} == before
    r = subprocess.run([sys.executable, "-m", "resident.cli.main", "snapshot", "install-criu", "--dir", str(tree),
                        "--mirror", "http://127.0.0.1:9/unreachable"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": os.path.dirname(sys.executable)})
    assert r.returncode == 0 and f"CRIU {criu.format_version(binary.version)}" in r.stdout, r.stderr

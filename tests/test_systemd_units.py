"""The shipped deployment files: systemd units pass `systemd-analyze verify` with the installed
`resident` executable, carry the settings the supervisor and daemon rely on, and the
Kubernetes manifests parse and keep their rollout guarantees."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ("resident-preload.service", "resident-engine.socket", "resident-engine.service", "resident.target")
K8S = ROOT / "docs" / "kubernetes"


def _resident_executable() -> str:
    exe = shutil.which("resident") or str(Path(sys.prefix) / "bin" / "resident")
    if not Path(exe).exists():
        pytest.fail(f"the `resident` executable is not installed ({exe}); pip install -e . first")
    return exe


def _render(tmp_path: Path, exe: str) -> Path:
    out = tmp_path / "units"
    out.mkdir()
    for name in UNITS:
        text = (ROOT / "systemd" / name).read_text().replace("/usr/local/bin/resident", exe)
        (out / name).write_text(text)
    return out


def _verify(folder: Path) -> subprocess.CompletedProcess:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return subprocess.run([analyze, "verify", "--man=no", *(str(folder / n) for n in UNITS)],
                          capture_output=True, text=True, timeout=60)


def _settings(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (ROOT / "systemd" / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_units_pass_systemd_analyze_verify(tmp_path):
    out = _verify(_render(tmp_path, _resident_executable()))
    assert out.returncode == 0, out.stdout + out.stderr
    assert not out.stderr.strip(), out.stderr  # no warnings either


def test_verify_would_catch_a_missing_executable(tmp_path):
    out = _verify(_render(tmp_path, str(tmp_path / "no-such-resident")))
    assert out.returncode != 0
    assert "no-such-resident" in out.stdout + out.stderr


def test_unit_settings_the_processes_rely_on():
    preload = _settings("resident-preload.service")
    assert preload["Type"] == ["notify"] and preload["Restart"] == ["always"]
    assert int(preload["FileDescriptorStoreMax"][0]) >= 1024
    assert preload["RuntimeDirectory"] == ["resident"] and preload["RuntimeDirectoryPreserve"] == ["yes"]
    assert "--foreground" in preload["ExecStart"][0] and "/run/resident/preload.sock" in preload["ExecStart"][0]
    assert preload["WatchdogSec"]

    sock = _settings("resident-engine.socket")
    assert sock["FileDescriptorName"] == ["http"] and sock["ListenStream"] == ["8000"]

    engine = _settings("resident-engine.service")
    assert engine["Type"] == ["notify"] and engine["NotifyAccess"] == ["all"]
    assert engine["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert engine["KillMode"] == ["mixed"]  # SIGTERM to the supervisor, which drains its replicas
    assert engine["WatchdogSec"]
    for unit in ("resident-preload.service", "resident-engine.socket"):
        assert unit in engine["Requires"][0] and unit in engine["After"][0]
    start = engine["ExecStart"][0]
    assert "--data-parallel-size" in start and "--frontend process" in start   # replicas as front-end + engine pairs
    drain = float(re.search(r"--drain-timeout (\d+)", start).group(1))
    grace = float(re.search(r"--drain-grace (\d+)", start).group(1))
    # The supervisor kills a replica 10 s after drain + grace; systemd must wait longer.
    assert float(engine["TimeoutStopSec"][0]) > drain + grace + 10

    target = _settings("resident.target")
    for unit in ("resident-preload.service", "resident-engine.socket", "resident-engine.service"):
        assert unit in target["Wants"][0]


def _yaml_documents() -> dict[str, list[dict]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the Kubernetes manifests")
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}


def test_kubernetes_manifests_parse_and_keep_their_rollout_guarantees():
    docs = _yaml_documents()
    kustomization = docs["kustomization.yaml"][0]
    assert sorted(kustomization["resources"]) == sorted(n for n in docs if n != "kustomization.yaml")
    by_kind = {d["kind"]: d for ds in docs.values() for d in ds if "kind" in d}
    assert {"DaemonSet", "Deployment", "Service", "Namespace", "Kustomization"} <= set(by_kind)

    ds = by_kind["DaemonSet"]["spec"]["template"]["spec"]
    (daemon,) = ds["containers"]
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "nvidia.com/gpu" in daemon["resources"]["limits"]
    assert {v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v} == {"/run/resident"}

    dep = by_kind["Deployment"]["spec"]
    assert dep["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = dep["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v} == {"/run/resident"}
    cmd = engine["command"]
    drain = float(cmd[cmd.index("--drain-timeout") + 1]) + float(cmd[cmd.index("--drain-grace") + 1])
    pre_stop = float(engine["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain
    # Selectors match the pod labels (a typo here silently breaks the Service and the rollout).
    labels = dep["template"]["metadata"]["labels"]
    assert dep["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind["Service"]["spec"]["selector"].items() <= labels.items()

"""`resident preload …` end to end, as a user runs it: each command a separate process,
the daemon detached in its own session."""
from __future__ import annotations

import json
import os
import re
import socket as socketlib
import subprocess
import sys
import urllib.request

import pytest

CLI = [sys.executable, "-m", "resident.cli.main"]


def cli_env() -> dict[str, str]:
    """This environment without $RESIDENT_SOCKET: each call names its daemon's socket."""
    env = dict(os.environ)
    env.pop("RESIDENT_SOCKET", None)
    return env


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=cli_env())


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read()
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def daemon(short_tmp):
    """A detached daemon on a private socket and an ephemeral HTTP port; stopped after."""
    sock = str(short_tmp / "p.sock")
    port = free_port()
    r = run_cli("preload", "start", "--socket", sock, "--http", f"127.0.0.1:{port}", "--backend", "host_shm")
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"pid (\d+), socket (\S+)", r.stdout)
    assert m and m.group(2) == sock, r.stdout
    pid = int(m.group(1))
    yield {"socket": sock, "pid": pid, "port": port}
    if pid_alive(pid):
        run_cli("preload", "stop", "--socket", sock)
        if pid_alive(pid):
            os.kill(pid, 9)


def test_start_load_list_status_unload_stop(daemon, tiny_model):
    sock, pid = daemon["socket"], daemon["pid"]
    assert pid_alive(pid)
    # start returned only once the daemon serves: /ready answers right away
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon['port']}/ready", timeout=5) as resp:
        assert resp.status == 200

    model = tiny_model("llama")
    r = run_cli("preload", "load", str(model), "--name", "tiny", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert re.search(r"B/s", r.stderr), f"no progress bar with a rate on stderr: {r.stderr!r}"
    assert re.match(r"loaded tiny v1 \(key [0-9a-f]{12}, float32, none\): read [\d.]+ KiB in [\d.]+ s "
                    r"\([\d.]+ GB/s\), [\d.]+ KiB resident$", r.stdout), r.stdout

    again = run_cli("preload", "load", str(model), "--name", "tiny", "--socket", sock)
    assert again.returncode == 0, again.stderr
    assert "already resident" in again.stdout and "nothing read" in again.stdout

    listed = run_cli("preload", "list", "--json", "--socket", sock)
    assert listed.returncode == 0, listed.stderr
    models = json.loads(listed.stdout)
    assert [m["name"] for m in models] == ["tiny"]
    assert int(models[0]["nbytes"]) > 0 and models[0]["source"] == str(model)
    assert models[0]["config"]["hidden_size"] == 64

    table = run_cli("preload", "list", "--socket", sock)
    assert "tiny" in table.stdout and "NAME" in table.stdout

    st = run_cli("preload", "status", "--socket", sock)
    assert st.returncode == 0, st.stderr
    assert f"pid {pid}" in st.stdout and "host_shm" in st.stdout and "tiny v1" in st.stdout
    st_json = json.loads(run_cli("preload", "status", "--json", "--socket", sock).stdout)
    assert st_json["pid"] == pid and st_json["socket"] == sock
    assert st_json["http"] == f"127.0.0.1:{daemon['port']}"
    assert st_json["weights_survive_daemon"] is not None and int(st_json["resident_bytes"]) > 0

    # a client holding a lease: status shows its pid; unload needs --force
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from resident.daemon.client import attach; "
         f"c, m = attach('tiny', {sock!r}); print('attached', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "attached"
        st = run_cli("preload", "status", "--socket", sock)
        assert re.search(rf"lease \S+  pid {holder.pid} ", st.stdout), st.stdout
        assert str(holder.pid) in run_cli("preload", "list", "--socket", sock).stdout
        refused = run_cli("preload", "unload", "tiny", "--socket", sock)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert "--force" in refused.stderr or "lease" in refused.stderr, refused.stderr
        un = run_cli("preload", "unload", "tiny", "--force", "--socket", sock)
        assert un.returncode == 0, un.stderr
        assert un.stdout.startswith("unloaded tiny:")
    finally:
        holder.kill()
        holder.wait()
    assert json.loads(run_cli("preload", "list", "--json", "--socket", sock).stdout) == []

    stop = run_cli("preload", "stop", "--socket", sock)
    assert stop.returncode == 0, stop.stderr
    assert f"pid {pid}) stopped" in stop.stdout
    assert not pid_alive(pid)
    assert not os.path.exists(sock) and not os.path.exists(sock + ".fd")

    after = run_cli("preload", "status", "--socket", sock)
    assert after.returncode == 1
    assert f"no resident daemon at {sock}; start one with `resident preload start`" in after.stderr


def test_second_start_is_refused_naming_the_pid(daemon):
    r = run_cli("preload", "start", "--socket", daemon["socket"], "--http", "127.0.0.1:0")
    assert r.returncode == 1
    assert f"pid {daemon['pid']}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert pid_alive(daemon["pid"])   # the running daemon is untouched and still answers
    assert run_cli("preload", "status", "--socket", daemon["socket"]).returncode == 0


def test_bad_input_is_one_clear_line_and_the_daemon_stays_healthy(daemon, tiny_model, tmp_path):
    sock = daemon["socket"]
    missing = tmp_path / "no-such-model"
    r = run_cli("preload", "load", str(missing), "--socket", sock)
    assert r.returncode == 1
    assert str(missing) in r.stderr and "Traceback" not in r.stderr

    model = tiny_model("llama")
    r = run_cli("preload", "load", str(model), "--quantization", "int3", "--socket", sock)
    assert r.returncode == 2   # a usage error, refused before any RPC (11322cc)
    assert "int3" in r.stderr and "none" in r.stderr and "fp8_per_tensor" in r.stderr
    assert "Traceback" not in r.stderr

    r = run_cli("preload", "unload", "never-loaded", "--socket", sock)
    assert r.returncode == 1 and "never-loaded" in r.stderr and "Traceback" not in r.stderr

    r = run_cli("preload", "start", "--socket", sock + "x", "--max-bytes", "lots")
    assert r.returncode == 2 and "invalid size 'lots'" in r.stderr

    ok = run_cli("preload", "load", str(model), "--socket", sock, "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["num_tensors"] > 0


def test_a_second_name_for_a_resident_key_is_explained_and_list_keys_unload(daemon, tiny_model):
    """The daemon holds one copy per key under its first name: loading it again as another
    name says which name to use, and the 12 key digits `list` prints are enough to unload it."""
    sock = daemon["socket"]
    model = tiny_model("llama")
    assert run_cli("preload", "load", str(model), "--name", "first", "--socket", sock).returncode == 0
    again = run_cli("preload", "load", str(model), "--name", "second", "--socket", sock)
    assert again.returncode == 0, again.stderr
    assert "first v1" in again.stdout and "already resident" in again.stdout
    assert "not listed as 'second'" in again.stderr and "lists this one as 'first'" in again.stderr

    short_key = run_cli("preload", "list", "--socket", sock).stdout.splitlines()[2].split()[2]
    assert re.fullmatch(r"[0-9a-f]{12}", short_key)
    un = run_cli("preload", "unload", short_key, "--socket", sock)
    assert un.returncode == 0, un.stderr
    assert un.stdout.strip() == f"unloaded {short_key}: {short_key}"
    assert json.loads(run_cli("preload", "list", "--json", "--socket", sock).stdout) == []


def test_a_load_says_which_resident_variant_it_superseded(daemon, tiny_model):
    """Loading another dtype/quantization of a model under the same name drops the unleased
    older variant: the load says so (it used to vanish without a word)."""
    sock = daemon["socket"]
    model = tiny_model("llama")
    fp8 = run_cli("preload", "load", str(model), "--quantization", "fp8_per_tensor", "--socket", sock)
    assert fp8.returncode == 0 and "no longer resident" not in fp8.stderr, fp8.stderr
    plain = run_cli("preload", "load", str(model), "--socket", sock)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith(f"loaded {model} v2 ")
    note = re.search(r"note: no longer resident: (\S+) v1 \(key [0-9a-f]{12}, float32, fp8_per_tensor\): .*"
                     r"give each variant its own --name", plain.stderr)
    assert note and note.group(1) == str(model), plain.stderr


_PROBE = """
import json, sys
from click.testing import CliRunner
from resident.cli.main import cli
r = CliRunner().invoke(cli, sys.argv[1:])
print(json.dumps({"exit_code": r.exit_code, "output": r.output, "torch": "torch" in sys.modules}))
"""


def test_status_list_stop_against_a_live_daemon_import_no_torch(daemon):
    for command in ("status", "list", "stop"):
        out = subprocess.run([sys.executable, "-c", _PROBE, "preload", command, "--socket", daemon["socket"]],
                             capture_output=True, text=True, timeout=60, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert r["exit_code"] == 0, r
        assert not r["torch"], f"`resident preload {command}` imported torch"
    assert f"pid {daemon['pid']}) stopped" in r["output"]
    assert not pid_alive(daemon["pid"])


def test_stop_falls_back_to_sigterm_when_the_daemon_does_not_answer(daemon):
    sock, pid = daemon["socket"], daemon["pid"]
    os.unlink(sock + ".fd")    # the daemon still runs and holds its lock, but no client can say hello
    r = run_cli("preload", "stop", "--socket", sock)
    assert r.returncode == 0, r.stderr
    assert f"pid {pid}) holds" in r.stderr and "SIGTERM" in r.stderr
    assert not pid_alive(pid) and not os.path.exists(sock)


def test_status_without_a_daemon(short_tmp):
    sock = str(short_tmp / "absent.sock")
    r = run_cli("preload", "status", "--socket", sock)
    assert r.returncode == 1
    assert r.stderr.strip() == f"Error: no resident daemon at {sock}; start one with `resident preload start`"


def test_a_max_bytes_beyond_what_status_can_report_is_refused_before_starting(short_tmp):
    """--max-bytes 99999999999999999999999TB used to start a daemon whose every Status call
    failed (the uint64 field refused the value), so `status` and `stop` could not reach it."""
    sock = short_tmp / "p.sock"
    r = run_cli("preload", "start", "--socket", str(sock), "--http", "off", "--max-bytes", "99999999999999999999999TB")
    started = os.path.exists(sock)
    if started:
        os.kill(int((short_tmp / "p.sock.lock").read_text()), 9)
    assert r.returncode == 1 and not started, r.stdout + r.stderr
    assert "more bytes than any machine holds" in r.stderr and "64GiB" in r.stderr
    assert "Traceback" not in r.stderr


def test_stop_reaches_a_daemon_whose_status_fails(monkeypatch, short_tmp):
    """`stop` asked Status for the pid first, so a daemon whose Status raised inside (as one
    started with an oversized --max-bytes did) could not be stopped: the pid now comes from
    the lock file and Shutdown is sent anyway."""
    import contextlib

    from click.testing import CliRunner

    from resident.cli import daemon_process, preload_lifecycle
    from resident.cli.main import cli
    from resident.daemon.errors import DaemonError

    calls = []

    class BrokenStatus:
        def status(self):
            raise DaemonError("internal error in Status: ValueError: Value out of range", code="INTERNAL")

        def shutdown(self):
            calls.append("shutdown")

    sock = short_tmp / "p.sock"
    sock.touch()
    monkeypatch.setattr(preload_lifecycle, "connect", lambda daemon: contextlib.nullcontext(BrokenStatus()))
    monkeypatch.setattr(preload_lifecycle, "_running_pid", lambda socket: 4321)
    monkeypatch.setattr(daemon_process, "wait_exit", lambda pid, socket, timeout_s: calls.append(pid) or True)
    r = CliRunner().invoke(cli, ["preload", "stop", "--socket", str(sock)])
    assert r.exit_code == 0, r.output
    assert calls == ["shutdown", 4321]
    assert "the daemon's Status failed (internal error in Status" in r.output
    assert "resident daemon (pid 4321) stopped" in r.output


@pytest.mark.parametrize("command", ["start", "stop"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(short_tmp, command, value):
    """`start --timeout 0` used to start a daemon, kill it at once and blame it ("not ready
    within 0 s"); `stop --timeout 0` stopped the daemon, then said it "did not stop"."""
    sock = short_tmp / "p.sock"
    http = ["--http", "off"] if command == "start" else []
    r = run_cli("preload", command, "--socket", str(sock), *http, "--timeout", value)
    if os.path.exists(sock):   # without the check, `start --timeout inf` starts one
        os.kill(int((short_tmp / "p.sock.lock").read_text()), 9)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Invalid value for '--timeout'" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(sock) and not os.path.exists(str(sock) + ".log")


def test_a_socket_folder_the_daemon_cannot_write_is_named_with_the_fix(short_tmp):
    blocker = short_tmp / "not-a-folder"
    blocker.write_text("")
    sock = blocker / "p.sock"
    r = run_cli("preload", "start", "--socket", str(sock), "--http", "off", "--log-file", str(short_tmp / "d.log"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot create the lock file {sock}.lock" in r.stderr, r.stderr
    assert "choose a --socket in such a folder" in r.stderr

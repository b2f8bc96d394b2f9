"""Sessions, leases and the allow-list (no sockets), plus the config rules they come from."""
from __future__ import annotations

import os

import pytest

from resident.daemon.config import DaemonConfig, default_socket_path
from resident.daemon.errors import NotFound, PermissionDenied, Unauthenticated
from resident.daemon.sessions import AccessPolicy, PeerCreds, SessionTable

ME = PeerCreds(uid=1000, gid=1000, pid=4242)


def table(allow_uids=(1000,), allow_gids=(), admins=(1000,)) -> SessionTable:
    return SessionTable(AccessPolicy(frozenset(allow_uids), frozenset(allow_gids), frozenset(admins)))


def test_session_tokens_are_unique_and_authenticate():
    t = table()
    a, b = t.open_session(ME, "a"), t.open_session(ME, "b")
    assert a.token != b.token and len(a.token) >= 32
    assert t.get(a.token) is a
    assert t.num_sessions == 2


def test_missing_or_unknown_token_is_unauthenticated_with_a_hint():
    t = table()
    with pytest.raises(Unauthenticated, match="say hello on the daemon's fd socket"):
        t.get("")
    with pytest.raises(Unauthenticated, match="unknown or expired"):
        t.get("not-a-token")


def test_closing_a_session_ends_all_its_leases_and_only_them():
    t = table()
    a, b = t.open_session(ME), t.open_session(ME)
    la1, la2 = t.add_lease(a.token, "k1"), t.add_lease(a.token, "k2")
    lb = t.add_lease(b.token, "k1")
    assert t.lease_count("k1") == 2
    ended = t.close_session(a.token)
    assert {lease.lease_id for lease in ended} == {la1.lease_id, la2.lease_id}
    assert t.lease_count("k1") == 1 and t.lease_count("k2") == 0
    assert [lease.lease_id for lease in t.leases_for("k1")] == [lb.lease_id]
    with pytest.raises(Unauthenticated):
        t.get(a.token)
    assert t.close_session(a.token) == []  # idempotent


def test_lease_records_the_peer():
    t = table()
    s = t.open_session(ME, "worker-7")
    lease = t.add_lease(s.token, "k")
    assert (lease.pid, lease.uid, lease.client_name, lease.key) == (4242, 1000, "worker-7", "k")


def test_a_client_name_cannot_forge_status_lines_or_reach_the_terminal():
    """`preload status` prints each lease's client name: one with a newline added a fake model
    line to the table, one with an escape sequence coloured the admin's terminal."""
    forged = "w\n  keep v9 (latest)  key deadbeef\x1b[31m" + "x" * 500
    s = table().open_session(ME, forged)
    assert s.client_name == ("w?  keep v9 (latest)  key deadbeef?[31m" + "x" * 500)[:200]
    assert table().open_session(ME, "vLLM engine · ранг 0").client_name == "vLLM engine · ранг 0"


def test_a_session_cannot_release_or_fetch_another_sessions_lease():
    t = table()
    a, b = t.open_session(ME), t.open_session(ME)
    lease = t.add_lease(a.token, "k")
    with pytest.raises(NotFound):
        t.release(b.token, lease.lease_id)
    with pytest.raises(NotFound):
        t.lease_of(b.token, lease.lease_id)
    assert t.lease_of(a.token, lease.lease_id) == lease
    t.release(a.token, lease.lease_id)
    assert t.lease_count("k") == 0
    with pytest.raises(NotFound):
        t.release(a.token, lease.lease_id)


def test_allow_list_by_uid_and_by_group_including_supplementary():
    t = table(allow_uids=(1000,), allow_gids=(50,))
    t.open_session(PeerCreds(1000, 1000, 1))
    t.open_session(PeerCreds(2000, 50, 1))
    t.open_session(PeerCreds(2000, 2000, 1, groups=(7, 50)))
    with pytest.raises(PermissionDenied) as e:
        t.open_session(PeerCreds(2000, 2000, 99, groups=(7,)))
    assert "uid 2000" in str(e.value) and "--allow-uid 2000" in str(e.value)


def test_admin_required_for_admin_calls():
    t = table(allow_uids=(1000, 2000), admins=(1000,))
    admin = t.open_session(ME)
    user = t.open_session(PeerCreds(2000, 2000, 5))
    assert admin.admin and not user.admin
    assert t.get(admin.token, admin=True) is admin
    assert t.get(user.token) is user
    with pytest.raises(PermissionDenied, match="not an admin"):
        t.get(user.token, admin=True)


def test_config_default_allow_list_is_own_uid_root_and_socket_group(tmp_path):
    cfg = DaemonConfig(socket=str(tmp_path / "s.sock"), daemon_uid=1234, socket_group=77)
    uids, gids = cfg.effective_allow()
    assert uids == {1234, 0} and gids == {77}
    assert cfg.effective_admins() == {1234, 0}
    locked = DaemonConfig(socket=str(tmp_path / "s.sock"), daemon_uid=1234, allow_uids=(555,), admin_uids=(555,))
    assert locked.effective_allow() == ({555}, set())  # explicit lists replace the defaults, root included
    assert locked.effective_admins() == {555}


def test_config_derived_paths_and_validation(tmp_path):
    cfg = DaemonConfig(socket=str(tmp_path / "p.sock"))
    assert cfg.fd_socket == str(tmp_path / "p.sock.fd")
    assert cfg.lock_file == str(tmp_path / "p.sock.lock")
    assert cfg.http_file == str(tmp_path / "p.sock.http")
    assert cfg.socket_mode == 0o660 and cfg.http == "127.0.0.1:8470" and cfg.tcp == ""
    with pytest.raises(ValueError, match="limited to 107"):
        DaemonConfig(socket="/tmp/" + "x" * 120)
    with pytest.raises(ValueError, match="HOST:PORT"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), http="localhost")
    with pytest.raises(ValueError, match="max_bytes"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), max_bytes=-1)
    with pytest.raises(ValueError, match="more bytes than any machine holds"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), max_bytes=2**64)   # Status's uint64 cannot carry it
    assert DaemonConfig(socket=str(tmp_path / "p.sock"), max_bytes=2**64 - 1).max_bytes == 2**64 - 1
    with pytest.raises(ValueError, match=r"--allow-uid -1 is not a user or group id \(0 to 4294967294\)"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), allow_uids=(-1,))
    with pytest.raises(ValueError, match="--admin-uid 4294967295 is not a user or group id"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), admin_uids=(0, 2**32 - 1))   # (uid_t)-1: no one
    with pytest.raises(ValueError, match="--allow-gid 99999999999 is not"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), allow_gids=(99999999999,))
    with pytest.raises(ValueError, match="unknown group"):
        DaemonConfig(socket=str(tmp_path / "p.sock"), socket_group="no-such-group-xyz")


def test_default_socket_path_order(tmp_path):
    assert default_socket_path({"RESIDENT_SOCKET": "/x/env.sock"}, "/x/flag.sock") == "/x/flag.sock"
    assert default_socket_path({"RESIDENT_SOCKET": "/x/env.sock"}) == "/x/env.sock"
    missing = str(tmp_path / "nope")
    assert default_socket_path({}, is_root=True, system_dir=missing) == os.path.join(missing, "preload.sock")
    present = tmp_path / "run"
    present.mkdir()
    assert default_socket_path({}, is_root=False, system_dir=str(present)) == str(present / "preload.sock")
    assert (default_socket_path({"XDG_RUNTIME_DIR": "/run/user/1000"}, is_root=False, system_dir=missing)
            == "/run/user/1000/resident/preload.sock")
    with pytest.raises(ValueError, match="--socket"):
        default_socket_path({}, is_root=False, system_dir=missing)

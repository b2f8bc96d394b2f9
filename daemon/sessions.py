"""Sessions (one per fd-socket connection, identified by the peer's SO_PEERCRED) and the
leases they hold. A lease lives exactly as long as its session: when the connection closes,
however the client died, `close_session` ends all its leases at once.

Leases carried over from a previous daemon (a hand-over, or a restart from systemd's fd
store) wait for their holders to re-open them (`add_lease(..., lease_id=...)`, a re-attach):
until then they count as leases (the model is not evictable) and are listed with
`awaiting_reattach`; those not re-opened within the grace period are dropped.

Thread-safe; no sockets here, so this is unit-tested directly.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from resident.daemon.errors import NotFound, PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

#: A client's name is kept to this many characters.
MAX_CLIENT_NAME_CHARS = 200


@dataclass(frozen=True)
class PeerCreds:
    uid: int
    gid: int
    pid: int  # 0 when the peer lives in another pid namespace
    groups: tuple[int, ...] = ()  # supplementary groups, when readable


@dataclass(frozen=True)
class AccessPolicy:
    """Who may say hello (allow-list) and who may Load/Unload/Shutdown (admins)."""

    allow_uids: frozenset[int]
    allow_gids: frozenset[int]
    admin_uids: frozenset[int]

    def check(self, peer: PeerCreds) -> None:
        if peer.uid in self.allow_uids:
            return
        if self.allow_gids & ({peer.gid} | set(peer.groups)):
            return
        raise PermissionDenied(
            f"uid {peer.uid} (gid {peer.gid}, pid {peer.pid}) is not allowed to use this daemon; "
            f"allowed uids {sorted(self.allow_uids)}, gids {sorted(self.allow_gids)}. Add it with "
            f"--allow-uid {peer.uid}, or add the user to the daemon's --socket-group"
        )

    def is_admin(self, peer: PeerCreds) -> bool:
        return peer.uid in self.admin_uids


@dataclass(frozen=True)
class Lease:
    lease_id: str
    key: str
    token: str
    pid: int
    uid: int
    client_name: str
    since: float
    awaiting_reattach: bool = False  # carried over from the previous daemon, not re-opened yet


@dataclass
class Session:
    token: str
    peer: PeerCreds
    client_name: str
    admin: bool
    since: float
    leases: dict[str, Lease] = field(default_factory=dict)


class SessionTable:
    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._leases: dict[str, Lease] = {}
        self._awaiting: dict[str, tuple[Lease, float]] = {}  # lease_id -> (lease, deadline)

    # --- sessions -------------------------------------------------------------------
    def open_session(self, peer: PeerCreds, client_name: str = "") -> Session:
        """Check the allow-list and start a session with a fresh token."""
        self.policy.check(peer)
        # Shown in every `preload status` lease line: a newline or an escape sequence there
        # could forge lines or colour the admin's terminal.
        printable = "".join(ch if ch.isprintable() else "?" for ch in client_name[:MAX_CLIENT_NAME_CHARS])
        session = Session(token=secrets.token_urlsafe(32), peer=peer, client_name=printable,
                          admin=self.policy.is_admin(peer), since=time.time())
        with self._lock:
            self._sessions[session.token] = session
        log.info("session opened: uid=%d pid=%d client=%r admin=%s", peer.uid, peer.pid,
                 session.client_name, session.admin)
        return session

    def close_session(self, token: str) -> list[Lease]:
        """End a session and every lease it holds; returns the ended leases."""
        with self._lock:
            session = self._sessions.pop(token, None)
            if session is None:
                return []
            ended = list(session.leases.values())
            for lease in ended:
                self._leases.pop(lease.lease_id, None)
        log.info("session closed: uid=%d pid=%d, %d lease(s) ended", session.peer.uid,
                 session.peer.pid, len(ended))
        return ended

    def get(self, token: str, *, admin: bool = False) -> Session:
        """The live session for `token` (Unauthenticated if none; PermissionDenied if an
        admin session is required and this is not one)."""
        with self._lock:
            session = self._sessions.get(token) if token else None
        if session is None:
            why = "without a session token" if not token else "with an unknown or expired session token"
            raise Unauthenticated(
                f"call made {why}: say hello on the daemon's fd socket first and send the token as "
                "metadata 'x-resident-session' (resident.daemon.client.Client does this)"
            )
        if admin and not session.admin:
            raise PermissionDenied(
                f"uid {session.peer.uid} is not an admin of this daemon (admins: "
                f"{sorted(self.policy.admin_uids)}); Load, Unload and Shutdown need an admin uid "
                "(--admin-uid)"
            )
        return session

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    # --- leases ---------------------------------------------------------------------
    def add_lease(self, token: str, key: str, lease_id: str = "") -> Lease:
        """A new lease of `key` for the session. With `lease_id` (a re-attach), a carried-over
        lease of the same key and uid awaiting re-attach is re-opened under its id."""
        with self._lock:
            session = self._sessions.get(token)
            if session is None:
                raise Unauthenticated("the session ended before the lease was granted; reconnect")
            since = time.time()
            carried = self._awaiting.get(lease_id) if lease_id else None
            if carried is not None and carried[0].key == key and carried[0].uid == session.peer.uid:
                del self._awaiting[lease_id]
                since = carried[0].since
            elif not lease_id or lease_id in self._leases or lease_id in self._awaiting:
                lease_id = secrets.token_hex(8)
            lease = Lease(lease_id=lease_id, key=key, token=token, pid=session.peer.pid,
                          uid=session.peer.uid, client_name=session.client_name, since=since)
            session.leases[lease.lease_id] = lease
            self._leases[lease.lease_id] = lease
        return lease

    def carry_over(self, leases: Iterable[Lease], grace_s: float) -> None:
        """Hold the previous daemon's leases for `grace_s` seconds, awaiting re-attach."""
        deadline = time.monotonic() + grace_s
        with self._lock:
            for lease in leases:
                if lease.lease_id not in self._leases:
                    self._awaiting[lease.lease_id] = (
                        Lease(lease_id=lease.lease_id, key=lease.key, token="", pid=lease.pid, uid=lease.uid,
                              client_name=lease.client_name, since=lease.since, awaiting_reattach=True),
                        deadline)

    def expire_awaiting(self, now: float | None = None) -> list[Lease]:
        """Drop carried-over leases whose grace period ended; returns them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [lid for lid, (_, deadline) in self._awaiting.items() if deadline <= now]
            expired = [self._awaiting.pop(lid)[0] for lid in gone]
        for lease in expired:
            log.info("lease %s (pid %d, %r) of the previous daemon was not re-opened in time; dropped",
                     lease.lease_id, lease.pid, lease.client_name)
        return expired

    def forget_awaiting(self, key: str) -> None:
        """Drop carried-over leases of `key` (it was unloaded with --force)."""
        with self._lock:
            for lid in [lid for lid, (lease, _) in self._awaiting.items() if lease.key == key]:
                del self._awaiting[lid]

    def all_leases(self) -> list[Lease]:
        """Live leases and carried-over ones still awaiting re-attach."""
        with self._lock:
            return list(self._leases.values()) + [lease for lease, _ in self._awaiting.values()]

    def release(self, token: str, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.token != token:
                raise NotFound(f"no lease {lease_id!r} held by this session")
            del self._leases[lease_id]
            self._sessions[token].leases.pop(lease_id, None)
        return lease

    def lease_of(self, token: str, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or lease.token != token:
            raise NotFound(f"no lease {lease_id!r} held by this session; attach first")
        return lease

    def leases_for(self, key: str) -> list[Lease]:
        return [lease for lease in self.all_leases() if lease.key == key]

    def lease_count(self, key: str) -> int:
        return len(self.leases_for(key))

    def leased_keys(self) -> set[str]:
        return {lease.key for lease in self.all_leases()}

    @property
    def num_awaiting(self) -> int:
        with self._lock:
            return len(self._awaiting)

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close_all(self) -> Iterable[str]:
        with self._lock:
            tokens = list(self._sessions)
        for token in tokens:
            self.close_session(token)
        return tokens

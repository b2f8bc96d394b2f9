"""Sessions (one per fd-socket connection, identified by the peer's SO_PEERCRED) and the
leases they hold. A lease lives exactly as long as its session: when the connection closes,
however the client died, `close_session` ends all its leases at once.

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

    # --- sessions -------------------------------------------------------------------
    def open_session(self, peer: PeerCreds, client_name: str = "") -> Session:
        """Check the allow-list and start a session with a fresh token."""
        self.policy.check(peer)
        session = Session(token=secrets.token_urlsafe(32), peer=peer, client_name=client_name[:200],
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
    def add_lease(self, token: str, key: str) -> Lease:
        with self._lock:
            session = self._sessions.get(token)
            if session is None:
                raise Unauthenticated("the session ended before the lease was granted; reconnect")
            lease = Lease(lease_id=secrets.token_hex(8), key=key, token=token, pid=session.peer.pid,
                          uid=session.peer.uid, client_name=session.client_name, since=time.time())
            session.leases[lease.lease_id] = lease
            self._leases[lease.lease_id] = lease
        return lease

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
        with self._lock:
            return [lease for lease in self._leases.values() if lease.key == key]

    def lease_count(self, key: str) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.key == key)

    def leased_keys(self) -> set[str]:
        with self._lock:
            return {lease.key for lease in self._leases.values()}

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

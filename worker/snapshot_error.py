"""The error a snapshot step (prepare, resume) stops with, carrying the HTTP status the admin
socket answers.

Its own module so that the steps (snapshot_detach, snapshot_reattach) and the state machine
that runs them (snapshot_control) can import it without importing each other.
"""
from __future__ import annotations


class SnapshotError(RuntimeError):
    """A prepare/resume that cannot proceed; `status` is the HTTP status the admin socket answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


__all__ = ["SnapshotError"]

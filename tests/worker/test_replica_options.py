"""ReplicaOptions, the supervisor's per-replica settings: each bad value is refused with its name."""
from __future__ import annotations

import math

import pytest

from resident.worker.replica_options import ReplicaOptions


@pytest.mark.parametrize(("field", "value", "match"), [
    ("replica_id", -1, "replica_id must be >= 0"),
    ("listen_fd", -1, "listen_fd must be an open fd"),
    ("admin_socket", "relative.sock", "admin_socket must be an absolute path"),
    ("admin_socket", "/" + "x" * 120, "longer than a Unix socket allows"),
    ("drain_grace_s", -1.0, "drain_grace_s must be a finite number >= 0"),
    ("drain_grace_s", math.nan, "drain_grace_s must be a finite number >= 0"),
    ("drain_grace_s", math.inf, "drain_grace_s must be a finite number >= 0"),
])
def test_bad_values_are_refused_by_name(field: str, value: object, match: str) -> None:
    good = {"replica_id": 0, "listen_fd": 3, "admin_socket": "/run/resident/r0.sock"}
    ReplicaOptions(**good)
    with pytest.raises(ValueError, match=match):
        ReplicaOptions(**{**good, field: value})

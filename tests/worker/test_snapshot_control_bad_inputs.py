"""A snapshot prepare whose timeout is not a finite number of seconds is refused (400) before
the worker pauses: NaN never times out, so it would hold the worker paused indefinitely."""
from __future__ import annotations

import asyncio
import math

import pytest

from resident.worker.snapshot_control import SnapshotControl
from resident.worker.snapshot_error import SnapshotError


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -1.0])
def test_prepare_refuses_a_timeout_that_is_not_a_finite_number(timeout_s):
    control = SnapshotControl(server_state=None, worker=None, config=None)
    with pytest.raises(SnapshotError, match="timeout_s must be a finite number") as e:
        asyncio.run(control.prepare(timeout_s))
    assert e.value.status == 400
    assert control.state.value == "serving"

"""A failed start logs one line when the error explains itself (startup.explains_itself): the
daemon's refusals name their fix, so they get no traceback; an unexpected error keeps one."""
from __future__ import annotations

import pytest

from resident.daemon.errors import DaemonUnavailable, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from resident.worker.startup import explains_itself
from resident.worker.weight_store import WeightStoreError


@pytest.mark.parametrize("error", [
    ResourceExhausted("the model needs 20.0 GB of host memory, 3.1 GB are available: unload a model"),
    PermissionDenied("uid 1000 may not load models"), NotFound("no model with key 1234"),
    InvalidArgument("bad dtype"), DaemonUnavailable("no daemon"),
    WeightStoreError("--preload require: ..."), ValueError("--max-model-len 0"), OSError(28, "No space left"),
])
def test_refusals_and_bad_input_explain_themselves(error):
    assert explains_itself(error)


@pytest.mark.parametrize("error", [KeyError("hidden_size"), TypeError("unhashable"), AttributeError("x")])
def test_internal_errors_keep_their_traceback(error):
    assert not explains_itself(error)

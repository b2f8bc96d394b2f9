"""Ctrl-C during `resident preload load`: the load goes on in the daemon, and the user is told."""
from __future__ import annotations

import contextlib

from click.testing import CliRunner

from resident.cli import preload as preload_cli
from resident.cli import preload_models
from resident.protos.resident.v1 import weight_cache_pb2 as pb


class InterruptedClient:
    def list(self):
        return []

    def load(self, model, **kwargs):
        yield pb.LoadProgress(phase="read", bytes_done=1 << 20, bytes_total=8 << 20)
        raise KeyboardInterrupt


def test_ctrl_c_during_a_load_says_the_daemon_goes_on(monkeypatch, tmp_path):
    monkeypatch.setattr(preload_models, "connect", lambda daemon: contextlib.nullcontext(InterruptedClient()))
    model = tmp_path / "m"
    model.mkdir()
    r = CliRunner().invoke(preload_cli.preload, ["load", str(model), "--name", "m", "--socket",
                                                 str(tmp_path / "d.sock")])
    assert r.exit_code == 1, r.output
    assert f"interrupted; the daemon goes on loading {model} and keeps it resident once done" in r.output
    assert "`resident preload unload m` removes it" in r.output
    assert "Aborted!" not in r.output

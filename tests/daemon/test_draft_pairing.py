"""A target held with its speculative-decoding draft: one resident model, one key covering
both, one attach returning both — and a draft whose vocabulary differs is refused before a
byte of weights is read. The pair survives a daemon restart from systemd's fd store."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import load, start_daemon
from recording_backend import RecordingBackend
from survive_helpers import FakeSystemd, Worker, exec_daemon_with_fds

from resident.daemon.client import Client
from resident.daemon.errors import InvalidArgument
from resident.daemon.load_plan import key_for
from resident.daemon.loader import LoadSpec, plan_load
from resident.daemon.loader import load as load_local
from resident.daemon.pairing import VocabMismatch
from resident.worker.weight_store import RemoteStore, open_store


def _write_tokenizer(folder: Path, tokens: list[str]) -> None:
    vocab = {t: i for i, t in enumerate(tokens)}
    doc = {"version": "1.0", "added_tokens": [{"id": 0, "content": tokens[0], "special": True}],
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    (folder / "tokenizer.json").write_text(json.dumps(doc))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_vocab_mismatch_is_refused_at_plan_time_before_any_allocation_or_read(tmp_path, tiny_model):
    target = tiny_model("llama")
    other_vocab = tiny_model("llama", name="small-vocab", vocab_size=128)
    with pytest.raises(VocabMismatch, match=r"vocab_size 128.*vocab_size 256.*same model family"):
        plan_load(LoadSpec(str(target), draft=str(other_vocab)))

    # Same vocab_size, different tokens: the tokenizer files decide.
    draft = tiny_model("llama", name="draft", seed=1, num_hidden_layers=1)
    _write_tokenizer(target, [f"t{i}" for i in range(256)])
    _write_tokenizer(draft, [f"u{i}" for i in range(256)])
    backend = RecordingBackend()
    with pytest.raises(VocabMismatch, match=f"draft {draft}.*target {target}.*tokenizer.json"):
        load_local(LoadSpec(str(target), draft=str(draft)), backend)
    assert backend.slabs == [], "nothing allocated (and so nothing read) for a refused pair"

    _write_tokenizer(draft, [f"t{i}" for i in range(256)])
    plan = plan_load(LoadSpec(str(target), draft=str(draft)))   # identical vocabularies pair fine
    assert plan.draft is not None and plan.key not in (plan.own_key, plan.draft.key)


def test_pair_is_one_model_one_attach_bit_identical_to_each_alone(short_tmp, tiny_model):
    target = tiny_model("llama")
    draft = tiny_model("llama", name="draft", seed=1, num_hidden_layers=1)
    mismatched = tiny_model("qwen2", name="other", vocab_size=128)
    daemon = start_daemon(short_tmp)
    try:
        with daemon.client("admin") as c:
            with pytest.raises(InvalidArgument, match=f"draft {mismatched}.*target {target}"):
                load(c, target, draft=str(mismatched))
            assert c.list() == [], "a refused pair leaves nothing resident"

            alone = load(c, target).model
            draft_alone = load(c, draft).model
            pair = load(c, target, draft=str(draft), name="pair").model
            assert len({alone.key, draft_alone.key, pair.key}) == 3, "the pair's key differs from both models'"
            assert pair.key == key_for(LoadSpec(str(target), draft=str(draft)))[0]
            assert (pair.draft_key, pair.draft_source) == (draft_alone.key, str(draft))
            assert json.loads(pair.draft_config_json)["num_hidden_layers"] == 1
            assert pair.num_tensors == alone.num_tensors + draft_alone.num_tensors
            assert not alone.draft_key and not alone.draft_config_json

            both = c.attach("pair", expected_key=pair.key, verify_checksums=True)
            _same(both.tensors, c.attach(alone.key).tensors)
            _same(both.draft_tensors, c.attach(draft_alone.key).tensors)
            assert both.draft_config["num_hidden_layers"] == 1
            assert {e.name for e in both.table.entries} == set(both.tensors) | {
                "draft." + n for n in both.draft_tensors}
            assert c.attach(alone.key).draft_tensors is None

        from click.testing import CliRunner

        from resident.cli.main import cli

        result = CliRunner().invoke(cli, ["preload", "load", str(target), "--draft", str(draft), "--socket",
                                          daemon.socket])
        assert result.exit_code == 0, result.output
        assert "already resident" in result.output and f"key {pair.key[:12]}" in result.output
        assert "draft draft" in result.output

        # The worker's weight store: WeightStore.draft from the daemon, and the same in-process.
        spec = LoadSpec(str(target), draft=str(draft))
        remote = open_store(spec, preload="require", socket_path=daemon.socket)
        local = open_store(spec, preload="off")
        try:
            assert isinstance(remote, RemoteStore) and remote.bytes_read_from_disk == 0
            for store in (remote, local):
                assert store.draft is not None
                assert store.draft.model_key == draft_alone.key and store.draft.model_dir == str(draft)
                assert store.draft.config["num_hidden_layers"] == 1
                assert store.verify(sample=-1) == pair.num_tensors   # target and draft entries
            _same(remote.tensors, local.tensors)
            _same(remote.draft.tensors, local.draft.tensors)
        finally:
            remote.close()
            local.close()
    finally:
        daemon.stop()


def test_restart_from_fd_store_gives_a_worker_target_and_draft_without_disk_reads(short_tmp, tiny_model):
    target = tiny_model("llama")
    draft = tiny_model("llama", name="draft", seed=1, num_hidden_layers=1)
    systemd = FakeSystemd(short_tmp / "notify")
    old = start_daemon(short_tmp, env=systemd.env())
    new = None
    worker = None
    try:
        with old.client("admin") as c:
            info = load(c, target, draft=str(draft)).model
            before = c.attach(info.key)
            target_copy = {n: t.clone() for n, t in before.tensors.items()}
            draft_copy = {n: t.clone() for n, t in before.draft_tensors.items()}
        systemd.wait_for(lambda s: any(n.startswith("state") for n in s.stored())
                         and any(n.startswith("slab-") for n in s.stored()))
        worker = Worker.start(old.socket, info.key, "worker")   # verifies every target and draft CRC
        worker.wait_attached()
        for folder in (target, draft):   # any disk read would fail now
            os.rename(folder, folder.with_name(folder.name + ".moved"))
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait()

        new = exec_daemon_with_fds(short_tmp, old.socket, systemd.stored_fds(), env=systemd.env())
        assert worker.wait_reattached() == worker.lease_id
        worker.assert_alive()
        with new.client("check") as c:
            (m,) = c.list()
            assert (m.key, m.draft_key, m.draft_source, m.draft_config_json) == (
                info.key, info.draft_key, info.draft_source, info.draft_config_json)
        store = RemoteStore(Client(new.socket, client_name="fresh"), info.key, "/nonexistent")
        try:
            assert store.draft is not None and store.draft.model_key == info.draft_key
            _same(dict(store.tensors), target_copy)
            _same(dict(store.draft.tensors), draft_copy)
            store.verify(sample=-1)
        finally:
            store.close()
        assert "nothing read from disk" in new.log()
    finally:
        if worker is not None:
            worker.stop()
        if new is not None:
            new.stop()
        old.stop()
        systemd.close()

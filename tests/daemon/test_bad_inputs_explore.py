"""Bad inputs found by trying them against a daemon: each fails at planning time with an
error that names the field or file and the fix, never a bare KeyError, a TypeError turned
into "internal error", or a loop over whatever layer count config.json claims."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from resident.daemon.layout import LayoutError
from resident.daemon.loader import LoadSpec, plan_load
from resident.daemon.pairing import VocabMismatch, check_vocab_compatible
from resident.daemon.safetensors_io import CheckpointError, read_header
from resident.daemon.source import SourceError, resolve_model

DEEP_JSON = "[" * 100_000 + "]" * 100_000   # beyond the json module's recursion limit


def _with_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, phrase", [
    ({"hidden_size": ...}, "config.json has no 'hidden_size'"),
    ({"vocab_size": ...}, "config.json has no 'vocab_size'"),
    ({"num_hidden_layers": None}, "config.json has no 'num_hidden_layers'"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers is 'two', not a positive integer"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers is 1.5, not a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers is True, not a positive integer"),
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1, not a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0, not a positive integer"),
    ({"head_dim": "x"}, "head_dim is 'x', not a positive integer"),
    ({"architectures": 5}, "architectures is 5; it must be a list"),
    ({"architectures": "LlamaForCausalLM"}, "architectures is 'LlamaForCausalLM'; it must be a list"),
    # One layer more than the weights hold: refused by count, before the per-layer plan (a
    # count like 10**12 used to loop until the daemon ran out of memory).
    ({"num_hidden_layers": 3}, "num_hidden_layers=3, but the checkpoint holds tensors of 2 layer(s)"),
], ids=["no-hidden-size", "no-vocab-size", "null-layers", "string-layers", "float-layers", "bool-layers",
        "negative-layers", "zero-heads", "string-head-dim", "int-architectures", "string-architectures",
        "more-layers-than-weights"])
def test_a_broken_config_names_the_field(tiny_model, changes, phrase):
    folder = _with_config(tiny_model("llama", num_hidden_layers=2), **changes)
    with pytest.raises(LayoutError) as e:
        plan_load(LoadSpec(str(folder)))
    assert phrase in str(e.value)
    assert "config.json" in str(e.value)


def test_integral_numbers_written_as_floats_or_strings_still_load(tiny_model):
    """What the worker's int() accepts, the daemon accepts too."""
    folder = tiny_model("llama")
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    _with_config(folder, hidden_size=float(hidden), intermediate_size=str(
        json.loads((folder / "config.json").read_text())["intermediate_size"]))
    assert plan_load(LoadSpec(str(folder))).tensors


def test_absurdly_nested_json_is_a_parse_error_not_an_internal_one(tiny_model, tmp_path):
    folder = tiny_model("llama")
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    blob = DEEP_JSON.encode()
    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        read_header(deep)

    (folder / "config.json").write_text(DEEP_JSON)
    with pytest.raises(SourceError, match=r"cannot parse .*config.json.*re-download"):
        resolve_model(str(folder))


def test_absurdly_nested_index_is_a_parse_error(tiny_model):
    folder = tiny_model("llama", max_shard_size="100KB")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP_JSON + "}")
    with pytest.raises(SourceError, match=r"cannot parse .*model.safetensors.index.json.*re-download"):
        resolve_model(str(folder))


def test_a_dangling_weight_symlink_is_named(tiny_model):
    """A hub-cache snapshot whose blob was cleaned up: the symlink is what is wrong, not "no weights"."""
    folder = tiny_model("llama")
    (folder / "model.safetensors").unlink()
    os.symlink("../../blobs/0123abcd", folder / "model.safetensors")
    with pytest.raises(SourceError) as e:
        resolve_model(str(folder))
    assert "model.safetensors is a dangling symlink (to ../../blobs/0123abcd)" in str(e.value)
    assert "re-download" in str(e.value)


def test_a_path_too_long_to_look_up_is_a_source_error():
    with pytest.raises(SourceError) as e:
        resolve_model("/" + "a" * 5000)
    assert "cannot be looked up (File name too long)" in str(e.value) and "(5001 characters)" in str(e.value)


@pytest.mark.parametrize("tokenizer_json", ["[]", '{"model": "bpe"}', DEEP_JSON],
                         ids=["list", "model-not-an-object", "deep"])
def test_an_unreadable_tokenizer_json_fails_the_pairing_clearly(tiny_model, tokenizer_json):
    target, draft = tiny_model("llama", name="target"), tiny_model("llama", name="draft", seed=1)
    config = json.loads((target / "config.json").read_text())
    (target / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {}}}')
    (draft / "tokenizer.json").write_text(tokenizer_json)
    with pytest.raises(VocabMismatch) as e:
        check_vocab_compatible(target, config, "target", draft, config, "draft")
    assert "tokenizer.json is unreadable" in str(e.value) and "re-download the tokenizer files" in str(e.value)


def test_a_daemon_that_accepts_but_never_answers_does_not_hang_the_client(short_tmp, monkeypatch):
    """A stopped (SIGSTOP) or hung daemon still completes connects from its listen backlog:
    the hello used to wait forever, so `preload status` and `preload stop` hung with it."""
    import socket
    import threading

    from resident.daemon import client as client_module
    from resident.daemon import fd_session
    from resident.daemon.errors import DaemonUnavailable

    monkeypatch.setattr(fd_session, "FD_CALL_TIMEOUT_S", 0.5)
    listeners = []
    for name in ("d.sock", "d.sock.fd"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(short_tmp / name))
        s.listen(8)   # never accepts: connects complete in the backlog, nothing answers
        listeners.append(s)
    outcome: dict[str, BaseException] = {}

    def connect() -> None:
        try:
            client_module.Client(str(short_tmp / "d.sock")).close()
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome["error"] = e

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(60)   # a bound so that a regression fails instead of hanging the suite
    for s in listeners:
        s.close()     # also frees a client still stuck in a hello
    assert not thread.is_alive(), "the client still waits for the hello"
    error = outcome.get("error")
    assert isinstance(error, DaemonUnavailable), error
    assert "did not answer on its fd socket" in str(error) and "resident preload stop --socket" in str(error)


def test_fds_handed_out_for_sending_outlive_a_forced_unload(tiny_model, tmp_path):
    """`unload --force` closes the slabs while an attach of the same model may be sending their
    fds: fetch_fds hands out duplicates, so what is sent is still the slab, never a closed or
    reused fd number (an unrelated file of the daemon)."""
    from resident.daemon.cache import WeightCache
    from resident.daemon.config import DaemonConfig
    from resident.daemon.memory import get_backend
    from resident.daemon.sessions import PeerCreds

    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), get_backend("host_shm"))
    try:
        model = cache.load(LoadSpec(str(tiny_model("llama")))).model
        sizes = [s.desc.nbytes for s in model.loaded.slabs]
        session = cache.hello(PeerCreds(uid=os.getuid(), gid=os.getgid(), pid=os.getpid()), "engine")
        lease, _ = cache.attach(session.token, model.key)
        pairs = cache.fetch_fds(session.token, lease.lease_id)
        assert cache.unload(model.key, force=True) == [model]
        replacement = os.open(os.devnull, os.O_RDONLY)   # would take a closed slab fd's number
        try:
            assert [os.fstat(fd).st_size for _, fd in pairs] == sizes
        finally:
            os.close(replacement)
            for _, fd in pairs:
                os.close(fd)
    finally:
        cache.close()


def test_a_revision_too_long_for_a_ref_name_is_not_found(tiny_model, tmp_path):
    from fake_hub import fake_hub

    from resident.daemon.source import ModelNotFound

    cache = tmp_path / "hub"
    fake_hub(cache, "org/name", tiny_model("llama"))
    with pytest.raises(ModelNotFound) as e:
        resolve_model("org/name", "v" * 5000, cache)
    assert "of 'org/name' not found in the hub cache" in str(e.value) and "huggingface-cli download" in str(e.value)


def _fake_proc(root: Path, cgroup_line: str, mem_available_kb: int = 8 << 20) -> Path:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: 16000000 kB\nMemAvailable: {mem_available_kb} kB\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup_line + "\n")
    return root / "proc"


def _fake_group(group: Path, limit: str, usage: int, stat: dict[str, int], v1: bool) -> None:
    group.mkdir(parents=True)
    (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(limit + "\n")
    (group / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{usage}\n")
    (group / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in stat.items()))


def test_host_memory_available_is_meminfo_capped_by_the_cgroup(tmp_path):
    from resident.daemon.memory.host_memory import available_bytes

    gib = 1 << 30
    v2 = tmp_path / "v2"
    proc = _fake_proc(v2, "0::/job")
    _fake_group(v2 / "cg" / "job", str(4 * gib), 3 * gib, {"active_file": gib // 2, "inactive_file": gib // 4,
                                                           "shmem": 2 * gib}, v1=False)
    assert available_bytes(str(proc), str(v2 / "cg")) == gib + gib // 2 + gib // 4   # limit - usage + file cache

    v1 = tmp_path / "v1"
    proc = _fake_proc(v1, "4:memory:/job", mem_available_kb=1 << 20)   # 1 GiB: less than the group allows
    _fake_group(v1 / "cg" / "memory" / "job", str(8 * gib), gib, {"total_inactive_file": gib}, v1=True)
    assert available_bytes(str(proc), str(v1 / "cg")) == gib

    unlimited = tmp_path / "unlimited"
    proc = _fake_proc(unlimited, "0::/")
    _fake_group(unlimited / "cg", "max", 5 * gib, {}, v1=False)
    assert available_bytes(str(proc), str(unlimited / "cg")) == 8 * gib
    assert available_bytes(str(tmp_path / "nothing"), str(tmp_path / "nothing")) is None


def test_a_model_larger_than_the_available_host_memory_is_refused_before_allocating(tiny_model, tmp_path):
    """memfd pages are overcommitted: a load past the machine's memory used to run on until
    the OOM killer ended the daemon, and every resident model with it."""
    from resident.daemon.cache import WeightCache, estimate_nbytes
    from resident.daemon.config import DaemonConfig
    from resident.daemon.errors import ResourceExhausted
    from resident.daemon.memory.host_shm import HostShmBackend

    class TightHost(HostShmBackend):
        free = 0

        def available_bytes(self) -> int | None:
            return self.free

        def allocate(self, nbytes, index, device="cpu"):
            assert nbytes <= self.free, "allocated past the available memory"
            return super().allocate(nbytes, index, device)

    backend = TightHost()
    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), backend)
    folder = tiny_model("llama")
    needed = estimate_nbytes(plan_load(LoadSpec(str(folder))), backend)
    try:
        backend.free = needed - 1
        with pytest.raises(ResourceExhausted) as e:
            cache.load(LoadSpec(str(folder)))
        msg = str(e.value)
        assert f"({needed} bytes)" in msg and f"({needed - 1} bytes) are available" in msg
        assert "OOM killer" in msg and "--quantization fp8_per_tensor" in msg
        assert cache.registry.models() == []
        backend.free = needed
        assert cache.load(LoadSpec(str(folder))).model.nbytes >= needed   # slabs are then page-rounded
    finally:
        cache.close()


def test_a_load_behind_another_says_it_waits_and_a_resident_model_does_not_wait(tiny_model, tmp_path):
    """Loads run one at a time. One queued behind another used to show nothing at all until
    its turn, and a load of a model already resident waited for the other load too."""
    import threading

    from resident.daemon.cache import WeightCache
    from resident.daemon.config import DaemonConfig
    from resident.daemon.memory import get_backend

    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), get_backend("host_shm"))
    resident, queued = tiny_model("llama", name="resident"), tiny_model("llama", name="queued", seed=1)
    try:
        cache.load(LoadSpec(str(resident)))
        waiting = threading.Event()
        results: dict[str, object] = {}

        def run(name: str, folder: Path) -> None:
            def progress(event) -> None:
                if event.phase == "waiting":
                    waiting.set()
            results[name] = cache.load(LoadSpec(str(folder)), progress=progress)

        cache._load_lock.acquire()   # another model's load in progress
        try:
            again = threading.Thread(target=run, args=("again", resident), daemon=True)
            again.start()
            again.join(60)
            assert not again.is_alive() and results["again"].already_resident
            behind = threading.Thread(target=run, args=("behind", queued), daemon=True)
            behind.start()
            assert waiting.wait(60), "the queued load did not say it waits"
            assert "behind" not in results
        finally:
            cache._load_lock.release()
        behind.join(60)
        assert not results["behind"].already_resident
    finally:
        cache.close()


@pytest.mark.parametrize("key, section, method", [
    ("quantization_config", {"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),
    ("quantization_config", {"quant_method": "gptq", "bits": 4}, "gptq"),
    ("compression_config", {"quant_method": "compressed-tensors"}, "compressed-tensors"),
], ids=["fp8", "gptq", "compressed-tensors"])
def test_a_pre_quantized_checkpoint_is_named_as_such(tiny_model, key, section, method):
    """Its extra or renamed tensors used to fail as "unknown to the layout; is the architecture
    right?" or "missing", neither of which is the fix."""
    folder = _with_config(tiny_model("llama"), **{key: section})
    with pytest.raises(LayoutError) as e:
        plan_load(LoadSpec(str(folder)))
    msg = str(e.value)
    assert f"pre-quantized checkpoint ({key} quant_method {method!r})" in msg
    assert "load the original checkpoint" in msg and "--quantization fp8_per_tensor" in msg


def test_a_null_quantization_config_is_no_quantization(tiny_model):
    folder = _with_config(tiny_model("llama"), quantization_config=None)
    assert plan_load(LoadSpec(str(folder))).tensors


def test_stopping_the_daemon_abandons_a_load_in_progress(tiny_model, tmp_path):
    """SIGTERM during a load: the load used to run to its end (and the daemon's exit waited for
    it, its model added to a cache already closed); now it stops at its next progress report,
    frees its slabs and fails naming why."""
    from recording_backend import RecordingBackend

    from resident.daemon.cache import WeightCache
    from resident.daemon.config import DaemonConfig
    from resident.daemon.errors import FailedPrecondition

    backend = RecordingBackend()
    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), backend)
    folder = tiny_model("llama")
    phases = []

    def progress(event) -> None:
        phases.append(event.phase)
        if event.phase == "read":
            cache.abandon_loads()      # what Daemon.stop() does first

    try:
        with pytest.raises(FailedPrecondition) as e:
            cache.load(LoadSpec(str(folder)), progress=progress)
        assert f"the daemon is stopping: the load of {folder} was abandoned" in str(e.value)
        assert phases[-1] == "read" and "pack" not in phases   # stopped at the next report
        assert cache.registry.models() == []
        assert backend.slabs and all(s._fd is None for s in backend.slabs)   # its slabs were freed
        with pytest.raises(FailedPrecondition, match="the daemon is stopping"):
            cache.load(LoadSpec(str(tiny_model("llama", name="later", seed=1))))
    finally:
        cache.close()


def test_a_client_whose_daemon_restarted_is_told_to_reconnect(short_tmp, tiny_model):
    """Its leases are gone with the old daemon, so the client cannot quietly say hello again;
    it used to repeat the protocol advice for hand-written clients ("say hello on the fd
    socket first"), which a Client user cannot act on."""
    from helpers import load, start_daemon

    from resident.daemon.errors import Unauthenticated

    folder = tiny_model("llama")
    daemon = start_daemon(short_tmp)
    old_pid = daemon.pid
    client = daemon.client("engine")
    try:
        load(client, folder, name="m")
        client.attach("m")
        assert daemon.stop() == 0
        daemon = start_daemon(short_tmp)
        with pytest.raises(Unauthenticated) as e:
            client.status()
        msg = str(e.value)
        assert f"no longer knows this client's session (the daemon restarted or was replaced since pid {old_pid}" in msg
        assert "open a new Client and attach again" in msg and "say hello" not in msg
        with daemon.client() as fresh:
            assert fresh.status().pid == daemon.pid
    finally:
        client.close()
        assert daemon.stop() == 0


def test_fetching_fds_of_a_lease_ended_by_a_forced_unload_says_so(tiny_model, tmp_path):
    """Attach, then `unload --force`, then the attach's FetchFds: the client used to be told
    "no lease held by this session; attach first" right after it had attached."""
    from resident.daemon.cache import WeightCache
    from resident.daemon.config import DaemonConfig
    from resident.daemon.errors import NotFound
    from resident.daemon.memory import get_backend
    from resident.daemon.sessions import PeerCreds

    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), get_backend("host_shm"))
    try:
        model = cache.load(LoadSpec(str(tiny_model("llama")), name="m")).model
        session = cache.hello(PeerCreds(uid=os.getuid(), gid=os.getgid(), pid=os.getpid()), "engine")
        lease, _ = cache.attach(session.token, "m")
        cache.unload("m", force=True)
        with pytest.raises(NotFound) as e:
            cache.fetch_fds(session.token, lease.lease_id)
        assert f"lease {lease.lease_id} ended before its fds were fetched: m v1 (key {model.key[:16]}) was " \
               "unloaded with --force meanwhile; attach again" == str(e.value)
        with pytest.raises(NotFound, match="no lease 'never' held by this session"):
            cache.fetch_fds(session.token, "never")
    finally:
        cache.close()


@pytest.mark.parametrize("quantization", ["none", "fp8_per_tensor"])
def test_the_estimate_before_evicting_is_the_slabs_real_size(tiny_model, quantization):
    """The load's estimate counts the backend's rounded slab sizes (`slab_bytes`): an estimate
    under the real size made a load evict for room and then be refused once its slabs existed."""
    from resident.daemon.load_gate import estimate_nbytes
    from resident.daemon.loader import load
    from resident.daemon.memory import get_backend

    backend = get_backend("host_shm")
    spec = LoadSpec(str(tiny_model("llama")), quantization=quantization,
                    dtype="bfloat16" if quantization != "none" else "auto")
    loaded = load(spec, backend)
    try:
        assert estimate_nbytes(plan_load(spec), backend) == sum(s.desc.nbytes for s in loaded.slabs)
    finally:
        for s in loaded.slabs:
            s.close()


def test_a_load_refused_for_room_evicts_nothing(tiny_model, tmp_path):
    """a (leased) and a smaller b fit under a cap one byte short of two a-sized models; a load
    of c (a's size) is refused before anything is evicted — with an estimate under the real
    slab size it evicted b first and was refused only after loading."""
    from resident.daemon.cache import WeightCache
    from resident.daemon.config import DaemonConfig
    from resident.daemon.errors import ResourceExhausted
    from resident.daemon.memory import get_backend
    from resident.daemon.sessions import PeerCreds

    paths = {"a": tiny_model("llama", name="a", seed=0, vocab_size=512), "b": tiny_model("llama", name="b", seed=1),
             "c": tiny_model("llama", name="c", seed=2, vocab_size=512)}
    probe = WeightCache(DaemonConfig(socket=str(tmp_path / "p.sock"), http=""), get_backend("host_shm"))
    try:
        size = probe.load(LoadSpec(str(paths["a"]), name="a")).model.nbytes
    finally:
        probe.close()
    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http="", max_bytes=2 * size - 1),
                        get_backend("host_shm"))
    try:
        a = cache.load(LoadSpec(str(paths["a"]), name="a")).model
        assert cache.load(LoadSpec(str(paths["b"]), name="b")).model.nbytes < size
        session = cache.hello(PeerCreds(uid=os.getuid(), gid=os.getgid(), pid=os.getpid()), "engine")
        cache.attach(session.token, a.key)
        with pytest.raises(ResourceExhausted):
            cache.load(LoadSpec(str(paths["c"]), name="c"))
        assert sorted(m.name for m in cache.registry.models()) == ["a", "b"]
    finally:
        cache.close()


def test_a_tcp_address_that_cannot_be_bound_names_the_fix_and_port_0_logs_its_port(short_tmp):
    """--tcp on a busy port ended the start with gRPC's own "Failed to bind ...; set
    GRPC_VERBOSITY=debug"; --tcp HOST:0 logged port 0, not the one it listened on."""
    import re
    import socket

    from helpers import start_daemon

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        refused = start_daemon(short_tmp, "--tcp", taken, "--http", "off", wait=False)
        assert refused.proc.wait(timeout=60) == 1
    log = refused.log()
    assert f"cannot serve gRPC on --tcp {taken}: the port is in use" in log, log
    assert "choose another --tcp HOST:PORT" in log and "GRPC_VERBOSITY" not in log

    daemon = start_daemon(short_tmp, "--tcp", "127.0.0.1:0", "--http", "off", name="e.sock")
    try:
        port = re.search(r"gRPC also listens on TCP 127\.0\.0\.1:(\d+)", daemon.log())
        assert port and int(port.group(1)) > 0, daemon.log()
    finally:
        assert daemon.stop() == 0

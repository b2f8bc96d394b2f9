"""`resident preload unload MODEL` while MODEL is still loading used to answer "no resident
model named ..." (the load was not in the registry yet): it now says the model is still
loading and what to do, and unloads nothing."""
from __future__ import annotations

import threading

import pytest

from resident.daemon.cache import WeightCache
from resident.daemon.config import DaemonConfig
from resident.daemon.errors import FailedPrecondition, NotFound
from resident.daemon.loader import LoadSpec
from resident.daemon.memory import get_backend


def test_unloading_a_model_still_loading_says_so_and_unloads_nothing(tiny_model, tmp_path, monkeypatch):
    from resident.daemon import loader

    model = tiny_model("llama")
    older = tiny_model("llama", name="older", seed=1)
    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), get_backend("host_shm"))
    release, reading = threading.Event(), threading.Event()
    real_load = loader.load

    def slow_load(*args, **kwargs):
        reading.set()
        release.wait(30)
        return real_load(*args, **kwargs)

    try:
        old = cache.load(LoadSpec(model=str(older), name="chat")).model   # an older version of the name
        monkeypatch.setattr(loader, "load", slow_load)
        results: dict[str, object] = {}
        loading = threading.Thread(target=lambda: results.update(r=cache.load(LoadSpec(model=str(model),
                                                                                          name="chat"))))
        loading.start()
        assert reading.wait(30)
        key = loader.plan_load(LoadSpec(model=str(model), name="chat")).key
        for target in ("chat", key, key[:12]):
            with pytest.raises(FailedPrecondition, match=r"^chat is still loading; nothing was unloaded\. Retry "
                                                         r"`resident preload unload .*`resident preload status` "
                                                         "shows it resident"):
                cache.unload(target)
        assert cache.registry.get_key(old.key) is not None   # the resident version was kept
        release.set()
        loading.join(60)
        assert results["r"].model.key == key
        assert key in [m.key for m in cache.unload("chat")]   # resident now: unloads as before
        with pytest.raises(NotFound, match="no resident model named or keyed 'chat'"):
            cache.unload("chat")
    finally:
        release.set()
        cache.close()


def test_a_load_waiting_for_its_turn_counts_as_loading(tiny_model, tmp_path):
    model = tiny_model("llama")
    cache = WeightCache(DaemonConfig(socket=str(tmp_path / "s.sock"), http=""), get_backend("host_shm"))
    waiting = threading.Event()
    cache._load_lock.acquire()   # another model's load in progress
    try:
        loading = threading.Thread(target=cache.load, args=(LoadSpec(model=str(model)),),
                                   kwargs={"progress": lambda e: e.phase == "waiting" and waiting.set()})
        loading.start()
        assert waiting.wait(30)
        with pytest.raises(FailedPrecondition, match="still loading"):
            cache.unload(str(model))
    finally:
        cache._load_lock.release()
    loading.join(60)
    assert [m.name for m in cache.unload(str(model))] == [str(model)]
    cache.close()

"""Registry: names, versions, stale keys, LRU eviction under max_bytes (no sockets)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from resident.daemon.errors import InvalidArgument, ModelLeased, NotFound, ResourceExhausted, StaleModel
from resident.daemon.memory import SlabDesc
from resident.daemon.registry import Registry


class FakeSlab:
    def __init__(self, nbytes: int) -> None:
        self.desc = SlabDesc(index=0, nbytes=nbytes, backend="host_shm")
        self.closed = False

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeLoaded:
    key: str
    name: str
    nbytes: int
    source: str = "/models/x"
    slabs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slabs = [FakeSlab(self.nbytes)]


class Leases(Counter):
    def count(self, key: str) -> int:
        return self[key]


def make(max_bytes: int = 0) -> tuple[Registry, Leases]:
    leases = Leases()
    return Registry(max_bytes, leases.count), leases


def add(reg: Registry, key: str, name: str, nbytes: int = 100):
    model, dropped = reg.add(FakeLoaded(key, name, nbytes), "host_shm")
    time.sleep(0.002)  # distinct last-used times
    return model, dropped


def test_attach_by_name_gets_newest_by_key_gets_that_version():
    reg, leases = make()
    v1, _ = add(reg, "k1", "m")
    leases["k1"] += 1
    v2, dropped = add(reg, "k2", "m")
    assert (v1.version, v2.version, dropped) == (1, 2, [])
    assert not v1.latest and v2.latest
    assert reg.resolve("m") is v2
    assert reg.resolve("k1") is v1


def test_stale_expected_key_is_refused_with_both_keys_and_the_fix():
    reg, leases = make()
    add(reg, "k1", "m")
    leases["k1"] += 1
    add(reg, "k2", "m")
    with pytest.raises(StaleModel) as e:
        reg.resolve("m", expected_key="k1")
    msg = str(e.value)
    assert "stale model key" in msg and "k2" in msg and "k1" in msg and "resident preload load" in msg
    assert reg.resolve("m", expected_key="k2").key == "k2"


def test_old_version_stays_while_leased_and_goes_when_the_lease_ends():
    reg, leases = make()
    v1, _ = add(reg, "k1", "m")
    leases["k1"] += 1
    add(reg, "k2", "m")
    assert {m.key for m in reg.models()} == {"k1", "k2"}
    leases["k1"] -= 1
    dropped = reg.drop_stale()
    assert dropped == [v1] and v1.loaded.slabs[0].closed
    assert [m.key for m in reg.models()] == ["k2"]


def test_unleased_old_version_is_dropped_on_reload():
    reg, _ = make()
    v1, _ = add(reg, "k1", "m")
    v2, dropped = add(reg, "k2", "m")
    assert dropped == [v1] and [m.key for m in reg.models()] == ["k2"]
    v3, _ = add(reg, "k3", "m")
    assert v3.version == 3  # versions never repeat under a name


def test_unknown_model_lists_what_is_resident():
    reg, _ = make()
    add(reg, "k1", "alpha")
    with pytest.raises(NotFound, match="alpha") as e:
        reg.resolve("beta")
    assert "resident preload load beta" in str(e.value)


def test_lru_eviction_spares_recently_used_and_leased():
    reg, leases = make(max_bytes=300)
    a, _ = add(reg, "ka", "a")
    b, _ = add(reg, "kb", "b")
    c, _ = add(reg, "kc", "c")
    reg.touch(a, attach=True)          # a is now the most recently used
    leases["kb"] += 1                  # b is leased: never evicted
    evicted = reg.make_room(100)
    assert evicted == [c] and c.loaded.slabs[0].closed
    assert {m.name for m in reg.models()} == {"a", "b"}
    assert reg.resident_bytes == 200


def test_nothing_evicted_when_even_eviction_would_not_make_room():
    reg, leases = make(max_bytes=300)
    add(reg, "ka", "a")
    add(reg, "kb", "b")
    leases["ka"] += 1
    leases["kb"] += 1
    with pytest.raises(ResourceExhausted) as e:
        reg.make_room(150)
    msg = str(e.value)
    assert "150 bytes" in msg and "--max-bytes" in msg and "a v1" in msg and "b v1" in msg
    assert len(reg.models()) == 2   # nothing evicted for a load that cannot happen anyway
    with pytest.raises(ResourceExhausted, match="more than --max-bytes"):
        reg.make_room(400)


def test_unlimited_never_evicts():
    reg, _ = make(max_bytes=0)
    add(reg, "ka", "a", nbytes=10**12)
    assert reg.make_room(10**12) == []


def test_unload_of_a_leased_model_needs_force():
    reg, leases = make()
    m, _ = add(reg, "k1", "m")
    leases["k1"] += 1
    with pytest.raises(ModelLeased, match="--force"):
        reg.remove("m")
    assert reg.remove("m", force=True) == [m] and reg.models() == []
    with pytest.raises(NotFound):
        reg.remove("m")


def test_unload_by_key_removes_one_version():
    reg, leases = make()
    add(reg, "k1", "m")
    leases["k1"] += 1
    add(reg, "k2", "m")
    assert [x.key for x in reg.remove("k2")] == ["k2"]
    # The newest is gone; the leased old version is not handed out as current.
    with pytest.raises(NotFound, match="no longer resident"):
        reg.resolve("m")
    assert reg.resolve("k1").key == "k1"


def test_unload_by_the_key_prefix_that_list_shows():
    """`resident preload list` prints 12 digits of each key: unload takes those (any unique
    prefix of at least 8 hex digits), refuses an ambiguous one, and never guesses from a short one."""
    reg, _ = make()
    a, _ = add(reg, "3eb9cbe6adae95c2" + "0" * 48, "a")
    add(reg, "3eb9cbe6ff0011aa" + "0" * 48, "b")
    with pytest.raises(InvalidArgument) as e:
        reg.remove("3eb9cbe6")
    assert "matches 2 resident models" in str(e.value) and "give more digits" in str(e.value)
    with pytest.raises(NotFound, match="no resident model named or keyed '3eb9cbe'"):
        reg.remove("3eb9cbe")                  # 7 digits: too short to mean one model
    assert reg.remove("3eb9cbe6adae") == [a]
    assert [m.name for m in reg.models()] == ["b"]
    with pytest.raises(NotFound):
        reg.remove("3eb9cbe6adae")


def test_promote_makes_an_older_resident_version_current_again():
    reg, leases = make()
    v1, _ = add(reg, "k1", "m")
    leases["k1"] += 1
    v2, _ = add(reg, "k2", "m")
    dropped = reg.promote(v1)    # the checkpoint was changed back
    assert reg.resolve("m") is v1 and dropped == [v2]

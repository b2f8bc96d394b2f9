"""HostToDevice: a step's int arrays staged through one buffer, values intact on either device."""
from __future__ import annotations

import random

import pytest
import torch

from resident.worker.input_batch import HostToDevice


def _parts(rng: random.Random, num_parts: int) -> list[list[int]]:
    return [[rng.randrange(-2**40, 2**40) for _ in range(rng.randrange(0, 300))] for _ in range(num_parts)]


def _check_rounds(device: torch.device) -> None:
    rng = random.Random(0)
    h2d = HostToDevice(device, capacity=16)
    for _ in range(20):   # sizes vary; the buffer grows past its first capacity
        parts = _parts(rng, rng.randrange(1, 6))
        parts.append(range(5, 9))   # any sequence of ints, not only lists
        got = h2d.send(parts)
        assert [t.device.type for t in got] == [device.type] * len(parts)
        assert [t.tolist() for t in got] == [list(p) for p in parts]
    assert h2d.capacity > 16


def test_send_round_trips_on_cpu() -> None:
    _check_rounds(torch.device("cpu"))


def test_cpu_views_of_one_send_survive_the_next() -> None:
    h2d = HostToDevice(torch.device("cpu"))
    (a,) = h2d.send([[1, 2, 3]])
    h2d.send([[7, 7, 7, 7]])
    assert a.tolist() == [1, 2, 3]


@pytest.mark.gpu
def test_send_round_trips_on_cuda() -> None:
    _check_rounds(torch.device("cuda", torch.cuda.current_device()))

"""The command stream from rank 0 of a tensor-parallel group to its other ranks (see
tp_executor.py's module doc): one pipe to each child carrying length-prefixed pickles —
`CommandPipe` on rank 0, `receive` on a child; tens of microseconds a step, where a gloo
`broadcast_object` took about a millisecond — and `compact`, the step's SchedulerOutput cut
to what the other ranks need.

Commands: ("open",), ("plan", kw, cached), ("build", kwargs), ("call", method, args),
("map", num_blocks), ("grow", num_blocks), ("stop",) — run by `tp_rank.serve_commands`.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import threading
from typing import Any

from resident.worker.distributed import ParallelError

#: Exit status of rank 0 when a child rank died under it (and of a child whose rank 0 is gone:
#: its lifeline pipe closed).
RANK_DIED_EXIT = 3


def compact(out: Any) -> Any:
    """The SchedulerOutput the other ranks need: without the prompt token list and with at most
    the first output token (the lists only feed sampling penalties, whose requests step
    synchronously, where the other ranks' samples are discarded), so a step's message stays
    small however long the contexts are. The first output token says whether the request has
    sampled before: a seeded request's first sample starts its generator afresh
    (`ModelRunner.generator`), on every rank alike, which async scheduling relies on (each rank
    substitutes its own samples). A request with min_tokens keeps up to min_tokens of them: its
    mask asks whether fewer than min_tokens were generated, and async scheduling has every rank
    sample alike. Guided requests' grammar bitmasks stay on rank 0: such requests step
    synchronously (engine.overlappable), so the other ranks' samples are discarded; so do requests
    with a bad word of several tokens (its mask reads the output's last tokens). allowed_token_ids
    and one-token bad words need no earlier token: they travel in the sampling params. A request
    with prompt logprobs keeps its prompt: every rank computes the same logits rows (the LM head's
    all-gather), which the prompt's length decides."""
    return dataclasses.replace(out, grammar_bitmask={}, grammar_matchers={}, grammar_deferred={}, scheduled=[
        dataclasses.replace(s, prompt_token_ids=s.prompt_token_ids if s.sampling_params.prompt_logprobs is not None
                            else [],
                            output_token_ids=s.output_token_ids[:max(1, s.sampling_params.min_tokens)])
        for s in out.scheduled])


class CommandPipe:
    """Rank 0's end of the command pipes to its children (see the module doc)."""

    def __init__(self, fds: list[int]) -> None:
        self._files = [os.fdopen(fd, "wb") for fd in fds]
        # The engine thread (steps, grow) and the KV growth thread (map) both send: one frame at a time.
        self._lock = threading.Lock()

    def send(self, cmd: tuple) -> None:
        payload = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        frame = len(payload).to_bytes(8, "little") + payload
        with self._lock:
            for rank, f in enumerate(self._files, start=1):
                try:
                    f.write(frame)
                    f.flush()
                except (BrokenPipeError, ValueError):   # ValueError: closed by close() meanwhile
                    raise ParallelError(f"tensor-parallel rank {rank} is gone (its command pipe is closed)") from None

    def close(self) -> None:
        with self._lock:
            for f in self._files:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
            self._files = []


def receive(f: Any) -> tuple:
    """A child's next command; ("stop",) when rank 0 closed the pipe (or died)."""
    header = f.read(8)
    if len(header) < 8:
        return ("stop",)
    n = int.from_bytes(header, "little")
    payload = f.read(n)
    if len(payload) < n:
        return ("stop",)
    return pickle.loads(payload)


__all__ = ["RANK_DIED_EXIT", "CommandPipe", "compact", "receive"]

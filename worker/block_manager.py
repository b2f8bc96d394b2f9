"""Paged KV blocks: allocation, reference counts and the prefix cache.

Every block is in exactly one of three states:
  free       ref count 0, holds nothing worth keeping;
  evictable  ref count 0, holds the KV of a full block that the prefix cache can hand out;
  used       ref count > 0 (shared between requests when they hit the same cached prefix).
Free and evictable blocks sit in one queue ordered by eviction preference: plain free
blocks at the head, then cached blocks least recently released first. Allocation pops the
head, evicting (un-hashing) a cached block only when no plain free block is left.

A full block is identified by a chained hash: sha256(parent block's hash + its token ids),
so a hit on block i implies that the whole prefix up to block i matches. Only blocks whose
tokens all have computed KV are registered; blocks still being filled never are.
"""
from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from resident.worker.request import Request

logger = logging.getLogger(__name__)

_ROOT_HASH = b""


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained block hash; sha256 so that distinct prefixes never share KV by collision."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class BlockCounts:
    num_free: int
    num_evictable: int
    num_used: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block holding that KV
        self._req_blocks: dict[str, list[int]] = {}
        self._req_num_registered: dict[str, int] = {}  # leading blocks already in the prefix cache

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus evictable."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1); evictable cached blocks count as free."""
        return (self.num_blocks - len(self._free_queue)) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's live block table (grown and trimmed in place): copy it to keep it."""
        return self._req_blocks.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """request.block_hashes extended to cover the full blocks of its first num_tokens tokens."""
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else _ROOT_HASH, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        Never the whole sequence: at least one token is left to compute, since computing
        it is what yields the logits for the next token. Changes nothing.
        """
        if not self.enable_prefix_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens:
            return [], 0   # cached positions yield no logits: its prompt logprobs need every one
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in self._full_block_hashes(request, max_blocks * self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # -- state changes -------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Give the request blocks for num_new_tokens more tokens; False (nothing changed) if
        too few blocks are free.

        computed_blocks: on admission, the prefix-cache hit from get_computed_blocks; the
        request then holds no blocks yet and its new tokens follow the hit.
        """
        rid = request.request_id
        held = self._req_blocks.get(rid)
        if computed_blocks is None and held is not None:
            # A running request (every decode step): usually its last block has room; else
            # the new blocks go onto its table in place (the scheduler hands runners copies).
            num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(held)
            if num_needed <= 0:
                return True
            if num_needed > len(self._free_queue):
                return False
            held.extend([self._pop_free_block() for _ in range(num_needed)])
            return True
        held = held if held is not None else []
        if computed_blocks is not None:
            assert not held, f"{request} already holds blocks"
            num_total = len(computed_blocks) * self.block_size + num_new_tokens
        else:
            computed_blocks = []
            num_total = request.num_computed_tokens + num_new_tokens
        num_needed = self.num_blocks_for(num_total) - len(held) - len(computed_blocks)
        # Reviving an evictable hit takes it out of the pool the new blocks come from.
        num_revived = sum(1 for b in computed_blocks if self._ref_counts[b] == 0)
        if num_needed > len(self._free_queue) - num_revived:
            return False
        for b in computed_blocks:
            if self._ref_counts[b] == 0:
                del self._free_queue[b]
            self._ref_counts[b] += 1
        new_blocks = [self._pop_free_block() for _ in range(max(num_needed, 0))]
        self._req_blocks[rid] = held + computed_blocks + new_blocks
        if rid not in self._req_num_registered:
            self._req_num_registered[rid] = len(computed_blocks)
        return True

    def _pop_free_block(self) -> int:
        block, _ = self._free_queue.popitem(last=False)
        h = self._block_hash[block]
        if h is not None:  # evict: its KV is about to be overwritten
            self._block_hash[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
        self._ref_counts[block] = 1
        return block

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's blocks that are now full of computed KV in the prefix cache
        (of its first `num_tokens` tokens, default all computed ones: a speculative step may
        hold a block back until the draft's KV of it is complete, see scheduler.py)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if not blocks:
            return
        num_computed = request.num_computed_tokens if num_tokens is None else min(num_tokens,
                                                                                  request.num_computed_tokens)
        num_full = num_computed // self.block_size
        if num_full <= self._req_num_registered[rid]:
            return  # no block filled up since the last call (most decode steps)
        hashes = self._full_block_hashes(request, num_full * self.block_size)
        for i in range(self._req_num_registered[rid], num_full):
            block, h = blocks[i], hashes[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
            # else: the same content was computed twice (two requests admitted together);
            # this copy stays unregistered and returns to the plain free pool when released.
        self._req_num_registered[rid] = max(self._req_num_registered[rid], num_full)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Release the request's trailing blocks beyond the first num_blocks_for(num_tokens):
        the KV of rejected speculative tokens. Those blocks hold no committed KV, so none is
        in the prefix cache; they return to the plain free pool. Returns how many were freed."""
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        keep = self.num_blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        assert keep >= self._req_num_registered.get(rid, 0), (request, keep)
        tail = blocks[keep:]
        del blocks[keep:]
        for block in reversed(tail):
            assert self._block_hash[block] is None, f"block {block} holding uncommitted KV is cached"
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] == 0, f"speculative block {block} is shared"
            self._free_queue[block] = None
            self._free_queue.move_to_end(block, last=False)
        return len(tail)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Cached ones stay reusable until evicted; the tail of
        the sequence is queued for eviction before its head (a later request is likelier to
        share the head)."""
        rid = request.request_id
        self._req_num_registered.pop(rid, None)
        for block in reversed(self._req_blocks.pop(rid, [])):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, block
            if self._ref_counts[block] == 0:
                self._free_queue[block] = None
                if self._block_hash[block] is None:
                    self._free_queue.move_to_end(block, last=False)

    def add_blocks(self, num_new: int) -> None:
        """Make `num_new` more blocks available, ids continuing the range (the KV cache grew).

        The new blocks are plain free blocks, so they are handed out before any evictable
        cached block; blocks held by requests and the prefix cache are untouched. Call only
        between steps, once the memory behind the new ids exists.
        """
        if num_new < 1:
            raise ValueError(f"add_blocks needs at least one block, got {num_new}")
        first = self.num_blocks
        self._ref_counts.extend([0] * num_new)
        self._block_hash.extend([None] * num_new)
        # Plain free blocks go to the head of the queue, before the cached ones (order among
        # plain free blocks does not matter).
        for b in range(first + num_new - 1, first - 1, -1):
            self._free_queue[b] = None
            self._free_queue.move_to_end(b, last=False)
        self.num_blocks = first + num_new
        logger.info("block manager: %d blocks added (ids %d..%d), %d in all", num_new, first,
                    self.num_blocks - 1, self.num_blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (e.g. after the weights changed)."""
        for block in list(self._free_queue):
            h = self._block_hash[block]
            if h is not None:
                self._block_hash[block] = None
                del self._cached[h]
                self._free_queue.move_to_end(block, last=False)

    # -- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> BlockCounts:
        """Assert every invariant; return the free/evictable/used counts. For tests and debugging."""
        refs = [0] * self.num_blocks
        for rid, blocks in self._req_blocks.items():
            assert len(set(blocks)) == len(blocks), f"request {rid} holds a block twice: {blocks}"
            for b in blocks:
                refs[b] += 1
        assert refs == self._ref_counts, "ref counts disagree with the requests' block tables"
        zero = {b for b in range(self.num_blocks) if refs[b] == 0}
        assert zero == set(self._free_queue), "the free queue is not exactly the unreferenced blocks"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"prefix cache entry points to block {b} of another hash"
        hashed = [b for b in range(self.num_blocks) if self._block_hash[b] is not None]
        assert len(hashed) == len(self._cached), "a hashed block is missing from the prefix cache"
        if not self.enable_prefix_caching:
            assert not hashed, "prefix caching is off but blocks are hashed"
        num_evictable = sum(1 for b in self._free_queue if self._block_hash[b] is not None)
        counts = BlockCounts(num_free=len(self._free_queue) - num_evictable,
                             num_evictable=num_evictable,
                             num_used=self.num_blocks - len(self._free_queue))
        assert counts.num_free + counts.num_evictable + counts.num_used == self.num_blocks
        # Plain free blocks come first in eviction order.
        seen_hashed = False
        for b in self._free_queue:
            if self._block_hash[b] is not None:
                seen_hashed = True
            else:
                assert not seen_hashed, "a plain free block is queued behind a cached one"
        return counts

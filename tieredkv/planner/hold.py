"""Finished requests held while refused, and boundary states offered until taken.

An engine frees a finished request's GPU blocks, and offers a Mamba/SSM boundary state (a copy of
the state at a chunk boundary, in a block of its own) exactly once. What was refused then is lost
unless the planner keeps it. The rules, vLLM-free (the vLLM connector drives them):

- :class:`HoldBook` -- a finished request whose chunks were refused keeps its blocks (the engine
  delays freeing them) and is offered again each step, until nothing waits, or ``max_steps``
  steps passed, with at most ``max_blocks`` blocks held over every request; a request that does
  not fit is not held (its waiting chunks are lost, and counted).
- :class:`HandoffQueue` -- a refused boundary state is offered again each step, until its block
  is reallocated, its request is gone, or it was tried ``max_attempts`` times.
- :func:`drop_reused_blocks` -- a held request's freed sliding-window blocks may be reallocated:
  such a block is nulled in the chunks that may still be offered, so it is never stored from.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, MutableSequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tieredkv.planner.ledger import ChunkLedger

__all__ = ["Handoff", "HandoffQueue", "Held", "HoldBook", "drop_reused_blocks"]

T = TypeVar("T")


@dataclass
class Held(Generic[T]):
    """A held finished request: the engine's state of it, the blocks it holds, steps held."""

    state: T
    num_blocks: int
    steps: int = 0


class HoldBook(Generic[T]):
    """Finished requests whose blocks are held while some of their chunks wait.

    Args:
        max_steps: Steps a request is held at most (0: never hold).
        max_blocks: Blocks held over every request at most.
    """

    def __init__(self, max_steps: int, max_blocks: int) -> None:
        self.max_steps = max_steps
        self.max_blocks = max_blocks
        self.held: dict[str, Held[T]] = {}
        self.num_blocks = 0

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.held

    def __bool__(self) -> bool:
        return bool(self.held)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.held))

    def get(self, req_id: str) -> T | None:
        held = self.held.get(req_id)
        return None if held is None else held.state

    def hold(self, req_id: str, state: T, num_blocks: int) -> bool:
        """Hold a finished request with chunks waiting if it fits; False: its blocks go back."""
        if not self.max_steps or self.num_blocks + num_blocks > self.max_blocks:
            return False
        self.held[req_id] = Held(state, num_blocks)
        self.num_blocks += num_blocks
        return True

    def step(self, req_id: str) -> Held[T]:
        """One more step held (before the request's next store pass)."""
        held = self.held[req_id]
        held.steps += 1
        return held

    def expired(self, req_id: str, num_waiting: int) -> bool:
        """Whether to let the request go: nothing waits, or it was held ``max_steps`` steps."""
        return num_waiting == 0 or self.held[req_id].steps >= self.max_steps

    def release(self, req_id: str) -> Held[T]:
        """Stop holding the request: the engine may free its blocks."""
        held = self.held.pop(req_id)
        self.num_blocks -= held.num_blocks
        return held


@dataclass
class Handoff:
    """A boundary state the engine handed over: the group, its block and its boundary (tokens)."""

    req_id: str
    group_idx: int
    block_id: int
    boundary: int
    attempts: int = 0


class HandoffQueue:
    """Boundary states offered until taken (see the module docstring).

    Args:
        max_attempts: Offers of one state at most (at least 1).
    """

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max(1, max_attempts)
        self.refused: list[Handoff] = []

    def __bool__(self) -> bool:
        return bool(self.refused)

    def count(self, req_id: str) -> int:
        """Refused states of a request, waiting to be offered again."""
        return sum(1 for h in self.refused if h.req_id == req_id)

    def due(
        self, new: Iterable[Handoff], reallocated: Collection[int], alive: Callable[[str], bool]
    ) -> tuple[list[Handoff], int, int]:
        """The states to offer now: earlier refusals still worth it, then ``new`` ones.

        An earlier refusal is dropped when its block is in ``reallocated`` (the engine reused
        it), when it was tried ``max_attempts`` times or when its request is gone (``alive``).
        The queue empties: :meth:`refuse` puts back the ones refused again. Returns the states,
        then how many were dropped for a reused block and how many given up.
        """
        pending: list[Handoff] = []
        gone = given_up = 0
        for h in self.refused:
            if h.block_id in reallocated:
                gone += 1
            elif h.attempts >= self.max_attempts or not alive(h.req_id):
                given_up += 1
            else:
                pending.append(h)
        pending.extend(new)
        self.refused = []
        return pending, gone, given_up

    def refuse(self, h: Handoff) -> None:
        """The store refused ``h``: offer it again next step."""
        h.attempts += 1
        self.refused.append(h)

    def clear(self) -> None:
        self.refused = []


def drop_reused_blocks(
    led: ChunkLedger, block_ids: MutableSequence[int], blocks_per_chunk: int, reallocated: Collection[int]
) -> None:
    """Null every block in ``reallocated`` among the chunks that may still be offered: the
    waiting ones and those past the scan position (a bounded pass may not have reached them)."""
    bpc = blocks_per_chunk
    for k in itertools.chain(led.waiting, range(led.scan, len(block_ids) // bpc)):
        for j in range(k * bpc, (k + 1) * bpc):
            if block_ids[j] in reallocated:
                block_ids[j] = 0

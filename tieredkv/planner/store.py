"""Store planning: which whole chunks of a request to offer the store now, and what an answer does.

One :class:`StorePlanner` serves every tieredkv planner: the library's ``OffloadScheduler`` (so
the demo and ``store.planner()``) and the vLLM connector's scheduler side. The engine side hands
it, per group, the facts it knows (:class:`GroupFacts`: keys, GPU block ids, how many chunks are
storable now, which blocks a later lookup may read); the planner answers with the chunks to offer
and, after the store's answer, moves each group's :class:`~tieredkv.planner.ledger.ChunkLedger`.

Rules, by construction:

1. A chunk is offered only when its key exists, it is below the group's storable limit and its
   blocks are whole: no null block -- or, where the planner takes partial chunks (the vLLM
   connector's ``partial_chunks``), only leading null blocks that no later lookup reads (a
   sliding-window chunk whose first blocks left the window for good; a store job starts mid-chunk
   only in a group's first offered chunk, so a second such chunk waits for the next plan).
2. A chunk whose blocks can never become whole (below ``GroupFacts.final_below``: left the window
   for good, the request is over, or the engine freed or reused a block) is passed as dead; one
   that may still become whole waits. A chunk no later lookup reads at all is dead.
3. The cursor moves only over done and dead chunks: an offered chunk waits until the store took it
   or holds it (:meth:`StorePlanner.settle`); a refused one, or one a store left out of a partial
   answer, is offered again -- oldest first -- and never skipped.
4. Bounded plans: a plan visits at most the request's budget of chunks, shared over the groups
   either by water-filling with a rotating remainder (``shared``) or as an even per-group share;
   with ``adaptive`` a plan refused whole halves the budget (down to 1) and one with progress
   doubles it back, so an all-or-nothing store with little room drains a backlog.

Per-step work grows with the chunks a plan visits (waiting ones first, then new ones from each
group's scan position), not with the chunks a request holds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple, Protocol

from tieredkv.planner.ledger import WAITING, ChunkLedger, RequestStore
from tieredkv.planner.plans import ChunkToStore

__all__ = [
    "DEFAULT_MAX_CHUNKS_PER_PLAN",
    "NULL_BLOCK",
    "GroupFacts",
    "StorePlanner",
    "StoreTally",
    "final_segment",
    "share_out",
]

NULL_BLOCK = 0

#: Default bound on the chunks one store plan of a request visits.
DEFAULT_MAX_CHUNKS_PER_PLAN = 256

#: ``reach(lo, limit)``: per block of chunks ``lo .. limit - 1``, whether a later lookup may read
#: it (None: every block).
ReachMask = Callable[[int, int], Sequence[bool] | None]


class GroupFacts(NamedTuple):
    """What the engine knows of one group of one request, for one store plan.

    Attributes:
        keys: The group's chunk keys known so far.
        block_ids: The group's GPU block ids, one per block slot (0: null).
        blocks_per_chunk: GPU blocks per chunk.
        limit: Chunks storable now (offloadable, allocated and keyed).
        final_below: Chunks below this index whose blocks are not whole never will be (dead);
            above it they may still become whole (waiting). The library: the chunks out of a
            sliding window for good, or every chunk of a finished request; the vLLM connector:
            every chunk (vLLM never hands a freed block back).
        reach: Which blocks a later lookup may read (None: every block).
        skip_dead_run: Pass a leading run of never-whole chunks without spending the budget
            (e.g. the sliding-window chunks before a loaded hit).
    """

    keys: Sequence[bytes]
    block_ids: Sequence[int]
    blocks_per_chunk: int
    limit: int
    final_below: int = 0
    reach: ReachMask | None = None
    skip_dead_run: bool = False


class StoreTally(Protocol):
    """Counters a planner moves while planning (the vLLM connector's ``ConnectorCounters``)."""

    keys_retried: int  # waiting chunks offered again
    chunks_blocks_gone: int  # waiting chunks whose blocks the engine freed first


class StorePlanner:
    """The store-planning rules (see the module docstring), configured per engine.

    Args:
        max_chunks: A request's budget: the most chunks one plan visits (None: no bound).
        shared: Share the budget over the groups by water-filling (the library); else each
            group gets ``ceil(budget / groups)`` (the vLLM connector's per-step key budget).
        adaptive: Halve a request's budget after a plan refused whole, double it back after progress.
        partial_chunks: Offer chunks whose leading null blocks no lookup reads (rule 1).
    """

    def __init__(
        self,
        *,
        max_chunks: int | None = DEFAULT_MAX_CHUNKS_PER_PLAN,
        shared: bool = True,
        adaptive: bool = True,
        partial_chunks: bool = False,
    ) -> None:
        self.max_chunks = max_chunks
        self.shared = shared
        self.adaptive = adaptive
        self.partial_chunks = partial_chunks

    def new_request(self, num_groups: int) -> RequestStore:
        """The store state of a new request over ``num_groups`` groups."""
        return RequestStore(num_groups, self.max_chunks)

    # ------------------------------------------------------------------ plan

    def plan(
        self, req: RequestStore, groups: Sequence[GroupFacts | None], tally: StoreTally | None = None
    ) -> list[list[ChunkToStore]]:
        """The chunks to offer now, per group (None: a group this planner does not store).

        Each group's chunks ascend. The plan replaces the request's earlier one (its ``offers``):
        :meth:`settle` applies the store's answer to this one.
        """
        budget = req.budget
        shared = budget is not None and self.shared
        demand: list[int] = []
        for facts, led in zip(groups, req.ledgers):
            if facts is None:
                demand.append(0)
                continue
            if facts.skip_dead_run and facts.final_below > led.scan:
                _pass_dead_run(led, facts)
            if shared:
                waiting = led.waiting  # at least as many chunks as candidates() would visit:
                limit = facts.limit
                demand.append((bisect.bisect_left(waiting, limit) if waiting else 0) + max(0, limit - led.scan))
        shares: Sequence[int | None]
        if budget is None:
            shares = (None,) * len(groups)
        elif not shared:
            shares = (math.ceil(budget / len(groups)),) * len(groups)
        elif sum(demand) <= budget:
            shares = (None,) * len(groups)
        else:  # the bound binds: share it out
            shares = share_out(budget, demand, req.rotation)
            req.rotation = (req.rotation + 1) % len(groups)
        offers: list[list[ChunkToStore]] = []
        offered = 0
        for pos, (facts, led) in enumerate(zip(groups, req.ledgers)):
            out: list[ChunkToStore] = []
            offers.append(out)
            if facts is None:
                continue
            limit = facts.limit
            waiting = led.waiting
            if led.scan < limit or (waiting and waiting[0] < limit):  # else nothing below the cursor
                # the oldest waiting chunks, then new ones from the scan position, at most the share
                cands = led.candidates(limit, shares[pos])
                if cands:
                    cands.sort()  # waiting chunks past a forgotten one come first: offers ascend
                    self._classify(led, facts, cands, tally, out)
                    offered += len(out)
            led.settle_scan()  # e.g. loaded chunks, or stored before a rewind
        req.offers = offers if offered else None
        return offers

    def _classify(
        self, led: ChunkLedger, facts: GroupFacts, cands: list[int], tally: StoreTally | None, out: list[ChunkToStore]
    ) -> None:
        """Sort candidates into offers (appended to ``out``), waiting and dead chunks (rules 1, 2)."""
        keys, ids, bpc, limit, final_below, reach, _ = facts
        lo = cands[0]
        mask = reach(lo, limit) if reach is not None else None
        partial = self.partial_chunks
        status = led.status
        new_chunk = tuple.__new__  # ChunkToStore(...) without its Python-level __new__
        for k in cands:
            blocks = tuple(ids[k * bpc : (k + 1) * bpc])
            sub = mask[(k - lo) * bpc : (k - lo + 1) * bpc] if mask is not None else None
            if sub is not None and not any(sub):
                led.mark_dead(k)  # no lookup reads it now; reconsidered on a resume
                continue
            if NULL_BLOCK in blocks:
                nulls = _leading_nulls(blocks)
                if not (
                    partial
                    and nulls < bpc
                    and NULL_BLOCK not in blocks[nulls:]
                    and not (sub is not None and any(sub[:nulls]))
                ):  # not whole enough: a block a lookup reads is gone, or not there yet
                    if k < final_below:
                        if tally is not None and k < len(status) and status[k] == WAITING:
                            tally.chunks_blocks_gone += 1
                        led.mark_dead(k)
                    else:
                        led.mark_waiting(k)
                    continue
                if out:
                    led.mark_waiting(k)  # only a group's first chunk may start mid-chunk (wire format)
                    continue
            if tally is not None and k < len(status) and status[k] == WAITING:
                tally.keys_retried += 1  # offered before
            led.mark_waiting(k)
            out.append(new_chunk(ChunkToStore, (keys[k], k, blocks)))

    # ---------------------------------------------------------------- settle

    def settle(self, req: RequestStore, done: Collection[bytes], final: bool = False) -> bool:
        """Apply the store's answer to the request's latest plan.

        ``done``: the planned keys the store accepted or already holds; they are done. Every other
        planned key stays waiting (offered again) -- with ``final`` (a finished request whose blocks
        the engine frees) it is dead instead. With ``adaptive``, a plan with nothing done halves
        the budget and one with progress doubles it back. Keys not in the latest plan are ignored.
        Returns whether anything was done.
        """
        offers = req.offers
        if offers is None:
            return False
        req.offers = None
        progressed = False
        if done:
            for led, chunks in zip(req.ledgers, offers):
                for c in chunks:
                    if c[0] in done:
                        led.mark_done(c[1])
                        progressed = True
        budget = req.budget
        if self.adaptive and budget is not None and self.max_chunks is not None:
            req.budget = min(self.max_chunks, 2 * budget) if progressed else max(1, budget // 2)
        if final:
            for led, chunks in zip(req.ledgers, offers):
                for c in chunks:
                    if not led.is_done(c[1]):
                        led.mark_dead(c[1])  # offered once: the engine frees the blocks
        return progressed


def final_segment(limit: int, prompt_chunks: int, *, finished: bool, open_ended: bool) -> int | None:
    """The end (in chunks) of the last segment a later lookup may end inside, for a reachability
    mask over chunks below ``limit``: a finished request's last chunk; the prompt's while the
    prompt is being stored; None (open) while decoding, or where a lookup may end anywhere
    (``open_ended``: vLLM's retention interval, EAGLE groups)."""
    if open_ended:
        return None
    if finished:
        return limit
    return prompt_chunks if limit <= prompt_chunks else None


def share_out(budget: int, demand: Sequence[int], rotation: int) -> list[int]:
    """Split ``budget`` over the groups by water-filling: no group gets more than its
    ``demand``, the rest is shared evenly; a remainder smaller than the groups still
    wanting goes one by one, starting at group ``rotation`` (which turns every plan)."""
    n = len(demand)
    shares = [0] * n
    active = [p for p in ((rotation + i) % n for i in range(n)) if demand[p] > 0]
    left = budget
    while left > 0 and active:
        each = left // len(active)
        if each == 0:
            for p in active[:left]:
                shares[p] += 1
            break
        still = []
        for p in active:
            give = min(each, demand[p] - shares[p])
            shares[p] += give
            left -= give
            if shares[p] < demand[p]:
                still.append(p)
        active = still
    return shares


def _pass_dead_run(led: ChunkLedger, facts: GroupFacts) -> None:
    """Move the scan over a leading run of chunks that can never become whole, without visiting
    them (so without spending the budget): e.g. the sliding-window chunks before a loaded hit."""
    scan, bpc, ids, below = led.scan, facts.blocks_per_chunk, facts.block_ids, facts.final_below
    if scan < min(facts.limit, below) and NULL_BLOCK in ids[scan * bpc : (scan + 1) * bpc]:
        led.pass_never_storable(facts.limit, lambda k: k < below and NULL_BLOCK in ids[k * bpc : (k + 1) * bpc])


def _leading_nulls(blocks: tuple[int, ...]) -> int:
    n = 0
    for b in blocks:
        if b:
            break
        n += 1
    return n

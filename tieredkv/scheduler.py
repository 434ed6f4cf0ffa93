"""Scheduler adapter: what to store and what to load, per request and KV group.

Pure bookkeeping: no vLLM import, no I/O. The engine (the vLLM connector or the
standalone store) tells the adapter about a request's block hashes and GPU block
ids; the adapter answers with plans, and the engine reports back what the store
side did with them.

Primitives:

- :class:`OffloadScheduler` -- per request and group: offload keys, GPU block ids,
  a store cursor, hits. Methods, in a request's life:

  - :meth:`~OffloadScheduler.add_request`, :meth:`~OffloadScheduler.update_request`
    (append hashes / block ids), :meth:`~OffloadScheduler.release_blocks`;
  - :meth:`~OffloadScheduler.plan_lookup` -> :class:`LookupPlan` (longest hit that is
    whole chunks in every group), :meth:`~OffloadScheduler.plan_load` ->
    :class:`LoadPlan` (keys and destination blocks of an accepted hit);
  - :meth:`~OffloadScheduler.plan_store` -> :class:`StorePlan` (whole chunks only),
    :meth:`~OffloadScheduler.complete_store` with a :class:`StoreOutcome`;
  - :meth:`~OffloadScheduler.preempt`, :meth:`~OffloadScheduler.finish_request`
    (first final plan; also for aborts), :meth:`~OffloadScheduler.plan_finished`
    (the next final plans, see below), :meth:`~OffloadScheduler.remove_request`,
    :meth:`~OffloadScheduler.reset`.

Rules the adapter guarantees by construction:

1. A chunk is planned for store only when every one of its GPU blocks is non-null
   and its key exists (hashes may lag blocks).
2. A group's cursor passes a chunk only when the store accepted it, already had
   it, or it can never become whole (it has a null block and has left the
   group's window for good, or the request is over). A refused chunk stays
   below the cursor and is offered again on the next plan.
3. A lookup answers 0 or a boundary that is whole chunks in every group and
   backed by stored chunks; the last known token is always recomputed.
4. A lookup's misses are fed back: a chunk the request had stored that the
   lookup finds missing (evicted) is storable again -- in a full-attention
   group with every later chunk, which the lookup did not confirm -- so a
   preempted request stores what it recomputes instead of trusting stale marks.

Bounded plans. A store plan visits (so offers) at most ``max_chunks_per_plan``
chunks of a request (default 64; None: no bound), the oldest waiting (refused)
chunks of each group first; a run of chunks that can never be stored (null
blocks out of the window, e.g. before a loaded hit) is passed without counting.
The bound is shared out over the groups by water-filling: a group gets at most
what it can use (its waiting chunks plus the chunks past its scan position), the
rest is split evenly, and a remainder smaller than the number of groups goes one
chunk each starting at a group that rotates every plan -- so every group
progresses, even with a bound smaller than the number of groups. A plan refused
whole halves the request's bound (down to 1 chunk) and a plan with anything
accepted or present doubles it back, so an all-or-nothing store with room for
fewer chunks than the backlog drains it instead of refusing it forever. A bound
below the chunks a step makes delays stores; in a sliding-window group a chunk
that leaves the window before it is offered is lost, so size the bound above a
step's chunks.

Finished requests. :meth:`~OffloadScheduler.finish_request` returns the first
final plan; each whole chunk of a finished request is offered once (a refused
one is dropped: the engine frees the blocks). While chunks are left unoffered
after :meth:`~OffloadScheduler.complete_store` -- the final plan was bounded --
the request stays tracked: :meth:`~OffloadScheduler.finished_requests` lists it
and :meth:`~OffloadScheduler.plan_finished` returns its next plan (the engine
keeps its blocks until then). An empty final plan means the request is gone::

    plan = sched.finish_request(rid, num_computed_tokens=n)
    while plan:
        sched.complete_store(rid, store(plan))  # e.g. one plan per engine step
        if rid not in sched:
            break
        plan = sched.plan_finished(rid)

Per-step work is proportional to the chunks a step touches: each group walks
only from its scan position forward, plus at most the bound's worth of waiting
chunks -- it does not grow with a refused backlog.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from tieredkv.groups import GroupKind, GroupLayout, GroupSpec
from tieredkv.keys import make_chunk_key

__all__ = [
    "ChunkLedger",
    "ChunkToStore",
    "GroupLoadPlan",
    "GroupLookup",
    "GroupProgress",
    "GroupStorePlan",
    "LoadPlan",
    "LookupPlan",
    "OffloadScheduler",
    "StoreOutcome",
    "StorePlan",
]

NULL_BLOCK = 0

#: Default bound on the chunks one store plan of a request visits.
DEFAULT_MAX_CHUNKS_PER_PLAN = 256

# Per-chunk status bytes. WAITING chunks are also listed in _GroupState.waiting.
_UNSEEN, _WAITING, _DONE, _DEAD = 0, 1, 2, 3
_DONE_RUN = bytes((_DONE,))
_NOT_DONE = (_UNSEEN, _WAITING, _DEAD)


def _chunk_key(block_hash: bytes, group: int) -> bytes:
    """vLLM OffloadKey layout: hash bytes + group index, 4 bytes big-endian."""
    return make_chunk_key(block_hash, group)


# --------------------------------------------------------------------- plans


@dataclass(frozen=True)
class ChunkToStore:
    """One whole chunk to store: its key, index in the group, and GPU blocks."""

    key: bytes
    chunk_index: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class GroupStorePlan:
    """The chunks of one group to store this step, ascending."""

    group: int
    chunks: tuple[ChunkToStore, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Keys of the chunks, in chunk order."""
        return tuple(c.key for c in self.chunks)

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Every source GPU block id, chunk-major (never a null id)."""
        return tuple(b for c in self.chunks for b in c.block_ids)


@dataclass(frozen=True)
class StorePlan:
    """What to store for one request after one step, one entry per group."""

    req_id: str
    num_offloadable_tokens: int
    groups: tuple[GroupStorePlan, ...]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """All keys, group-major then ascending chunk (vLLM's spec order)."""
        return tuple(k for g in self.groups for k in g.keys)

    def __bool__(self) -> bool:
        return any(g.chunks for g in self.groups)


@dataclass(frozen=True)
class StoreOutcome:
    """What the store side did with a :class:`StorePlan`.

    Attributes:
        accepted: Keys it will write.
        present: Keys it already holds.
        refused: Keys it could not take now (capacity); offered again later.

    A planned key in none of the sets is treated as refused.
    """

    accepted: frozenset[bytes] = frozenset()
    present: frozenset[bytes] = frozenset()
    refused: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        for name in ("accepted", "present", "refused"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        both = (self.accepted | self.present) & self.refused
        if both or self.accepted & self.present:
            raise ValueError("a key can be in only one of accepted/present/refused")

    @classmethod
    def from_prepare_store(cls, plan: StorePlan, keys_to_store: Iterable[bytes] | None) -> StoreOutcome:
        """Translate vLLM's all-or-nothing ``prepare_store`` answer.

        ``None`` refuses the whole plan; otherwise ``keys_to_store`` are
        accepted and every other planned key is already present.
        """
        keys = frozenset(plan.keys)
        if keys_to_store is None:
            return cls(refused=keys)
        accepted = frozenset(keys_to_store) & keys
        return cls(accepted=accepted, present=keys - accepted)


@dataclass(frozen=True)
class GroupLookup:
    """The chunks of one group that a hit needs from the store."""

    group: int
    first_chunk: int
    end_chunk: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class LookupPlan:
    """The longest hit whole in every group; ``num_hit_tokens`` is 0 on a miss.

    Attributes:
        num_computed_tokens: The local (GPU) prefix the lookup started from.
        boundary_tokens: Local prefix plus hit (== num_computed_tokens on a miss).
        num_hit_tokens: Tokens the store can provide beyond the local prefix.
        groups: Per group, the stored chunks the hit relies on (empty on a miss).
    """

    num_computed_tokens: int
    boundary_tokens: int
    num_hit_tokens: int
    groups: tuple[GroupLookup, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every key the hit relies on, group-major."""
        return tuple(k for g in self.groups for k in g.keys)


@dataclass(frozen=True)
class GroupLoadPlan:
    """Keys and GPU destinations of one group for a load.

    Attributes:
        group: The group index.
        keys: Chunk keys to read, ascending.
        chunk_indices: The chunk index of each key.
        dst_block_ids: Destination GPU block ids, ascending position, no nulls.
        block_positions: Each destination's block index within the request.
        start_offset: Blocks to skip inside the first chunk (the local prefix
            or a null placeholder ends mid-chunk).
    """

    group: int
    keys: tuple[bytes, ...] = ()
    chunk_indices: tuple[int, ...] = ()
    dst_block_ids: tuple[int, ...] = ()
    block_positions: tuple[int, ...] = ()
    start_offset: int = 0

    @property
    def is_contiguous(self) -> bool:
        """True when destinations are one run from ``start_offset`` (vLLM's layout)."""
        if not self.block_positions:
            return True
        first = self.block_positions[0]
        return self.block_positions[-1] - first + 1 == len(self.block_positions)


@dataclass(frozen=True)
class LoadPlan:
    """Everything to load for an accepted hit, one entry per group."""

    req_id: str
    num_computed_tokens: int
    boundary_tokens: int
    groups: tuple[GroupLoadPlan, ...]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """All keys, group-major then ascending chunk."""
        return tuple(k for g in self.groups for k in g.keys)


@dataclass(frozen=True)
class GroupProgress:
    """A snapshot of one group's bookkeeping for a request."""

    group: int
    num_keys: int
    num_blocks: int
    cursor: int
    num_waiting: int
    hit_chunks: int


# --------------------------------------------------------------------- state


class ChunkLedger:
    """Store progress of one request's chunks in one KV group.

    The rules every tieredkv planner shares (``OffloadScheduler`` and the vLLM
    connector ``TieredKVConnector``): a chunk is *unseen*, *waiting* (offered,
    not yet accepted: offered again), *done* (stored or present) or *dead*
    (can never become whole). The cursor -- the lowest chunk not done or dead --
    moves only over done and dead chunks, so a refused or partially accepted
    chunk is never skipped. Waiting chunks are kept sorted, so a plan that takes
    the oldest ``n`` of them costs O(n), not O(backlog).
    """

    __slots__ = ("first_dead", "scan", "status", "waiting")

    def __init__(self) -> None:
        self.status = bytearray()
        # Every chunk below `scan` is DONE, DEAD or WAITING (then in `waiting`).
        self.scan = 0
        self.waiting: list[int] = []  # sorted
        self.first_dead: int | None = None

    def status_of(self, k: int) -> int:
        return self.status[k] if k < len(self.status) else _UNSEEN

    def _set(self, k: int, value: int) -> None:
        if k >= len(self.status):
            self.status.extend(bytes(k + 1 - len(self.status)))
        if value == _DEAD and (self.first_dead is None or k < self.first_dead):
            # Also when k is already dead: a rewind cleared first_dead but kept the status, and
            # a chunk passed as dead again must be reconsidered by the next rewind too.
            self.first_dead = k
        old = self.status[k]
        if old == value:
            return
        if old == _WAITING:
            i = bisect.bisect_left(self.waiting, k)
            del self.waiting[i]
        self.status[k] = value
        if value == _WAITING:
            bisect.insort(self.waiting, k)

    def mark_waiting(self, k: int) -> None:
        """Chunk ``k`` was offered (or cannot be offered yet): offer it again later."""
        self._set(k, _WAITING)

    def mark_done(self, k: int) -> None:
        """Chunk ``k`` is stored or present; the scan moves over a done run."""
        self._set(k, _DONE)
        while self.status_of(self.scan) == _DONE:
            self.scan += 1

    def mark_done_range(self, lo: int, hi: int) -> None:
        """Chunks ``lo .. hi - 1`` are stored or present (e.g. a loaded hit): :meth:`mark_done` of
        each, with the status bytes set and the waiting ones dropped in a few C calls."""
        if hi <= lo:
            return
        if hi > len(self.status):
            self.status.extend(bytes(hi - len(self.status)))
        w = self.waiting
        if w and w[0] < hi and w[-1] >= lo:
            del w[bisect.bisect_left(w, lo) : bisect.bisect_left(w, hi)]
        self.status[lo:hi] = _DONE_RUN * (hi - lo)
        self.settle_scan()

    def mark_dead(self, k: int) -> None:
        """Chunk ``k`` can never become whole (left the window, request over)."""
        self._set(k, _DEAD)

    def is_done(self, k: int) -> bool:
        return self.status_of(k) == _DONE

    def forget(self, k: int) -> None:
        """The store lost chunk ``k`` (a lookup missed it): store it again."""
        if k < len(self.status) and self.status[k] != _UNSEEN:
            self._set(k, _UNSEEN)
            self.scan = min(self.scan, k)

    def rewind_dead(self) -> None:
        """Reconsider chunks passed as never storable (e.g. after a preemption)."""
        if self.first_dead is not None:
            self.scan = min(self.scan, self.first_dead)
            self.first_dead = None

    def reset(self) -> None:
        """The store was emptied: everything is unseen again."""
        self.status = bytearray()
        self.scan = 0
        self.waiting.clear()
        self.first_dead = None

    def candidates(self, limit: int, budget: int | None = None) -> list[int]:
        """Chunks below ``limit`` to visit now: the oldest waiting ones, then new ones.

        At most ``budget`` chunks (None: no bound). The scan position moves to
        the last new chunk returned, so chunks past a bound are visited by a
        later call; call :meth:`settle_scan` after classifying them.
        """
        out: list[int] = []
        for k in self.waiting:
            if k >= limit or (budget is not None and len(out) >= budget):
                break
            out.append(k)
        k = self.scan
        while k < limit and (budget is None or len(out) < budget):
            if self.status_of(k) in (_UNSEEN, _DEAD):
                out.append(k)
            k += 1
        self.scan = max(self.scan, k)
        return out

    def pass_never_storable(self, limit: int, never_storable: Callable[[int], bool]) -> None:
        """Move the scan over the run of chunks below ``limit`` that need no visit: done,
        waiting (listed), or never storable (``never_storable(k)``: marked dead).

        Amortized O(1) per chunk; lets a bounded :meth:`candidates` spend its budget on
        chunks that may be offered, not on a long run of dead ones (e.g. the sliding-window
        chunks before a loaded hit).
        """
        k = self.scan
        while k < limit:
            if self.status_of(k) in (_UNSEEN, _DEAD):
                if not never_storable(k):
                    break
                self._set(k, _DEAD)
            k += 1
        self.scan = k

    def settle_scan(self) -> None:
        """Move the scan over a run of done chunks (e.g. loaded ones). The run's end is found by C
        searches of the status bytes in windows that double from 16, each search bounded by the
        nearest end found so far: the cost grows with the run, not with the ledger."""
        st, k = self.status, self.scan
        n = len(st)
        if k >= n or st[k] != _DONE:
            return
        k += 1
        width = 16
        while k < n:
            end = min(n, k + width)
            stop = end
            for status in _NOT_DONE:
                i = st.find(status, k, stop)
                if i >= 0:
                    stop = i
            if stop < end:
                k = stop
                break
            k, width = end, width * 2
        self.scan = k

    @property
    def cursor(self) -> int:
        """Lowest chunk not yet stored, present or never storable."""
        return min(self.scan, self.waiting[0]) if self.waiting else self.scan

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


class _GroupState:
    """Per request, per group: keys, block ids and the store ledger."""

    __slots__ = ("block_ids", "hits", "keys", "ledger")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.block_ids: list[int] = []
        self.ledger = ChunkLedger()
        self.hits = 0


class _Request:
    __slots__ = (
        "budget",
        "finished",
        "frontier",
        "groups",
        "hashes",
        "max_offload_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "pending",
        "req_id",
        "rotation",
    )

    def __init__(
        self,
        req_id: str,
        num_prompt_tokens: int,
        max_offload_tokens: int | None,
        n: int,
        budget: int | None,
    ) -> None:
        self.req_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.max_offload_tokens = max_offload_tokens
        self.hashes: list[bytes] = []
        self.groups = tuple(_GroupState() for _ in range(n))
        # key -> (group position, chunk index) of the latest plan
        self.pending: dict[bytes, tuple[int, int]] = {}
        self.finished = False
        self.frontier = 0  # a finished request's final frontier
        self.budget = budget  # chunks the next plan may visit (None: no bound)
        self.rotation = 0  # the group planned first (every group gets its turn)


def _share_out(budget: int, demand: Sequence[int], rotation: int) -> list[int]:
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


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: expected a non-negative integer")


# ----------------------------------------------------------------- scheduler


class OffloadScheduler:
    """Multi-group store/lookup/load planner for live requests.

    Args:
        layout: The model's offloaded KV groups.
        offload_prompt_only: Store only prompt chunks (vLLM's default).
        max_chunks_per_plan: The most chunks one store plan of a request visits
            (so offers), oldest waiting first; None: no bound (a plan then offers
            the whole backlog, and costs O(backlog)). See the module docstring.
    """

    def __init__(
        self,
        layout: GroupLayout,
        *,
        offload_prompt_only: bool = True,
        max_chunks_per_plan: int | None = DEFAULT_MAX_CHUNKS_PER_PLAN,
    ) -> None:
        if max_chunks_per_plan is not None and (
            isinstance(max_chunks_per_plan, bool) or not isinstance(max_chunks_per_plan, int) or max_chunks_per_plan < 1
        ):
            raise ValueError(f"max_chunks_per_plan={max_chunks_per_plan!r}: expected a positive integer or None")
        self.layout = layout
        self.offload_prompt_only = offload_prompt_only
        self.max_chunks_per_plan = max_chunks_per_plan
        self._hpc = tuple(layout.hashes_per_chunk(i) for i in range(len(layout)))
        self._reqs: dict[str, _Request] = {}

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        req_id: str,
        num_prompt_tokens: int,
        *,
        block_hashes: Sequence[bytes] = (),
        max_offload_tokens: int | None = None,
    ) -> None:
        """Start tracking a request.

        Args:
            req_id: Unique request id.
            num_prompt_tokens: Prompt length in tokens.
            block_hashes: Hashes known so far, one per ``tokens_per_hash`` tokens.
            max_offload_tokens: Per-request cap on stored tokens (None: no cap).
        """
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already tracked")
        _check_count("num_prompt_tokens", num_prompt_tokens)
        if max_offload_tokens is not None:
            _check_count("max_offload_tokens", max_offload_tokens)
        req = _Request(req_id, num_prompt_tokens, max_offload_tokens, len(self.layout), self.max_chunks_per_plan)
        self._reqs[req_id] = req
        self._append_hashes(req, block_hashes)

    def update_request(
        self,
        req_id: str,
        *,
        block_hashes: Sequence[bytes] = (),
        block_ids: Sequence[Sequence[int]] | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Append new block hashes and newly allocated GPU block ids.

        Args:
            req_id: The request.
            block_hashes: Hashes that became known since the last call.
            block_ids: Per group (layout order), the block ids allocated this
                step, appended to the group's list; 0 is a null block.
            num_tokens: The request's current token count (prompt + output).
        """
        req = self._get(req_id)
        self._append_hashes(req, block_hashes)
        if block_ids is not None:
            if len(block_ids) != len(self.layout):
                raise ValueError(f"block_ids has {len(block_ids)} groups, layout has {len(self.layout)}")
            for gs, new_ids in zip(req.groups, block_ids):
                gs.block_ids.extend(new_ids)
        if num_tokens is not None:
            _check_count("num_tokens", num_tokens)
            req.num_tokens = max(req.num_tokens, num_tokens)

    def release_blocks(self, req_id: str, group_pos: int, positions: Iterable[int]) -> None:
        """Mark block slots the engine freed (e.g. left the window) as null.

        A chunk with a released block is never stored from stale ids.
        """
        ids = self._get(req_id).groups[group_pos].block_ids
        for p in positions:
            if 0 <= p < len(ids):
                ids[p] = NULL_BLOCK

    def preempt(self, req_id: str) -> None:
        """The engine preempted the request: its GPU blocks are gone.

        Block ids are cleared; stored chunks stay stored. Chunks passed as
        never storable are reconsidered, since recomputation may make them
        whole. Refused chunks stay below the cursor.
        """
        for gs in self._get(req_id).groups:
            gs.block_ids.clear()
            gs.ledger.rewind_dead()

    def finish_request(self, req_id: str, *, num_computed_tokens: int, aborted: bool = False) -> StorePlan:
        """The request ended; return its first final store plan.

        A finished request offers every token whose KV exists (the final
        sampled token has none); an aborted one only its computed tokens. Every
        chunk that is not whole now never will be, and each whole one is
        offered once: a refused one is dropped, since the engine frees the
        blocks. A plan is bounded by ``max_chunks_per_plan``: while whole
        chunks remain unoffered after :meth:`complete_store`, the request stays
        tracked (see :meth:`finished_requests`) and :meth:`plan_finished` gives
        the next plan -- keep its GPU blocks until then. The request is dropped
        after the outcome of the plan that leaves nothing to offer; an empty
        plan means it is already dropped.
        """
        req = self._get(req_id)
        _check_count("num_computed_tokens", num_computed_tokens)
        req.finished = True
        if aborted:
            req.frontier = num_computed_tokens
        else:
            req.frontier = max(num_computed_tokens, req.num_prompt_tokens, req.num_tokens - 1)
        return self._final_plan(req)

    def plan_finished(self, req_id: str) -> StorePlan:
        """The next final plan of a finished request that still has chunks to offer.

        For the requests in :meth:`finished_requests`, after the outcome of
        their previous plan. An empty plan means nothing is left: the request
        is dropped. A plan not completed is replaced (its chunks are offered
        again).
        """
        req = self._get(req_id)
        if not req.finished:
            raise ValueError(f"request {req_id!r} has not finished; use plan_store")
        return self._final_plan(req)

    def finished_requests(self) -> tuple[str, ...]:
        """Finished requests still tracked: awaiting an outcome, or with chunks left to offer."""
        return tuple(r.req_id for r in self._reqs.values() if r.finished)

    def _final_plan(self, req: _Request) -> StorePlan:
        while True:
            plan = self._plan(req, req.frontier, final=True)
            if plan:
                return plan
            # Empty: every chunk visited was never storable (now dead). Go on while any is left.
            if not self._has_more(req):
                del self._reqs[req.req_id]
                return plan

    def _has_more(self, req: _Request) -> bool:
        """Whether a finished request has chunks below its final limit not yet resolved."""
        offloadable = self._offloadable(req, req.frontier)
        return any(
            gs.ledger.cursor < self._limit(spec, gs, offloadable) for spec, gs in zip(self.layout.groups, req.groups)
        )

    def remove_request(self, req_id: str) -> None:
        """Forget a request (no-op if unknown)."""
        self._reqs.pop(req_id, None)

    def reset(self) -> None:
        """The store was emptied: every live request re-offers from chunk 0.

        Finished requests awaiting their final outcome are dropped; outcomes of
        plans made before the reset are ignored.
        """
        for req_id in [r.req_id for r in self._reqs.values() if r.finished]:
            del self._reqs[req_id]
        for req in self._reqs.values():
            req.pending = {}
            req.budget = self.max_chunks_per_plan
            for gs in req.groups:
                gs.ledger.reset()

    # ------------------------------------------------------------- store

    def plan_store(self, req_id: str, *, num_computed_tokens: int, num_scheduled_tokens: int = 0) -> StorePlan:
        """Plan the whole chunks to store after this step.

        Args:
            req_id: A running request.
            num_computed_tokens: Tokens computed before this step.
            num_scheduled_tokens: Tokens this step computes.

        Returns:
            Per group, the chunks that are whole now and not yet stored,
            chunks refused earlier first; at most the request's current bound
            (``max_chunks_per_plan``, halved after a plan refused whole). It
            replaces any earlier plan of this request that was not completed.
        """
        req = self._get(req_id)
        if req.finished:
            raise ValueError(f"request {req_id!r} has finished; use finish_request / plan_finished")
        _check_count("num_computed_tokens", num_computed_tokens)
        _check_count("num_scheduled_tokens", num_scheduled_tokens)
        return self._plan(req, num_computed_tokens + num_scheduled_tokens, final=False)

    def complete_store(self, req_id: str, outcome: StoreOutcome) -> None:
        """Record what the store side did with the request's latest plan.

        Accepted and present chunks are done; refused (or unmentioned) ones
        are offered again by the next plan -- of a finished request, never
        again. A plan refused whole halves the request's bound on the next
        plans (down to 1 chunk), one with anything accepted or present doubles
        it back (up to ``max_chunks_per_plan``), so a store with room for
        fewer chunks than the backlog still drains it. A finished request is
        dropped once nothing is left to offer. Unknown requests and keys that
        are not in the latest plan (stale outcomes) are ignored.
        """
        req = self._reqs.get(req_id)
        if req is None:
            return
        progressed = False
        for key in outcome.accepted | outcome.present:
            where = req.pending.get(key)
            if where is not None:
                req.groups[where[0]].ledger.mark_done(where[1])
                progressed = True
        if req.pending and req.budget is not None:
            assert self.max_chunks_per_plan is not None
            if progressed:
                req.budget = min(self.max_chunks_per_plan, 2 * req.budget)
            else:
                req.budget = max(1, req.budget // 2)
        if req.finished:
            for pos, k in req.pending.values():
                ledger = req.groups[pos].ledger
                if not ledger.is_done(k):
                    ledger.mark_dead(k)  # offered once: the engine frees the blocks
        req.pending = {}
        if req.finished and not self._has_more(req):
            del self._reqs[req_id]

    def _offloadable(self, req: _Request, frontier: int) -> int:
        num = min(frontier, req.num_tokens)
        if req.max_offload_tokens is not None:
            num = min(num, req.max_offload_tokens)
        if self.offload_prompt_only:
            num = min(num, req.num_prompt_tokens)
        return num

    def _plan(self, req: _Request, frontier: int, *, final: bool) -> StorePlan:
        offloadable = self._offloadable(req, frontier)
        budget = req.budget
        limits: list[int] = []
        demand: list[int] = []
        for spec, gs in zip(self.layout.groups, req.groups):
            limit = self._limit(spec, gs, offloadable)
            ledger = gs.ledger
            scan, bpc = ledger.scan, spec.blocks_per_chunk
            if (
                scan < limit
                and (final or spec.kind is not GroupKind.FULL)
                and NULL_BLOCK in gs.block_ids[scan * bpc : (scan + 1) * bpc]
            ):  # maybe a run of chunks that can never be stored: pass it without spending the bound
                dead = partial(self._never_storable, spec, gs, frontier=frontier, final=final)
                ledger.pass_never_storable(limit, dead)
            limits.append(limit)
            if budget is not None:
                waiting = ledger.waiting  # at least as many chunks as candidates() would visit:
                demand.append((bisect.bisect_left(waiting, limit) if waiting else 0) + max(0, limit - ledger.scan))
        shares: Sequence[int | None] = (None,) * len(limits)
        if budget is not None and sum(demand) > budget:  # the bound binds: share it out
            shares = _share_out(budget, demand, req.rotation)
            req.rotation = (req.rotation + 1) % len(limits)
        plans: list[GroupStorePlan] = []
        pending: dict[bytes, tuple[int, int]] = {}
        for pos, (spec, gs) in enumerate(zip(self.layout.groups, req.groups)):
            chunks = self._plan_group(spec, gs, limits[pos], frontier, final, shares[pos])
            for chunk in chunks:
                pending[chunk.key] = (pos, chunk.chunk_index)
            plans.append(GroupStorePlan(spec.index, tuple(chunks)))
        req.pending = pending
        return StorePlan(req.req_id, offloadable, tuple(plans))

    @staticmethod
    def _limit(spec: GroupSpec, gs: _GroupState, offloadable: int) -> int:
        """Chunks of the group that are offloadable, allocated and keyed."""
        return min(offloadable // spec.tokens_per_chunk, len(gs.block_ids) // spec.blocks_per_chunk, len(gs.keys))

    def _plan_group(
        self, spec: GroupSpec, gs: _GroupState, limit: int, frontier: int, final: bool, budget: int | None
    ) -> list[ChunkToStore]:
        """Visit waiting chunks, then new chunks from the scan position, at most ``budget``."""
        out: list[ChunkToStore] = []
        for k in gs.ledger.candidates(limit, budget):
            self._visit(spec, gs, k, frontier, final, out)
        gs.ledger.settle_scan()  # e.g. loaded chunks, or stored before a rewind
        out.sort(key=lambda c: c.chunk_index)
        return out

    def _visit(
        self,
        spec: GroupSpec,
        gs: _GroupState,
        k: int,
        frontier: int,
        final: bool,
        out: list[ChunkToStore],
    ) -> None:
        """Classify chunk ``k``: whole (offer it), waiting, or never storable."""
        bpc = spec.blocks_per_chunk
        blocks = gs.block_ids[k * bpc : (k + 1) * bpc]
        if NULL_BLOCK not in blocks:
            gs.ledger.mark_waiting(k)
            out.append(ChunkToStore(gs.keys[k], k, tuple(blocks)))
        elif final or self._out_of_reach(spec, k, frontier):
            gs.ledger.mark_dead(k)
        else:
            gs.ledger.mark_waiting(k)

    @staticmethod
    def _out_of_reach(spec: GroupSpec, k: int, frontier: int) -> bool:
        """Chunk ``k`` has left the group's window for good (no query from ``frontier`` on reads it)."""
        reach = spec.reach_tokens
        return reach is not None and (k + 1) * spec.tokens_per_chunk + reach <= frontier

    def _never_storable(self, spec: GroupSpec, gs: _GroupState, k: int, frontier: int, final: bool) -> bool:
        """Chunk ``k`` has a null block and is over (final) or out of reach: it never becomes whole."""
        if not final and not self._out_of_reach(spec, k, frontier):
            return False
        bpc = spec.blocks_per_chunk
        return NULL_BLOCK in gs.block_ids[k * bpc : (k + 1) * bpc]

    # ------------------------------------------------------------ lookup

    def plan_lookup(
        self,
        req_id: str,
        *,
        num_computed_tokens: int,
        is_stored: Callable[[bytes], bool] | Container[bytes],
        max_load_tokens: int | None = None,
    ) -> LookupPlan:
        """Find the longest hit that is whole chunks in every group.

        Full-attention groups need every chunk from the local prefix to the
        boundary; sliding-window groups the window's chunks before it; mamba
        groups the chunk ending at it. Groups are re-checked until they agree.

        Misses are fed back: a chunk the request had stored (or loaded) that
        ``is_stored`` now answers missing was evicted, and is offered again by
        :meth:`plan_store` once it is whole (e.g. recomputed after a
        preemption); in a full-attention group so is every later chunk counted
        as stored. (A key still being written that ``is_stored`` answers False
        is offered again too, and answered "present": harmless.)

        Args:
            req_id: The request (its prompt hashes must be known).
            num_computed_tokens: The local (GPU prefix cache) hit in tokens.
            is_stored: Answers whether a key is readable in the store.
            max_load_tokens: Optional cap on the tokens loaded beyond the prefix.

        Returns:
            The hit; ``num_hit_tokens`` is 0 unless every group gains whole chunks.
        """
        req = self._get(req_id)
        _check_count("num_computed_tokens", num_computed_tokens)
        computed = num_computed_tokens
        probe = _Probe(is_stored)
        bound = req.num_tokens - 1  # the last known token is always recomputed
        if max_load_tokens is not None:
            bound = min(bound, computed + max_load_tokens)
        for spec, gs in zip(self.layout.groups, req.groups):
            bound = min(bound, len(gs.keys) * spec.tokens_per_chunk)
        full_prefix: dict[int, int] = {}
        while bound > computed:
            new = bound
            for pos, (spec, gs) in enumerate(zip(self.layout.groups, req.groups)):
                new = self._group_boundary(spec, gs, computed, new, probe, full_prefix, pos)
                if new <= computed:
                    break
            if new == bound:
                return self._lookup_plan(req, computed, bound)
            bound = new
        return LookupPlan(computed, computed, 0)

    def _group_boundary(
        self,
        spec: GroupSpec,
        gs: _GroupState,
        computed: int,
        bound: int,
        probe: _Probe,
        full_prefix: dict[int, int],
        pos: int,
    ) -> int:
        """Largest boundary <= ``bound`` this group can serve (<= computed: none)."""
        tpc = spec.tokens_per_chunk
        first, end = computed // tpc, bound // tpc
        wc = spec.window_chunks
        if wc is None:
            if pos not in full_prefix:  # scanned once per lookup; bound only shrinks
                k = first
                while k < end and probe(gs.keys[k]):
                    k += 1
                if k < end:
                    self._missed(gs, k, full=True)
                full_prefix[pos] = k
            return min(full_prefix[pos], end) * tpc
        while end > first:
            low = max(end - wc, first)
            k = end - 1
            while k >= low and probe(gs.keys[k]):
                k -= 1
            if k < low:
                return end * tpc
            self._missed(gs, k, full=False)
            end = k  # chunk k is missing: a valid end is at most k
        return 0

    @staticmethod
    def _missed(gs: _GroupState, k: int, *, full: bool) -> None:
        """A lookup found chunk ``k`` missing: if the ledger counted it stored, it was evicted.

        The chunk is forgotten, so the request stores it again once it is whole
        (after a preemption, when it is recomputed). In a full-attention group
        every later chunk counted as stored is forgotten too: the lookup did not
        confirm them (it stops at the first miss), and a re-offered chunk the
        store still holds is only answered "present".
        """
        ledger = gs.ledger
        if not full:
            if ledger.is_done(k):
                ledger.forget(k)
            return
        k = ledger.status.find(_DONE, k)
        while k != -1:
            ledger.forget(k)
            k = ledger.status.find(_DONE, k + 1)

    def _lookup_plan(self, req: _Request, computed: int, boundary: int) -> LookupPlan:
        groups = []
        for spec, gs in zip(self.layout.groups, req.groups):
            first, end = self._hit_chunks(spec, computed, boundary)
            groups.append(GroupLookup(spec.index, first, end, tuple(gs.keys[first:end])))
        return LookupPlan(computed, boundary, boundary - computed, tuple(groups))

    @staticmethod
    def _hit_chunks(spec: GroupSpec, computed: int, boundary: int) -> tuple[int, int]:
        tpc = spec.tokens_per_chunk
        end = boundary // tpc
        wc = spec.window_chunks
        first = computed // tpc
        return (first if wc is None else max(first, end - wc)), end

    # -------------------------------------------------------------- load

    def plan_load(self, req_id: str, *, num_computed_tokens: int, num_external_tokens: int) -> LoadPlan:
        """Plan the load of an accepted hit into the request's allocated blocks.

        Call after the engine appended block ids covering the boundary. Loaded
        chunks count as present (they are not stored again) and become the
        group's hits.

        Args:
            req_id: The request.
            num_computed_tokens: Local prefix in tokens (whole GPU blocks).
            num_external_tokens: The accepted hit from :meth:`plan_lookup`.
        """
        req = self._get(req_id)
        _check_count("num_computed_tokens", num_computed_tokens)
        _check_count("num_external_tokens", num_external_tokens)
        boundary = num_computed_tokens + num_external_tokens
        groups = []
        for spec, gs in zip(self.layout.groups, req.groups):
            if num_external_tokens == 0:
                groups.append(GroupLoadPlan(spec.index))
                continue
            self._check_load(spec, gs, num_computed_tokens, boundary)
            groups.append(self._plan_group_load(spec, gs, num_computed_tokens, boundary))
        return LoadPlan(req_id, num_computed_tokens, boundary, tuple(groups))

    @staticmethod
    def _check_load(spec: GroupSpec, gs: _GroupState, computed: int, boundary: int) -> None:
        name = f"group {spec.index}"
        if computed % spec.tokens_per_block:
            raise ValueError(
                f"{name}: num_computed_tokens={computed} is not whole GPU blocks of {spec.tokens_per_block} tokens"
            )
        if boundary % spec.tokens_per_chunk:
            raise ValueError(
                f"{name}: hit boundary {boundary} is not whole chunks of "
                f"{spec.tokens_per_chunk} tokens; use plan_lookup's answer"
            )
        if boundary // spec.tokens_per_chunk > len(gs.keys):
            raise ValueError(f"{name}: no keys up to token {boundary}")
        if len(gs.block_ids) < boundary // spec.tokens_per_block:
            raise ValueError(f"{name}: blocks not allocated up to token {boundary}")

    def _plan_group_load(self, spec: GroupSpec, gs: _GroupState, computed: int, boundary: int) -> GroupLoadPlan:
        bpc = spec.blocks_per_chunk
        first_chunk, end_chunk = self._hit_chunks(spec, computed, boundary)
        first_block = max(computed // spec.tokens_per_block, first_chunk * bpc)
        dst: list[int] = []
        positions: list[int] = []
        for b in range(first_block, end_chunk * bpc):
            if gs.block_ids[b] != NULL_BLOCK:
                dst.append(gs.block_ids[b])
                positions.append(b)
        chunks = sorted({p // bpc for p in positions})
        gs.ledger.mark_done_range(first_chunk, end_chunk)
        gs.hits = end_chunk
        return GroupLoadPlan(
            group=spec.index,
            keys=tuple(gs.keys[k] for k in chunks),
            chunk_indices=tuple(chunks),
            dst_block_ids=tuple(dst),
            block_positions=tuple(positions),
            start_offset=positions[0] - chunks[0] * bpc if positions else 0,
        )

    # --------------------------------------------------------- accessors

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def cursor(self, req_id: str, group_pos: int) -> int:
        """The store cursor: every chunk below it is stored, present or never storable."""
        return self._get(req_id).groups[group_pos].ledger.cursor

    def offload_keys(self, req_id: str, group_pos: int) -> tuple[bytes, ...]:
        """The group's chunk keys known so far (a copy)."""
        return tuple(self._get(req_id).groups[group_pos].keys)

    def progress(self, req_id: str) -> tuple[GroupProgress, ...]:
        """A per-group snapshot of the request's bookkeeping."""
        return tuple(
            GroupProgress(spec.index, len(gs.keys), len(gs.block_ids), gs.ledger.cursor, gs.ledger.num_waiting, gs.hits)
            for spec, gs in zip(self.layout.groups, self._get(req_id).groups)
        )

    # ----------------------------------------------------------- helpers

    def _get(self, req_id: str) -> _Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def _append_hashes(self, req: _Request, block_hashes: Sequence[bytes]) -> None:
        for h in block_hashes:
            if not isinstance(h, bytes):
                raise TypeError(f"block hashes must be bytes, got {type(h).__name__}")
        req.hashes.extend(block_hashes)
        req.num_tokens = max(req.num_tokens, len(req.hashes) * self.layout.tokens_per_hash)
        n = len(req.hashes)
        for spec, gs, hpc in zip(self.layout.groups, req.groups, self._hpc):
            k = len(gs.keys)
            while (k + 1) * hpc <= n:
                gs.keys.append(_chunk_key(req.hashes[(k + 1) * hpc - 1], spec.index))
                k += 1


class _Probe:
    """Memoizes ``is_stored`` so a lookup asks about each key at most once."""

    __slots__ = ("_ask", "_seen")

    def __init__(self, is_stored: Callable[[bytes], bool] | Container[bytes]) -> None:
        self._ask: Callable[[bytes], bool] = is_stored if callable(is_stored) else is_stored.__contains__
        self._seen: dict[bytes, bool] = {}

    def __call__(self, key: bytes) -> bool:
        hit = self._seen.get(key)
        if hit is None:
            hit = self._seen[key] = bool(self._ask(key))
        return hit

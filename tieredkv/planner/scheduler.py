"""The library's planner: :class:`OffloadScheduler`, per request and KV group, over the shared core.

Pure bookkeeping: no vLLM import, no I/O. The engine (the demo, ``store.planner()``, or any
engine of its own) tells the scheduler about a request's block hashes and GPU block ids; the
scheduler answers with plans, and the engine reports back what the store side did with them.
Its rules are the planner core's (:mod:`tieredkv.planner.store`, :mod:`tieredkv.planner.lookup`,
:mod:`tieredkv.planner.load`), the ones the vLLM connector ``TieredKVConnector`` plans with.

A request's life:

- :meth:`~OffloadScheduler.add_request`, :meth:`~OffloadScheduler.update_request`
  (append hashes / block ids), :meth:`~OffloadScheduler.release_blocks`;
- :meth:`~OffloadScheduler.plan_lookup` -> :class:`~tieredkv.planner.plans.LookupPlan` (longest
  hit that is whole chunks in every group), :meth:`~OffloadScheduler.plan_load` ->
  :class:`~tieredkv.planner.plans.LoadPlan` (keys and destination blocks of an accepted hit);
- :meth:`~OffloadScheduler.plan_store` -> :class:`~tieredkv.planner.plans.StorePlan` (whole
  chunks only), :meth:`~OffloadScheduler.complete_store` with a
  :class:`~tieredkv.planner.plans.StoreOutcome`;
- :meth:`~OffloadScheduler.preempt`, :meth:`~OffloadScheduler.finish_request` (first final plan;
  also for aborts), :meth:`~OffloadScheduler.plan_finished` (the next final plans, see below),
  :meth:`~OffloadScheduler.remove_request`, :meth:`~OffloadScheduler.reset`.

Rules (the core's, see :mod:`tieredkv.planner.store` and :mod:`tieredkv.planner.lookup`): a chunk
is planned for store only when its key exists and every one of its GPU blocks is non-null; a
group's cursor passes a chunk only when the store accepted it, already had it, or it can never
become whole (a null block, out of the group's window for good or the request over), so a
refused chunk is offered again, never skipped; a lookup answers 0 or a boundary that is whole
chunks in every group and backed by stored chunks (the last known token is recomputed), and its
misses are fed back (an evicted chunk -- in a full-attention group with every later one -- is
storable again).

Bounded plans. A store plan visits (so offers) at most ``max_chunks_per_plan`` chunks of a
request (default 256; None: no bound), the oldest waiting (refused) chunks of each group first;
a run of chunks that can never be stored (null blocks out of the window, e.g. before a loaded
hit) is passed without counting. The bound is water-filled over the groups (a group gets at most
what it can use, a remainder goes one chunk each from a group that rotates every plan), halved
after a plan refused whole (down to 1) and doubled back after progress, so an all-or-nothing
store with room for fewer chunks than the backlog drains it. A bound below the chunks a step
makes delays stores; in a sliding-window group a chunk that leaves the window before it is
offered is lost, so size the bound above a step's chunks.

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

from collections.abc import Callable, Container, Iterable, Sequence

from tieredkv.groups import GroupKind, GroupLayout, GroupSpec
from tieredkv.keys import group_suffix
from tieredkv.planner.ledger import RequestStore
from tieredkv.planner.load import check_load, plan_group_load
from tieredkv.planner.lookup import plan_lookup
from tieredkv.planner.plans import (
    GroupLoadPlan,
    GroupProgress,
    GroupStorePlan,
    LoadPlan,
    LookupPlan,
    StoreOutcome,
    StorePlan,
)
from tieredkv.planner.store import DEFAULT_MAX_CHUNKS_PER_PLAN, NULL_BLOCK, GroupFacts, StorePlanner

__all__ = ["OffloadScheduler"]


class _GroupState:
    """Per request, per group: keys, block ids and the group's hits (its ledger is in the
    request's :class:`~tieredkv.planner.ledger.RequestStore`)."""

    __slots__ = ("block_ids", "hits", "keys")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.block_ids: list[int] = []
        self.hits = 0


class _Request:
    __slots__ = (
        "finished",
        "frontier",
        "groups",
        "hashes",
        "max_offload_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "req_id",
        "store",
    )

    def __init__(
        self, req_id: str, num_prompt_tokens: int, max_offload_tokens: int | None, store: RequestStore
    ) -> None:
        self.req_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.max_offload_tokens = max_offload_tokens
        self.hashes: list[bytes] = []
        self.groups = tuple(_GroupState() for _ in store.ledgers)
        self.store = store  # ledgers, latest plan, budget
        self.finished = False
        self.frontier = 0  # a finished request's final frontier


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: expected a non-negative integer")


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
        self._suffixes = tuple(group_suffix(g.index) for g in layout.groups)  # what make_chunk_key appends
        # per group: tokens and blocks per chunk, reach (tokens), not full attention, index
        self._geometry = tuple(
            (g.tokens_per_chunk, g.blocks_per_chunk, g.reach_tokens, g.kind is not GroupKind.FULL, g.index)
            for g in layout.groups
        )
        self._reqs: dict[str, _Request] = {}
        #: The store-planning rules, shared with the vLLM connector (whole chunks, water-filled
        #: budget that halves after a plan refused whole).
        self.store_planner = StorePlanner(max_chunks=max_chunks_per_plan, shared=True, adaptive=True)

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
        req = _Request(req_id, num_prompt_tokens, max_offload_tokens, self.store_planner.new_request(len(self.layout)))
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
        req = self._get(req_id)
        for gs in req.groups:
            gs.block_ids.clear()
        req.store.resume()

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
            led.cursor < self._limit(spec, gs, offloadable)
            for spec, gs, led in zip(self.layout.groups, req.groups, req.store.ledgers)
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
            req.store.reset(self.max_chunks_per_plan)

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

        Accepted, present and declined chunks are done; refused (or unmentioned) ones
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
        self.store_planner.settle(req.store, outcome.accepted | outcome.present | outcome.declined, req.finished)
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
        facts = []
        new_facts = tuple.__new__  # GroupFacts(...) without its Python-level __new__
        for (tpc, bpc, reach, windowed, _), gs in zip(self._geometry, req.groups):
            limit = min(offloadable // tpc, len(gs.block_ids) // bpc, len(gs.keys))
            if final:
                final_below = limit  # the request is over: a chunk not whole now never will be
            elif reach is None:
                final_below = 0
            else:  # chunk k left the window for good once (k + 1) * tpc + reach <= frontier
                final_below = max(0, (frontier - reach) // tpc)
            facts.append(
                new_facts(GroupFacts, (gs.keys, gs.block_ids, bpc, limit, final_below, None, final or windowed))
            )
        offers = self.store_planner.plan(req.store, facts)
        plans = []
        for geo, chunks in zip(self._geometry, offers):
            plans.append(GroupStorePlan(geo[4], tuple(chunks)))
        return StorePlan(req.req_id, offloadable, tuple(plans))

    @staticmethod
    def _limit(spec: GroupSpec, gs: _GroupState, offloadable: int) -> int:
        """Chunks of the group that are offloadable, allocated and keyed."""
        return min(offloadable // spec.tokens_per_chunk, len(gs.block_ids) // spec.blocks_per_chunk, len(gs.keys))

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
        return plan_lookup(
            self.layout,
            [(gs.keys, led) for gs, led in zip(req.groups, req.store.ledgers)],
            num_tokens=req.num_tokens,
            num_computed_tokens=num_computed_tokens,
            is_stored=is_stored,
            max_load_tokens=max_load_tokens,
        )

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
        for spec, gs, led in zip(self.layout.groups, req.groups, req.store.ledgers):
            if num_external_tokens == 0:
                groups.append(GroupLoadPlan(spec.index))
                continue
            check_load(spec, len(gs.keys), len(gs.block_ids), num_computed_tokens, boundary)
            plan, gs.hits = plan_group_load(spec, gs.keys, gs.block_ids, led, num_computed_tokens, boundary)
            groups.append(plan)
        return LoadPlan(req_id, num_computed_tokens, boundary, tuple(groups))

    # --------------------------------------------------------- accessors

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def cursor(self, req_id: str, group_pos: int) -> int:
        """The store cursor: every chunk below it is stored, present or never storable."""
        return self._get(req_id).store.ledgers[group_pos].cursor

    def offload_keys(self, req_id: str, group_pos: int) -> tuple[bytes, ...]:
        """The group's chunk keys known so far (a copy)."""
        return tuple(self._get(req_id).groups[group_pos].keys)

    def progress(self, req_id: str) -> tuple[GroupProgress, ...]:
        """A per-group snapshot of the request's bookkeeping."""
        req = self._get(req_id)
        return tuple(
            GroupProgress(spec.index, len(gs.keys), len(gs.block_ids), led.cursor, led.num_waiting, gs.hits)
            for spec, gs, led in zip(self.layout.groups, req.groups, req.store.ledgers)
        )

    # ----------------------------------------------------------- helpers

    def _get(self, req_id: str) -> _Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def _append_hashes(self, req: _Request, block_hashes: Sequence[bytes]) -> None:
        if len(block_hashes) == 0:
            return  # no new hash: no new key, and the token count already covers the hashes
        for h in block_hashes:
            if not isinstance(h, bytes):
                raise TypeError(f"block hashes must be bytes, got {type(h).__name__}")
        req.hashes.extend(block_hashes)
        req.num_tokens = max(req.num_tokens, len(req.hashes) * self.layout.tokens_per_hash)
        hashes = req.hashes
        n = len(hashes)
        for suffix, gs, hpc in zip(self._suffixes, req.groups, self._hpc):
            keys = gs.keys
            k = len(keys)
            while (k + 1) * hpc <= n:  # make_chunk_key: hash + group index, 4 bytes big-endian
                keys.append(hashes[(k + 1) * hpc - 1] + suffix)
                k += 1

"""Transfer strategies: how a job's chunks move between engine blocks and the tiers.

Three strategies, chosen per job (never by a tier's class: by ``tier.capabilities.slots`` and
by where the tensors live):

* **slots** — the route's first tier offers slots of its own memory
  (:attr:`TierCapabilities.slots <tieredkv.backends.base.TierCapabilities.slots>`, the CPU
  slab): a store gathers device blocks straight into reserved slots and publishes them (one
  copy); a load scatters hits straight from borrowed slots. Host copies here are deferred to
  the C helper's mover thread (:meth:`Copier.wait <tieredkv.staging.Copier.wait>`), so the loop
  runs the next jobs' bookkeeping while they move; a job that ends early settles them first.
* **direct** — the device bytes already are the payload (one CPU tensor, consecutive blocks):
  tiers read and write them with no staging copy (:meth:`GroupBinding.direct_views`).
* **staged** — everything else: blocks are gathered into a staging buffer, written, and read
  back into it before the scatter. A job larger than the whole pool moves through its buffer
  in parts.

To add a strategy: give :class:`Transfers` a branch in :meth:`Transfers.store` /
:meth:`Transfers.load` keyed on a capability, and keep the tier side behind that capability.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from tieredkv.errors import TierFullError
from tieredkv.groups import GroupSpec
from tieredkv.pipeline.events import TierEvents
from tieredkv.pipeline.jobs import ChunkRef, LoadJob, StoreJob, parts
from tieredkv.pipeline.lanes import Lanes
from tieredkv.pipeline.writeback import WriteBack
from tieredkv.policy import GroupRoute
from tieredkv.staging import Copier, KVGroupTensors, StagingBuffer, settle

__all__ = ["GroupBinding", "SlotTier", "Transfers", "wait_event"]


class SlotTier(Protocol):
    """The slot API of a tier with ``capabilities.slots`` (loop thread only)."""

    name: str

    def reserve(self, items: list[tuple[bytes, int]], tenant: int = 0) -> list[Any]: ...
    def slot_view(self, slot: Any) -> Any: ...
    def span_view(self, slots: Sequence[Any]) -> Any: ...
    def slot_starts(self, slots: Sequence[Any]) -> list[int]: ...
    @property
    def slab(self) -> Any: ...
    def commit(self, items: list[tuple[bytes, Any]], *, count: bool = True) -> None: ...
    def abort(self, slots: list[Any]) -> None: ...
    def borrow(self, keys: list[bytes]) -> list[Any | None]: ...
    def give_back(self, keys: list[bytes], slots: list[Any] | None = None) -> None: ...


@dataclass(slots=True)
class GroupBinding:
    """A registered KV group on the pipeline: its :class:`~tieredkv.groups.GroupSpec`, the
    engine tensors it lives in, its route, and its null block (the id a load's chunk uses for a
    block not to copy, e.g. vLLM's block 0; None: none, every id is a block). A view: the spec
    is the group model."""

    spec: GroupSpec
    tensors: KVGroupTensors
    route: GroupRoute
    null_block: int | None = None

    @property
    def blocks_per_chunk(self) -> int:
        return self.spec.blocks_per_chunk

    @property
    def chunk_bytes(self) -> int:
        return self.tensors.chunk_bytes(self.spec.blocks_per_chunk)

    def direct_views(
        self, chunks: Sequence[ChunkRef], *, load: bool, skip: Container[int] = ()
    ) -> list[memoryview | None]:
        """Per chunk, the device bytes of the whole chunk when they already are its payload — one
        CPU tensor and the chunk's blocks consecutive (for a load, none of them the group's null
        block) —
        so tiers read and write them with no staging copy; else None (and for chunks in ``skip``)."""
        host = self.tensors.host_bytes
        if host is None:
            return [None] * len(chunks)
        bpc = self.spec.blocks_per_chunk
        bb = self.tensors.bytes_per_block
        null = self.null_block if load else None
        out: list[memoryview | None] = []
        for i, c in enumerate(chunks):  # once per chunk on the loop: C calls only
            ids = c.block_ids
            first = ids[0] if len(ids) == bpc else -1
            consecutive = first >= 0 and ids[-1] - first == bpc - 1  # and, past two, every step is 1:
            if null is not None and first <= null <= first + bpc - 1:
                consecutive = False  # the null block's position is not copied
            if consecutive and i not in skip and (bpc <= 2 or ids == tuple(range(first, first + bpc))):
                out.append(host[first * bb : (first + bpc) * bb])
            else:
                out.append(None)
        return out


class Transfers:
    """Moves engine-block jobs' bytes (loop thread)."""

    def __init__(self, copier: Copier, lanes: Lanes, writeback: WriteBack) -> None:
        self.copier = copier
        self.lanes = lanes
        self.writeback = writeback
        #: Where slots published are recorded (KV events), once asked for; None: nowhere.
        self.events: TierEvents | None = None
        #: Slot stores between their reserve and their commit or abort (their copies deferred,
        #: several can be): a reserve refused while some are (their reserved slots count against
        #: the room and the tenants' quotas) waits for one to end and tries again.
        self._slot_stores = 0
        #: Stores waiting for room, in arrival order, per (tier, tenant): a tenant's stores take
        #: their slots (and so their places in its eviction order) in the order they came, and
        #: one tenant's wait never holds up another's.
        self._lines: dict[tuple[str, int], collections.deque[asyncio.Future[None]]] = {}

    def _scatter(
        self, grp: GroupBinding, job: LoadJob, chunks: list[int], places: dict[int, Any], span: Any, *, defer: bool
    ) -> Any:
        """Scatter the payloads of ``chunks`` (of ``job``), back to back in ``span``, into their blocks."""
        bpc = grp.blocks_per_chunk
        if all(places[x] is None for x in chunks):  # whole chunks in order: their ids are the placements
            ids = list(itertools.chain.from_iterable(job.chunks[x].block_ids for x in chunks))
            return self.copier.scatter_blocks(grp.tensors, ids, span, bpc, defer=defer)
        merged = [
            (c * bpc + p, blk)
            for c, x in enumerate(chunks)
            for p, blk in (enumerate(job.chunks[x].block_ids) if places[x] is None else places[x])
        ]
        return self.copier.scatter(grp.tensors, merged, span, bpc, defer=defer)

    def _scatter_lent(
        self, tier: SlotTier, grp: GroupBinding, job: LoadJob, chunks: list[int], slots: list[Any]
    ) -> list[Any]:
        """The deferred moves of whole ``chunks`` (of ``job``, every block id copied) out of their
        borrowed ``slots`` into their blocks: one call wherever the slots lie (host tensors), else
        one per run of slots back to back."""
        bpc = grp.blocks_per_chunk
        ids = list(itertools.chain.from_iterable(job.chunks[x].block_ids for x in chunks))
        if self.copier.can_place(grp.tensors, tier.slab):
            return [self.copier.place(grp.tensors, ids, tier.slab, tier.slot_starts(slots), bpc, to_buf=False)]
        return [
            self.copier.scatter_blocks(grp.tensors, ids[a * bpc : b * bpc], span, bpc, defer=True)
            for a, b, span in _slot_runs(tier, slots)
        ]

    def slot_tier(self, tiers: Sequence[str]) -> SlotTier | None:
        """The route's first tier when it offers slots and its breaker lets work through."""
        lane = self.lanes[tiers[0]]
        if lane.tier.capabilities.slots and lane.breaker.allow():
            return cast(SlotTier, lane.tier)
        return None

    # ---- store ---------------------------------------------------------------------------------

    async def store(
        self, job: StoreJob, grp: GroupBinding, buf: StagingBuffer, ready: Any
    ) -> tuple[list[bytes], dict[str, int]]:
        """Store a job's chunks; keys held by at least one tier, and chunks written per tier."""
        write_tiers = (job.route or grp.route).write_tiers
        slots = self.slot_tier(write_tiers) if len(write_tiers) == 1 else None
        if slots is not None:
            return await self._store_into_slots(slots, job, grp, ready)
        return await self._store_staged(job, grp, buf, ready)

    async def _store_into_slots(
        self, tier: SlotTier, job: StoreJob, grp: GroupBinding, ready: Any
    ) -> tuple[list[bytes], dict[str, int]]:
        """Device blocks straight into the tier's slots (one copy), then publish them (as records
        of the job's tenant). Host copies are deferred (the C helper's mover thread runs them
        while the loop goes on with other jobs); the slots go back only once no copy can write
        them (:func:`~tieredkv.staging.settle`)."""
        keys = [c.key for c in job.chunks]
        cb = grp.chunk_bytes
        slots = await self._reserve(tier, [(k, cb) for k in keys], job.tenant)
        if slots is None:
            return [], {tier.name: 0}
        self._slot_stores += 1
        moves: list[Any] = []
        try:
            bpc = grp.blocks_per_chunk
            full = all(len(c.block_ids) == bpc for c in job.chunks)
            if full and self.copier.can_place(grp.tensors, tier.slab):  # one call, wherever the slots lie
                ids = _flat_ids(job.chunks, 0, len(slots))
                moves.append(self.copier.place(grp.tensors, ids, tier.slab, tier.slot_starts(slots), bpc, to_buf=True))
            else:  # a run of slots back to back per call (device tensors; a short chunk on its own)
                for a, b, span in _slot_runs(tier, slots, merge=full):
                    ids = _flat_ids(job.chunks, a, b)
                    after = ready if a == 0 else None
                    chunk_blocks = bpc if full else None
                    moves.append(
                        self.copier.gather(grp.tensors, ids, span, after, chunk_blocks=chunk_blocks, defer=True)
                    )
            await self.copier.wait(*moves)
        except BaseException:
            settle(moves)
            tier.abort(slots)
            raise
        else:
            tier.commit(list(zip(keys, slots)))
        finally:
            self._slot_store_ended()
        if self.events is not None:
            self.events.stored(tier.name, keys)
        self.writeback.mark_dirty(job.route or grp.route, keys, job.tenant)
        return keys, {tier.name: len(keys)}

    async def _store_staged(
        self, job: StoreJob, grp: GroupBinding, buf: StagingBuffer, ready: Any
    ) -> tuple[list[bytes], dict[str, int]]:
        cb = grp.chunk_bytes
        keys = [c.key for c in job.chunks]
        done: list[bytes] = []
        written: dict[str, int] = {}
        direct = grp.direct_views(job.chunks, load=False)
        copied = not all(direct)  # else every chunk is written straight from its blocks
        bpc = grp.blocks_per_chunk
        for part in parts(len(job.chunks), buf.nbytes // cb):  # one part unless the job is larger than the pool
            ev = None
            views = [] if copied else direct[part.start : part.stop]
            run = -1  # where the current run of chunks to gather starts in the part (-1: none)
            for j, i in enumerate(part if copied else ()):
                view = direct[i]
                if view is None:
                    if len(job.chunks[i].block_ids) != bpc:  # a short chunk: a gather of its own
                        ev = self.copier.gather(grp.tensors, job.chunks[i].block_ids, buf.view(j * cb, cb), after=ready)
                    elif run < 0:
                        run = j
                    view = buf.mview(j * cb, cb)
                views.append(view)
                # a run of whole chunks to gather ends here: one call moves all of its blocks
                if run >= 0 and (
                    j + 1 == len(part) or direct[part[j + 1]] is not None or _short(job, part[j + 1], bpc)
                ):
                    ids = _flat_ids(job.chunks, part[run], i + 1)
                    ev = self.copier.gather(
                        grp.tensors, ids, buf.view(run * cb, (j + 1 - run) * cb), ready, chunk_blocks=bpc
                    )
                    run = -1
            await wait_event(ev)
            part_keys = keys if len(part) == len(keys) else [keys[i] for i in part]
            got, w = await self.writeback.write(job.route or grp.route, part_keys, views, job.tenant)
            done += got  # the writes are over: the buffer is free for the next part
            for name, n in w.items():
                written[name] = written.get(name, 0) + n
        return done, written

    async def _reserve(self, tier: SlotTier, items: list[tuple[bytes, int]], tenant: int) -> list[Any] | None:
        """Slots for ``items``, or None when the tier refuses them with no slot store in flight
        (no room will come back). A refusal while some are in flight waits in the (tier,
        tenant) line: its first store tries again each time a slot store ends, and a store that
        finds anyone of its line waiting queues behind them rather than overtaking them. A
        tenant's later store taking room first would commit first and outlive an earlier one in
        the tenant's eviction order."""
        key = (tier.name, tenant)
        line = self._lines.get(key)
        if line is None:  # nobody of this tenant waits for room in this tier: try now
            try:
                return tier.reserve(items, tenant)
            except TierFullError:
                if not self._slot_stores:  # refused with nothing in flight: for good
                    return None
            line = self._lines[key] = collections.deque()
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        line.append(turn)
        try:
            while True:
                await turn  # set once this store is first in line and a slot store has ended
                try:
                    return tier.reserve(items, tenant)
                except TierFullError:
                    if not self._slot_stores:
                        return None
                turn = line[0] = loop.create_future()  # still first: wait for the next to end
        finally:
            first = line[0] is turn
            line.remove(turn)
            if not line:
                del self._lines[key]
            elif first and not line[0].done():  # the next tries at once: the room left may fit it
                line[0].set_result(None)

    def _slot_store_ended(self) -> None:
        self._slot_stores -= 1
        for line in self._lines.values():  # the first of each line tries again
            if not line[0].done():
                line[0].set_result(None)

    # ---- load ----------------------------------------------------------------------------------

    async def load(self, job: LoadJob, grp: GroupBinding, buf: StagingBuffer, found_in: dict[int, str]) -> None:
        """Load a job's chunks into their blocks, filling ``found_in`` (``{chunk index: tier}``)
        as they are found; a chunk missing everywhere stops the copies (the job fails) but the
        reads go on, to report every missing chunk."""
        cb = grp.chunk_bytes
        keys = [c.key for c in job.chunks]
        route = job.route or grp.route
        slots = self.slot_tier(route.tiers) if route.tiers else None
        borrowed: dict[int, Any] = {}
        moves: list[Any] = []  # copies out of borrowed slots (deferred): over before they go back
        bpc, null = grp.blocks_per_chunk, grp.null_block
        try:
            if slots is not None:  # hits in the slot tier are copied straight from their slots
                for i, slot in enumerate(slots.borrow(keys)):
                    if slot is not None:
                        borrowed[i] = slot
                        found_in[i] = slots.name
                if len(borrowed) == len(keys) and all(_placements(job, i, bpc, null) is None for i in borrowed):
                    # every chunk a hit in the slot tier (a warm prefix): copied straight from the
                    # slots, a run of them per call; nothing read, staged or promoted
                    moves += self._scatter_lent(slots, grp, job, list(range(len(keys))), list(borrowed.values()))
                    await self.copier.wait(*moves)
                    return
            direct = grp.direct_views(job.chunks, load=True, skip=borrowed)
            # where each chunk's blocks go, for those copied (not read straight into their blocks)
            copied = not all(direct) or bool(borrowed)  # else every chunk is read straight into its blocks
            # per chunk copied (not read straight into its blocks): None when its block ids are a
            # whole chunk's in order (moved with other such chunks in one call), else its placements
            places = (
                {i: _placements(job, i, bpc, null) for i, view in enumerate(direct) if view is None} if copied else {}
            )
            lower = route.tiers[1:] if slots is not None else route.tiers
            complete = True  # every chunk so far was found: keep copying
            for part in parts(len(keys), buf.nbytes // cb):  # one part unless the job is larger than the pool
                part_keys = keys if len(part) == len(keys) else [keys[i] for i in part]
                views: list[memoryview | None] = (  # where each chunk's bytes land (None: in a slot)
                    [
                        None if i in borrowed else buf.mview(j * cb, cb) if direct[i] is None else direct[i]
                        for j, i in enumerate(part)
                    ]
                    if copied
                    else direct[part.start : part.stop]
                )
                rest = [j for j, i in enumerate(part) if i not in found_in] if found_in else None  # None: all of them
                if rest is None or rest:
                    got = await self.lanes.read_items(lower, part_keys, views, cb, rest)
                    found_in.update({part[j]: name for j, name in got.items()} if part.start else got)
                    complete = complete and len(got) == (len(part) if rest is None else len(rest))
                if not complete:
                    continue
                ev = None
                lent: list[int] = []  # a run of consecutive borrowed chunks, copied together
                run = -1  # where the current run of whole chunks read into the buffer starts (-1: none)
                for j, i in enumerate(part if copied else ()):
                    if i in borrowed:
                        lent.append(i)
                        if j + 1 < len(part) and part[j + 1] in borrowed:
                            continue
                        lent_slots = [borrowed[x] for x in lent]
                        if all(places[x] is None for x in lent):  # whole chunks: wherever their slots lie
                            moves += self._scatter_lent(cast(SlotTier, slots), grp, job, lent, lent_slots)
                        else:
                            for a, b, span in _slot_runs(cast(SlotTier, slots), lent_slots):
                                moves.append(self._scatter(grp, job, lent[a:b], places, span, defer=True))
                        lent = []
                    elif direct[i] is None:
                        own = places[i]
                        if own is not None:  # not a whole chunk in order: on its own
                            ev = self.copier.scatter(grp.tensors, own, buf.view(j * cb, cb), bpc)
                            continue
                        run = j if run < 0 else run
                        nxt = part[j + 1] if j + 1 < len(part) else -1
                        if nxt < 0 or nxt in borrowed or direct[nxt] is not None or places[nxt] is not None:
                            ids = _flat_ids(job.chunks, part[run], i + 1)
                            ev = self.copier.scatter_blocks(
                                grp.tensors, ids, buf.view(run * cb, (j + 1 - run) * cb), bpc
                            )
                            run = -1
                await wait_event(ev)
                await self.copier.wait(*moves)
                first = route.tiers[0]
                if route.promote and len(route.tiers) > 1 and any(found_in[i] != first for i in part):
                    await self.writeback.promote(
                        route,
                        part_keys,
                        [None if v is None or found_in[i] == first else v for v, i in zip(views, part)],
                        {j: found_in[i] for j, i in enumerate(part)},
                        job.tenant,
                    )
        finally:
            if borrowed:
                settle(moves)  # a job that ends early: no copy reads a slot once it is given back
                cast(SlotTier, slots).give_back([keys[i] for i in borrowed], list(borrowed.values()))


def _slot_runs(tier: SlotTier, slots: Sequence[Any], *, merge: bool = True) -> list[tuple[int, int, Any]]:
    """``(start, stop, view)``: runs of a job's chunks whose slots lie back to back, with one view
    over each run's slots (their payloads back to back), so a run moves in one call; without
    ``merge``, one run per chunk."""
    n = len(slots)
    if not merge:
        return [(i, i + 1, tier.slot_view(slots[i])) for i in range(n)]
    whole = tier.span_view(slots)
    if whole is not None:
        return [(0, n, whole)]
    runs: list[tuple[int, int, Any]] = []
    a = 0
    for i in range(1, n + 1):
        if i == n or tier.span_view(slots[i - 1 : i + 1]) is None:
            runs.append((a, i, tier.span_view(slots[a:i])))
            a = i
    return runs


def _flat_ids(chunks: Sequence[ChunkRef], a: int, b: int) -> list[int]:
    """The block ids of chunks ``a .. b-1``, one after another."""
    if b - a == 1:
        return list(chunks[a].block_ids)
    return list(itertools.chain.from_iterable(c.block_ids for c in chunks[a:b]))


def _short(job: StoreJob, i: int, bpc: int) -> bool:
    return len(job.chunks[i].block_ids) != bpc


def _placements(job: LoadJob, i: int, bpc: int, null: int | None) -> list[tuple[int, int]] | None:
    """None when chunk ``i``'s block ids are a whole chunk's, every one copied (the common case,
    once per chunk: C calls only), else :meth:`LoadJob.placements`."""
    ids = job.chunks[i].block_ids
    if len(ids) == bpc and (null is None or null not in ids):
        return None
    return job.placements(i, bpc, null)


def tiers_read(found_in: dict[int, str]) -> dict[str, int]:
    """Chunks read per tier."""
    return dict(collections.Counter(found_in.values()))


async def wait_event(ev: Any) -> None:
    """Wait for a CUDA event without blocking the loop (None: nothing to wait for)."""
    if ev is None:
        return
    while not ev.query():
        await asyncio.sleep(0.0002)

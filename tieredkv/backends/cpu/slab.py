"""The CPU tier's slab: segments, size-classed slots, their allocation and eviction, and the
zero-extra-copy path of the pipeline (:class:`SlabTier`, the base of
:class:`~tieredkv.backends.cpu.CPUTier`).

The slab (one ``uint8`` tensor, see :mod:`tieredkv.backends.cpu.tier`) is cut into segments of
``segment_bytes``; a segment is carved on demand into equal slots of one size class
(``min_slot_bytes`` doubling up to ``segment_bytes``). A record (64-byte header + payload) goes
to the smallest class that holds it.

Allocation order for a record of class *c*: a free slot of *c*; a free segment carved for
*c*; the first unpinned victim of *c*'s eviction policy (one
:class:`~tieredkv.eviction.EvictionPolicy` per slot class, named by ``eviction_policy``;
``lru``: the least recently used); a whole segment of another class whose records are all
unpinned (they are evicted). Otherwise the batch fails with
:class:`~tieredkv.errors.TierFullError` and nothing of it is stored.

An overwrite writes a new slot and switches the index afterwards (copy-on-write), so a
slot being written is never readable, and a published slot's bytes never change.

Slot lifetime has one owner, :meth:`SlabTier._release`: a slot lent to a reader by
:meth:`SlabTier.borrow` (the pipeline copies straight from it) carries a reference count,
and a slot that loses its key while lent (an overwrite, a promotion into this tier, a
corrupt record dropped) is not freed but parked until the last reader gives it back; its
segment is not reclaimed meanwhile. So a lent slot's bytes never change under the reader.

A tenant's records (ids other than 0) are also counted and ordered per tenant
(:mod:`tieredkv.backends.cpu.tenants`); a tenant's batch first evicts that tenant's own records
to fit its quota (:meth:`SlabTier._make_room`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from tieredkv.backends.base import EvictListener
from tieredkv.backends.cpu.tenants import TenantBooks
from tieredkv.errors import ConfigError, CorruptRecordError, TierClosedError, TierFullError
from tieredkv.eviction import EvictionPolicy
from tieredkv.format import verify_parts

__all__ = ["SlabTier"]


@dataclass(slots=True)
class _Slot:
    offset: int
    cls: int
    seg: int
    length: int  # payload bytes
    header: bytes  # the record header; b"": not sealed yet (written in this process, see _seal)
    stamp: float
    checked: bool = True  # False: bytes came from outside the process, verify before serving
    refs: int = 0  # readers holding this slot (borrow .. give_back)
    dead: bool = False  # dropped from the index while lent: freed by the last give_back
    tenant: int = 0  # the record's tenant id (tieredkv.keys.tenant_id; 0: the default tenant)


class SlabTier(TenantBooks):
    """Slots of the slab: reserve / commit / abort, borrow / give back, allocation, eviction (see
    the module docstring). Abstract: the base of :class:`~tieredkv.backends.cpu.CPUTier`, which
    implements the tier's hooks. All of it runs on the tier's event loop thread."""

    # Set (and described) in CPUTier.__init__ and CPUTier._open.
    _slab: Any
    _mv: memoryview | None
    _evict_listener: EvictListener | None
    _free_segs: list[int]
    _seg_cls: dict[int, int]
    _seg_keys: dict[int, set[bytes]]
    _free: list[list[int]]
    _policies: list[EvictionPolicy]
    _index: dict[bytes, _Slot]
    _used: int
    _seg_reserved: dict[int, int]
    _seg_lent: dict[int, int]
    _lent: dict[bytes, list[_Slot]]
    _parked: int

    # ---- zero-extra-copy path for the pipeline (loop thread only) -------------------------
    #
    # A store reserves slots, lets the device copy land in them, then commits (no checksum: the
    # header is sealed when the record leaves the process); a load borrows slot views (pinned)
    # and copies from them straight to the device. Each saves one memcpy through a staging
    # buffer.

    def reserve(self, items: list[tuple[bytes, int]], tenant: int | Sequence[int] = 0) -> list[_Slot]:
        """Allocate a slot per ``(key, nbytes)``, all or nothing (TierFullError). Slots stay
        invisible to readers until :meth:`commit`. ``tenant``: the records' tenant id, or one per
        item (0: the default tenant); a tenant's own records make room for its quota first (see
        the module docstring)."""
        if self._mv is None:
            raise TierClosedError(f"tier {self.name!r} is not open")
        if tenant:
            return self._reserve_tenants(items, tenant)
        return self._take_slots(items, self._classes(items), None)

    def slot_view(self, slot: _Slot) -> Any:
        """``uint8`` tensor view of a reserved or borrowed slot's payload bytes."""
        return self._slab[slot.offset : slot.offset + slot.length]

    def span_view(self, slots: Sequence[_Slot]) -> Any:
        """One ``uint8`` view over ``slots`` when they lie back to back in the slab, each exactly
        its payload long (so the view is their payloads concatenated), else None. Lets the
        pipeline move a whole run of a job's chunks with one copy."""
        if not slots:
            return None
        first = slots[0]
        n = first.length
        off = first.offset
        for i, s in enumerate(slots):
            if s.offset != off + i * n or s.length != n:
                return None
        return self._slab[off : off + n * len(slots)]

    def slot_starts(self, slots: Sequence[_Slot]) -> list[int]:
        """Where each slot's payload starts in the slab (the :attr:`slab` tensor), in bytes: a
        job's slots wherever they lie move with one call (:meth:`Copier.place
        <tieredkv.staging.Copier.place>`)."""
        return [s.offset for s in slots]

    def commit(self, items: list[tuple[bytes, _Slot]], *, count: bool = True) -> None:
        """Publish reserved slots whose bytes are written (``count``: as puts, for callers
        outside :meth:`put_many`)."""
        assert self._mv is not None
        index, policies, seg_keys, sizes, seg_reserved = (
            self._index,
            self._policies,
            self._seg_keys,
            self._class_sizes,
            self._seg_reserved,
        )
        for key, slot in items:  # _unreserve + _install, inlined: this runs per chunk
            seg = slot.seg
            n = seg_reserved[seg] - 1
            if n > 0:
                seg_reserved[seg] = n
            else:
                del seg_reserved[seg]
            old = index.get(key)
            if old is not None:
                self._drop(key, old)
            index[key] = slot
            size = sizes[slot.cls]
            policies[slot.cls].insert(key, size)
            if slot.tenant:
                self._commit_tenant(key, slot, size)
            seg_keys[seg].add(key)
            self._used += size
        if count:
            self._count("puts", len(items))
            self._count("put_bytes", sum(s.length for _, s in items))

    def abort(self, slots: list[_Slot]) -> None:
        """Give back reserved slots that were never committed."""
        for slot in slots:
            self._unreserve(slot)
            if slot.tenant:
                size = self._class_sizes[slot.cls]
                self._charge(slot.tenant, -size)
                self._add(self._tresv, slot.tenant, -size)
            self._release(slot)

    def _unreserve(self, slot: _Slot) -> None:
        n = self._seg_reserved.get(slot.seg, 0) - 1
        if n > 0:
            self._seg_reserved[slot.seg] = n
        else:
            self._seg_reserved.pop(slot.seg, None)

    def borrow(self, keys: list[bytes]) -> list[_Slot | None]:
        """Verified slots of ``keys`` (None: a miss), lent until :meth:`give_back`: the key is
        pinned (not evicted or deleted) and the slot is never freed or reused meanwhile, even
        when the key is overwritten (the overwrite takes a new slot)."""
        mv = self._mv
        if mv is None:
            raise TierClosedError(f"tier {self.name!r} is not open")
        out: list[_Slot | None] = []
        now = time.time()
        for key in keys:
            slot = self._index.get(key)
            if slot is not None and not self._check(key, slot):
                slot = None
            if slot is None:
                out.append(None)
                continue
            slot.stamp = now
            self._policies[slot.cls].touch(key)
            if slot.tenant:
                self._tpol[slot.tenant][slot.cls].touch(key)
            slot.refs += 1
            self._seg_lent[slot.seg] = self._seg_lent.get(slot.seg, 0) + 1
            self._lent.setdefault(key, []).append(slot)
            out.append(slot)
        found = [k for k, s in zip(keys, out) if s is not None]
        self.pin_many(found)
        self._count("hits", len(found))
        self._count("misses", len(keys) - len(found))
        self._count("get_bytes", sum(s.length for s in out if s is not None))
        return out

    def give_back(self, keys: list[bytes], slots: list[_Slot] | None = None) -> None:
        """End borrows: unpin each key and return its slot (the one :meth:`borrow` lent; pass
        ``slots`` when one key may be borrowed more than once, else the latest lent is taken). A
        slot that lost its key meanwhile is freed by its last give-back."""
        returned: list[bytes] = []
        try:
            self._give_back(keys, slots, returned)
        finally:
            self.unpin_many(returned)  # one lock round for the batch

    def _give_back(self, keys: list[bytes], slots: list[_Slot] | None, returned: list[bytes]) -> None:
        for i, key in enumerate(keys):
            lent = self._lent.get(key)
            if not lent:
                continue
            slot = lent[-1] if slots is None else slots[i]
            for j in range(len(lent) - 1, -1, -1):
                if lent[j] is slot:
                    del lent[j]
                    break
            else:
                continue  # not lent under this key: nothing to return
            if not lent:
                del self._lent[key]
            returned.append(key)
            slot.refs -= 1
            n = self._seg_lent[slot.seg] - 1
            if n > 0:
                self._seg_lent[slot.seg] = n
            else:
                del self._seg_lent[slot.seg]
            if slot.refs == 0 and slot.dead:
                slot.dead = False
                self._parked -= 1
                self._release(slot)

    def _check(self, key: bytes, slot: _Slot) -> bool:
        """Whether ``slot`` may be served: bytes written in this process are; a record that came
        from outside is verified against its header once (corrupt: counted, dropped, False)."""
        if slot.checked:
            return True
        assert self._mv is not None
        try:
            verify_parts(slot.header, self._mv[slot.offset : slot.offset + slot.length], key)
        except CorruptRecordError as e:
            self._on_corrupt(key, e)
            self._drop(key, slot)
            return False
        slot.checked = True
        return True

    # ---- allocation --------------------------------------------------------------------

    def _class_for(self, length: int) -> int:
        for i, size in enumerate(self._class_sizes):
            if length <= size:
                return i
        raise ConfigError(
            f"tiers.{self.name}.segment_bytes: a chunk of {length} bytes does not fit a"
            f" {self._seg_bytes}-byte segment; raise segment_bytes to at least {length}"
        )

    def _classes(self, items: list[tuple[bytes, int]]) -> list[int]:
        """The slot class of each ``(key, nbytes)`` (one lookup per distinct size: a job's chunks share one)."""
        cls_of: dict[int, int] = {}
        out: list[int] = []
        for _, n in items:
            cls = cls_of.get(n)
            if cls is None:
                cls = cls_of[n] = self._class_for(n)
            out.append(cls)
        return out

    def _take_slots(
        self, items: list[tuple[bytes, int]], classes: list[int], tenants: Sequence[int] | None
    ) -> list[_Slot]:
        """A reserved slot per item (of class ``classes[i]``, for tenant ``tenants[i]``; None: the
        default tenant), all or nothing (TierFullError, every slot taken given back): a free slot
        of its class, else what :meth:`_allocate` finds. A full tier (no free slot of the class,
        no free segment, no tenant over its quota) evicts the room the rest of the batch needs in
        that class at once (:meth:`_evict_for`). Nothing is charged to a tenant here."""
        plan: list[_Slot] = []
        reserved: set[bytes] = set()
        segs: set[int] = set()
        now = time.time()
        seg_bytes, seg_reserved, free_lists = self._seg_bytes, self._seg_reserved, self._free
        try:
            for (key, n), cls, t in zip(items, classes, itertools.repeat(0) if tenants is None else tenants):
                free = free_lists[cls]
                if not free and not self._free_segs and not self._over:  # a full tier: room for the rest at once
                    self._evict_for(cls, classes[len(plan) :].count(cls), reserved)
                if free:  # the common case: a free slot of the class
                    off = free.pop()
                    seg = off // seg_bytes
                else:
                    off, seg = self._allocate(cls, reserved, segs)
                plan.append(_Slot(off, cls, seg, n, b"", now, True, 0, False, t))
                reserved.add(key)
                segs.add(seg)
                seg_reserved[seg] = seg_reserved.get(seg, 0) + 1
        except TierFullError:
            for slot in plan:
                self._unreserve(slot)
                self._release(slot)
            raise
        return plan

    def _allocate(self, cls: int, reserved: set[bytes], segs: set[int]) -> tuple[int, int]:
        free = self._free[cls]
        if not free and self._free_segs:
            self._carve(self._free_segs.pop(), cls)
        if not free and not self._evict_one(cls, reserved):
            self._reclaim_segment(cls, reserved, segs)
        if not free:
            raise TierFullError(
                f"tier {self.name!r}: no room for a {self._class_sizes[cls]}-byte slot;"
                " every record that could be evicted is pinned (in use)"
            )
        off = free.pop()
        return off, off // self._seg_bytes

    def _carve(self, seg: int, cls: int) -> None:
        size = self._class_sizes[cls]
        base = seg * self._seg_bytes
        self._seg_cls[seg] = cls
        self._seg_keys[seg] = set()
        self._free[cls].extend(range(base + (self._seg_bytes // size - 1) * size, base - 1, -size))

    def _evict_one(self, cls: int, reserved: set[bytes]) -> bool:
        """Evict the first record of class ``cls`` its policy offers that is neither pinned nor
        part of the batch being reserved (one of a tenant over its quota first)."""
        if self._over:
            for tenant in list(self._over):
                key = self._tenant_victim(tenant, reserved, cls)
                if key is not None:
                    self._evict_many([key])
                    self._count("tenant_evictions")
                    return True
        for key in self._policies[cls].victims():
            if key not in reserved and not self.is_pinned(key):
                self._evict_many([key])  # ends the iteration: the policy changes
                return True
        return False

    def _evict_for(self, cls: int, want: int, reserved: set[bytes]) -> None:
        """Evict up to ``want`` records of class ``cls`` in one walk of its policy, oldest first
        (neither pinned nor reserved by the batch): the slots a full tier's batch needs, found
        together rather than a walk per slot. Their slots go on the free list so that the
        oldest's is taken first, as :meth:`_evict_one` one at a time would hand them out."""
        victims: list[bytes] = []
        for key in self._policies[cls].victims():  # collected first: evicting changes the policy
            if key not in reserved and not self.is_pinned(key):
                victims.append(key)
                if len(victims) >= want:
                    break
        victims.reverse()
        self._evict_many(victims)

    def _reclaim_segment(self, cls: int, reserved: set[bytes], segs: set[int]) -> None:
        """Evict a whole segment of another class (all unpinned) and carve it for ``cls``."""
        best: int | None = None
        for seg, owner in self._seg_cls.items():
            if owner == cls or seg in segs or seg in self._seg_reserved or seg in self._seg_lent:
                continue  # slots handed out (reserved, not yet indexed; or lent to a reader)
            keys = self._seg_keys[seg]
            if any(k in reserved or self.is_pinned(k) for k in keys):
                continue
            if best is None or len(keys) < len(self._seg_keys[best]):
                best = seg
        if best is None:
            return
        self._evict_many(list(self._seg_keys[best]))
        owner = self._seg_cls.pop(best)
        del self._seg_keys[best]
        base = best * self._seg_bytes
        self._free[owner] = [o for o in self._free[owner] if not base <= o < base + self._seg_bytes]
        self._carve(best, cls)

    def _evict_many(self, keys: list[bytes]) -> None:
        """Evict ``keys`` (indexed, in this order; their slots go on the free lists in it): each
        passed to the evict listener first (corrupt ones are counted and dropped, not passed
        on), then dropped; counted, and told to the removal listener, once for the batch."""
        index, listener, mv = self._index, self._evict_listener, self._mv
        dropped: list[bytes] = []
        for key in keys:
            slot = index[key]
            if listener is not None and mv is not None:
                if not self._check(key, slot):
                    continue
                listener(key, mv[slot.offset : slot.offset + slot.length], slot.tenant)
            self._drop(key, slot)
            dropped.append(key)
        self._count("evictions", len(keys))
        if self._removal_listener is not None and dropped:
            self._removed(dropped)

    def _drop(self, key: bytes, slot: _Slot) -> None:
        del self._index[key]
        self._policies[slot.cls].remove(key)
        self._seg_keys[slot.seg].discard(key)
        self._used -= self._class_sizes[slot.cls]
        if slot.tenant:
            self._drop_tenant(key, slot)
        self._release(slot)

    def _release(self, slot: _Slot) -> None:
        """The one place a slot becomes free: at once, or (lent to a reader) at its last give-back."""
        if slot.refs > 0:
            if not slot.dead:
                slot.dead = True
                self._parked += 1
            return
        self._free[slot.cls].append(slot.offset)

    # ---- a tenant's room (ids other than 0; see tieredkv.backends.cpu.tenants) ---------------

    def _make_room(self, tenant: int, need: int, batch: Collection[bytes], classes: Sequence[int]) -> None:
        """Evict ``tenant``'s own records (of ``classes`` first, each class in its policy order;
        never pinned ones or those the ``batch`` overwrites, whose slots it frees itself) until
        it holds at most its quota less ``need`` bytes. TierFullError (counted), with nothing
        evicted, when they cannot make that room."""
        lim = self._limit(tenant)
        if lim is None:
            return
        excess = self._tbytes.get(tenant, 0) + need - lim
        if excess <= 0:
            return
        index, sizes = self._index, self._class_sizes
        for key in batch:  # an overwrite of its own record: the old slot goes at commit
            old = index.get(key)
            if old is not None and old.tenant == tenant:
                excess -= sizes[old.cls]
        if excess <= 0:
            return
        skip = batch
        pols = self._tpol.get(tenant) or {}
        victims: list[bytes] = []
        for cls in [c for c in classes if c in pols] + [c for c in pols if c not in classes]:
            size = self._class_sizes[cls]
            for key in pols[cls].victims():  # collected first: evicting changes the policy
                if key not in skip and not self.is_pinned(key):
                    victims.append(key)
                    excess -= size
                    if excess <= 0:
                        break
            if excess <= 0:
                break
        if excess > 0:
            raise self._refuse(
                tenant,
                f"a store of {need} bytes does not fit its quota of {lim} bytes: it holds"
                f" {self._tbytes.get(tenant, 0)} bytes, {excess} too many of them in records being read or"
                " written (pinned, reserved)",
            )
        # Newest victim first: its slot goes on the free list first and is taken last, so the batch
        # gets the freed slots in the order they lie in the slab (a job's chunks back to back: one
        # copy per run, as after the slab's own evictions). The listener (write-back) only queues:
        # the index holds them all still.
        victims.reverse()
        self._evict_many(victims)
        self._count("tenant_evictions", len(victims))

    def _reserve_tenants(self, items: list[tuple[bytes, int]], tenant: int | Sequence[int]) -> list[_Slot]:
        """:meth:`reserve` of records with tenants: each tenant's quota first (refused before
        anything is evicted when a tenant's part of the batch exceeds its whole quota; else its
        own records make room), then the slots, charged to their tenants."""
        tenants = [tenant] * len(items) if isinstance(tenant, int) else list(tenant)
        if len(tenants) != len(items):
            raise ValueError(f"reserve: {len(items)} items but {len(tenants)} tenants")
        sizes = self._class_sizes
        classes = self._classes(items)
        need: dict[int, int] = {}
        for cls, t in zip(classes, tenants):
            if t:
                need[t] = need.get(t, 0) + sizes[cls]
        for t, nbytes in need.items():
            lim = self._limit(t)
            if lim is not None and nbytes > lim:
                raise self._refuse(t, f"a store of {nbytes} bytes is larger than its whole quota ({lim} bytes)")
        batch = {k for k, _ in items}
        for t, nbytes in need.items():
            self._make_room(t, nbytes, batch, sorted(set(classes)))
        plan = self._take_slots(items, classes, tenants)
        for t, nbytes in need.items():  # charged once per tenant, when every slot is had
            self._charge(t, nbytes)
            self._add(self._tresv, t, nbytes)
        return plan

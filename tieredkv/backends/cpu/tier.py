"""CPUTier: one preallocated slab of host memory with size-classed slots, evicted by policy (LRU).

The slab is a single ``uint8`` torch tensor (pinned when CUDA is available, so H2D/D2H
copies can run asynchronously; plain otherwise — pinning needs an accelerator). Its segments,
slot classes, allocation, eviction and the pipeline's reserve / commit / borrow path are
:class:`~tieredkv.backends.cpu.slab.SlabTier` (:mod:`tieredkv.backends.cpu.slab`); each tenant's
bytes, quota and eviction orders are :class:`~tieredkv.backends.cpu.tenants.TenantBooks`
(:mod:`tieredkv.backends.cpu.tenants`). This module is the tier itself: config, lifecycle, the
:class:`~tieredkv.backends.base.Tier` hooks and raw records.

Checksums: the slab never leaves the process, so bytes written here (``put_many``, the
pipeline's ``reserve``/``commit``) are served without a checksum pass on either path. A record's
header (checksum included) is computed when the record leaves the process
(:meth:`raw_get_many`: migrate, ``tieredkv`` tools) and cached on the slot (its bytes never
change); eviction write-back hands the payload to the next tier, which seals its own record.
Records that came from outside (:meth:`raw_put_many`) carry their header and are verified on
first use — a corrupt one is a counted miss, deleted — and trusted after that.

All work runs synchronously on the caller's event loop (a 4 MiB copy takes well under a
millisecond; a thread hop would cost more). A tier instance belongs to one event loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Container, Sequence
from typing import Any

from tieredkv.backends.base import EvictListener, RawLimits, RecordInfo, TierCapabilities, TierStats
from tieredkv.backends.cpu.config import CPUTierConfig
from tieredkv.backends.cpu.slab import SlabTier, _Slot
from tieredkv.backends.cpu.tenants import header_tenant
from tieredkv.errors import ConfigError
from tieredkv.eviction import EvictionPolicy, make_policy
from tieredkv.format import HEADER_SIZE, make_header

__all__ = ["CPUTier"]


class CPUTier(SlabTier):
    """In-process slab tier. ``CPUTier(CPUTierConfig(capacity_bytes="8GiB"))``."""

    kind = "cpu"
    capabilities = TierCapabilities(
        in_process=True,
        slots=True,
        access_stamps=True,
        local_eviction=True,
        sync_probe=True,
        medium="host",
        tenants=True,
    )
    config_model = CPUTierConfig

    def __init__(self, config: CPUTierConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config or CPUTierConfig(), **kwargs)
        cfg: CPUTierConfig = self.config
        self._seg_bytes = int(cfg.segment_bytes)
        self._nseg = int(cfg.capacity_bytes) // self._seg_bytes
        sizes: list[int] = []
        s = int(cfg.min_slot_bytes)
        while s < self._seg_bytes:
            sizes += [s, s + s // 2] if s >= 2 else [s]
            s *= 2
        self._class_sizes = sorted({x for x in sizes if x < self._seg_bytes} | {self._seg_bytes})
        self._slab: Any = None
        self._mv: memoryview | None = None
        self._evict_listener: EvictListener | None = None
        self.pinned = False
        # Tenants (ids other than 0 only; see tieredkv.backends.cpu.tenants).
        self._tbytes: dict[int, int] = {}  # tenant -> slot bytes held, reserved slots included
        self._tresv: dict[int, int] = {}  # tenant -> bytes of its slots reserved, not yet committed
        self._tpol: dict[int, dict[int, EvictionPolicy]] = {}  # tenant -> slot class -> its records
        self._over: set[int] = set()  # tenants holding more than their quota
        self._limits: dict[int, int | None] = {}  # tenant -> its quota here (cache of quotas.limit)

    @classmethod
    def raw_limits(cls, config: Any, src: Any, dst: Any, *, workdir: str) -> RawLimits:
        """Host memory on the same bytes (:func:`~tieredkv.backends._rawbench.raw_host_memory`):
        one vectorized gather of scattered blocks, one ``copy_``, and a two-thread non-temporal
        copy. Both directions are one copy, so each is judged against the strongest of them."""
        from tieredkv.backends._rawbench import raw_host_memory

        figures = raw_host_memory(src, dst)
        limit = tuple(figures)
        return RawLimits(figures, {"store": limit, "load": limit})

    @classmethod
    def bench_writes_fresh_pages(cls, config: Any) -> bool:
        """A prefaulted slab takes stores into pages touched at open: no fresh page (and host
        memory, the raw limit, warms none either)."""
        return not config.prefault

    # ---- lifecycle -------------------------------------------------------------------

    async def _open(self) -> None:
        import torch

        mode = self.config.pin_memory
        cuda = torch.cuda.is_available()
        if mode == "always" and not cuda:
            raise ConfigError(
                f"tiers.{self.name}.pin_memory: got 'always' but CUDA is not available; use 'auto' or 'never'"
            )
        self.pinned = cuda and mode != "never"
        self._slab = torch.empty(self._nseg * self._seg_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        if self.config.prefault and not self.pinned:
            self._slab.zero_()  # fault pages in now, not on the first store (~10x slower then)
        self._mv = memoryview(self._slab.numpy())
        self._free_segs: list[int] = list(range(self._nseg - 1, -1, -1))
        self._seg_cls: dict[int, int] = {}
        self._seg_keys: dict[int, set[bytes]] = {}
        self._free: list[list[int]] = [[] for _ in self._class_sizes]
        policy = self.config.eviction_policy
        self._policies: list[EvictionPolicy] = [make_policy(policy) for _ in self._class_sizes]
        self._index: dict[bytes, _Slot] = {}
        self._used = 0
        self._seg_reserved: dict[int, int] = {}  # segment -> slots reserved, not yet committed
        self._seg_lent: dict[int, int] = {}  # segment -> references lent to readers (borrow)
        self._lent: dict[bytes, list[_Slot]] = {}  # key -> slots lent under it, oldest first
        self._parked = 0  # slots dropped while lent, freed when given back

    async def _close(self) -> None:
        self._mv = None
        self._slab = None
        self._index = {}
        self._lent = {}

    # ---- public extras -----------------------------------------------------------------

    def set_evict_listener(self, fn: EvictListener | None) -> None:
        """Call ``fn(key, payload, tenant)`` for every record evicted (not deleted), before its
        slot is reused — write-back demotes it to a lower tier, under its own tenant. ``payload``
        is a view of the slot, valid during the call only (copy what you keep). Corrupt records
        are not passed on."""
        self._evict_listener = fn

    @property
    def slab(self) -> Any:
        """The backing ``uint8`` tensor (for staging code that copies to/from device)."""
        return self._slab

    # ---- hooks -----------------------------------------------------------------------

    async def _put_many(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        mv = self._mv
        assert mv is not None
        slots = self.reserve([(key, len(payload)) for key, payload in items], tenants or 0)
        for (_, payload), slot in zip(items, slots):
            mv[slot.offset : slot.offset + slot.length] = payload
        self.commit([(key, slot) for (key, _), slot in zip(items, slots)], count=False)

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        mv = self._mv
        assert mv is not None
        out: list[int | bytes | None] = []
        now = time.time()
        for key, dst in zip(keys, into):
            slot = self._index.get(key)
            if slot is None or not self._check(key, slot):
                out.append(None)
                continue
            out.append(self._deliver(key, mv[slot.offset : slot.offset + slot.length], dst))
            slot.stamp = now
            self._policies[slot.cls].touch(key)
            if slot.tenant:
                self._tpol[slot.tenant][slot.cls].touch(key)
        return out

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        return [k in self._index for k in keys]

    def probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """From the in-process index (a dict membership test is atomic under the GIL)."""
        if self._closed or not self._opened:
            return None
        index = self._index
        return [k in index for k in keys]

    def probe_key(self, key: bytes) -> bool | None:
        if self._closed or not self._opened:
            return None
        return key in self._index

    def probe_members(self) -> Container[bytes] | None:
        return None if self._closed or not self._opened else self._index

    async def _delete_many(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            slot = self._index.get(k)
            if slot is not None:
                self._drop(k, slot)
                n += 1
        return n

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        # The loop thread owns the index and a published slot's bytes never change: no await
        # between the comparison and the drop.
        mv = self._mv
        assert mv is not None
        n = 0
        for k, raw in items:
            s = self._index.get(k)
            if s is not None and self._seal(k, s) + mv[s.offset : s.offset + s.length] == raw:
                self._drop(k, s)
                n += 1
        return n

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        for key, slot in list(self._index.items()):
            if fingerprint is None or key.startswith(fingerprint):
                yield RecordInfo(key, slot.length, slot.stamp)

    async def _stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity_bytes=self._nseg * self._seg_bytes,
            used_bytes=self._used,
            records=len(self._index),
            extra={
                "pinned_memory": self.pinned,
                "free_segments": len(self._free_segs),
                "segments": self._nseg,
                "slot_classes": {s: len(p) for s, p in zip(self._class_sizes, self._policies) if len(p)},
                "lent_slots": sum(len(v) for v in self._lent.values()),
                "parked_slots": self._parked,
                "tenants": len(self._tbytes),
                "tenants_over_quota": len(self._over),
            },
        )

    async def _tenant_usage(self) -> dict[int, int]:
        """Slot bytes of the committed records per tenant; the default tenant (0) is the rest."""
        resv = self._tresv
        usage = {t: n for t, b in self._tbytes.items() if (n := b - resv.get(t, 0))}
        return {0: self._used - sum(usage.values()), **usage}

    # ---- raw records ---------------------------------------------------------------------

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        mv = self._mv
        assert mv is not None
        out: list[bytes | None] = []
        for k in keys:
            s = self._index.get(k)
            out.append(None if s is None else self._seal(k, s) + mv[s.offset : s.offset + s.length])
        return out

    def _seal(self, key: bytes, slot: _Slot) -> bytes:
        """The slot's record header, computed (checksum over the slot's bytes) the first time the
        record leaves the process; a published slot's bytes never change, so it is cached."""
        if not slot.header:
            assert self._mv is not None
            slot.header = make_header(key, self._mv[slot.offset : slot.offset + slot.length], tenant=slot.tenant)
        return slot.header

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        mv = self._mv
        assert mv is not None
        for key, rec in items:
            n = max(len(rec) - HEADER_SIZE, 0)
            cls = self._class_for(n)
            tenant = header_tenant(rec)  # the header is verified on first use; until then, as it says
            if tenant:
                self._make_room(tenant, self._class_sizes[cls], {key}, (cls,))
            off, seg = self._allocate(cls, {key}, set())
            mv[off : off + n] = rec[HEADER_SIZE:]
            slot = _Slot(off, cls, seg, n, bytes(rec[:HEADER_SIZE]), time.time(), checked=False, tenant=tenant)
            if tenant:
                self._charge(tenant, self._class_sizes[cls])
            self._install(key, slot)

    def _install(self, key: bytes, slot: _Slot) -> None:
        """Publish a written slot under ``key``, freeing the slot it replaces (a tenant's slot is
        charged to it already)."""
        old = self._index.get(key)
        if old is not None:
            self._drop(key, old)
        self._index[key] = slot
        self._policies[slot.cls].insert(key, self._class_sizes[slot.cls])
        if slot.tenant:
            self._tenant_policy(slot.tenant, slot.cls).insert(key, self._class_sizes[slot.cls])
        self._seg_keys[slot.seg].add(key)
        self._used += self._class_sizes[slot.cls]

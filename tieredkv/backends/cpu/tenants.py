"""Tenants in the CPU tier (``capabilities.tenants``): :class:`TenantBooks`, the base of
:class:`~tieredkv.backends.cpu.CPUTier` that keeps each tenant's bytes and eviction orders.

Each slot knows its record's tenant id (``put_many(tenants=)``, ``reserve(tenant=)``, the header
of a raw record, :func:`header_tenant`), and the tier keeps each tenant's bytes (slot sizes, as
``used_bytes``; slots reserved and not yet committed count) and, per tenant and slot class, the
tenant's records in its eviction policy's order. Before a tenant's slots are allocated, that
tenant's own records are evicted (unpinned, least recently used first, the batch's slot class
first) until what it holds plus the batch fits its quota
(:meth:`~tieredkv.tenants.TenantQuotas.limit` of the slab's capacity); no other tenant loses a
record for that. A batch larger than a tenant's whole quota, or one that its unevictable records
leave no room for, is refused (:class:`~tieredkv.errors.TierFullError`, ``tenant_refusals``
counted) before anything is allocated. When the slab itself is full, a victim of a tenant over
its quota (a quota lowered, records that came raw) goes before the class's own order. The
default tenant (0) has no quota and none of this bookkeeping: without tenants the slab runs the
code it always ran.

The eviction that makes a tenant's room and the reservation of a tenant's slots are allocation:
:meth:`~tieredkv.backends.cpu.slab.SlabTier._make_room` and ``_reserve_tenants``.
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from tieredkv.backends.base import Tier
from tieredkv.errors import TierFullError
from tieredkv.eviction import EvictionPolicy, make_policy
from tieredkv.format import HEADER_SIZE, TENANT_AT, TENANT_VERSION
from tieredkv.tenants import TenantQuotas

if TYPE_CHECKING:
    from tieredkv.backends.cpu.slab import _Slot

__all__ = ["TenantBooks", "header_tenant"]


class TenantBooks(Tier):
    """Each tenant's bytes, quota and eviction orders in the slab (tenant ids other than 0; see
    the module docstring). Abstract: the base of :class:`~tieredkv.backends.cpu.CPUTier`."""

    # Set (and described) in CPUTier.__init__: the slab's geometry, then the tenants' books.
    _nseg: int
    _seg_bytes: int
    _class_sizes: list[int]
    _tbytes: dict[int, int]
    _tresv: dict[int, int]
    _tpol: dict[int, dict[int, EvictionPolicy]]
    _over: set[int]
    _limits: dict[int, int | None]

    def set_quotas(self, quotas: TenantQuotas) -> None:
        super().set_quotas(quotas)
        self._limits = {}
        self._over = {t for t, b in self._tbytes.items() if (lim := self._limit(t)) is not None and b > lim}

    def _limit(self, tenant: int) -> int | None:
        """Tenant ``tenant``'s quota in this slab (None: unbounded), cached per tenant."""
        limits = self._limits
        try:
            return limits[tenant]
        except KeyError:
            if len(limits) >= 1 << 16:
                limits.clear()
            lim = limits[tenant] = self.quotas.limit(tenant, self._nseg * self._seg_bytes)
            return lim

    @staticmethod
    def _add(counts: dict[int, int], tenant: int, delta: int) -> int:
        n = counts.get(tenant, 0) + delta
        if n:
            counts[tenant] = n
        else:
            counts.pop(tenant, None)
        return n

    def _charge(self, tenant: int, delta: int) -> None:
        """Move tenant ``tenant``'s bytes by ``delta`` (and whether it is over its quota)."""
        held = self._add(self._tbytes, tenant, delta)
        lim = self._limit(tenant)
        if lim is not None:
            if held > lim:
                self._over.add(tenant)
            else:
                self._over.discard(tenant)

    def _tenant_policy(self, tenant: int, cls: int) -> EvictionPolicy:
        pols = self._tpol.get(tenant)
        if pols is None:
            pols = self._tpol[tenant] = {}
        pol = pols.get(cls)
        if pol is None:
            pol = pols[cls] = make_policy(self.config.eviction_policy)
        return pol

    def _commit_tenant(self, key: bytes, slot: _Slot, size: int) -> None:
        """A reserved slot of a tenant published under ``key`` (charged when it was reserved)."""
        self._add(self._tresv, slot.tenant, -size)
        self._tenant_policy(slot.tenant, slot.cls).insert(key, size)

    def _drop_tenant(self, key: bytes, slot: _Slot) -> None:
        tenant, cls = slot.tenant, slot.cls
        self._charge(tenant, -self._class_sizes[cls])
        pols = self._tpol[tenant]
        pol = pols[cls]
        pol.remove(key)
        if not len(pol):
            del pols[cls]
            if not pols:
                del self._tpol[tenant]

    def _tenant_victim(self, tenant: int, skip: Container[bytes], cls: int) -> bytes | None:
        """The first record of ``tenant`` of class ``cls`` in its policy order that is neither
        pinned nor in ``skip``; None if none."""
        pol = self._tpol.get(tenant, {}).get(cls)
        if pol is not None:
            for key in pol.victims():
                if key not in skip and not self.is_pinned(key):
                    return key
        return None

    def _refuse(self, tenant: int, why: str) -> TierFullError:
        self._count("tenant_refusals")
        return TierFullError(f"tier {self.name!r}: tenant {self.quotas.label(tenant)}: {why}")


def header_tenant(record: memoryview) -> int:
    """The tenant a raw record's header names (0: version 1, or no header)."""
    if len(record) < HEADER_SIZE or bytes(record[4:6]) != TENANT_VERSION.to_bytes(2, "little"):
        return 0
    return int.from_bytes(record[TENANT_AT : TENANT_AT + 8], "little")

"""Eviction in an LMDB tier: which records go to fit a write under the cap or a tenant's quota.

The access DB survives restarts; at open it is read once to rebuild the in-memory eviction
order: an :class:`~tieredkv.eviction.EvictionPolicy` named by ``eviction_policy`` (``lru``), fed
in the order its :meth:`~tieredkv.eviction.EvictionPolicy.rank` gives the stamps. Below, "LRU"
stands for that policy's order. Access stamps are bumped in memory by reads and written with the
next write transaction.

* A write transaction evicts the least-recently-used unpinned records until its batch fits
  under ``size_cap_bytes`` (or raises TierFullError having stored nothing). With tenant quotas
  (:attr:`~tieredkv.backends.base.Tier.quotas`): a tenant whose batch would take it over its
  quota first loses its own least-recently-used records (this process's order of them; the
  shared stamps when it has not seen enough of them, as below), and when the cap is reached the
  records of tenants over their quota go before anyone's.
* The size cap holds for the environment, not per process: the used-bytes counter lives in the
  environment and is read and updated inside each write transaction (LMDB serializes writers
  across processes), so whichever process writes evicts until the whole environment fits. A
  process evicts the oldest records of its own LRU first; when those do not cover the excess,
  or over an eighth of the cap is records it has never seen (then at most every
  max(1 s, 20x the read)), it reads the shared access stamps, evicts the oldest records of any
  process and adopts that order.
* Pins protect keys only from the process that pinned them: a record another process evicts
  turns into a miss here, like one it deletes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import Any

from tieredkv.backends.base import RecordInfo
from tieredkv.backends.lmdb.layout import ACCESS
from tieredkv.backends.lmdb.records import LMDBRecordFiles
from tieredkv.backends.lmdb.tenants import TenantOrders, entry_tenant
from tieredkv.errors import TierFullError
from tieredkv.eviction import make_policy
from tieredkv.format import HEADER_SIZE

__all__ = ["LMDBEviction"]


class LMDBEviction(LMDBRecordFiles):
    """Evictions inside a write transaction, and the in-memory orders they follow."""

    def _evict_in(
        self,
        txn: Any,
        excess: int,
        protect: set[bytes],
        evicted: dict[bytes, int],
        tenant: int | None = None,
        must: bool = True,
    ) -> int:
        """Delete the least-recently-used unpinned records (not in ``protect``) covering ``excess``
        bytes of the environment, adding them to ``evicted`` (keys already gone map to 0). This
        process's LRU goes first; the shared access stamps (every process's records) decide
        instead when it falls short, or when over an eighth of the cap is records this process
        has never seen (rate-limited: a full read of the access DB), and the LRU adopts that order
        after the commit (:meth:`_after_evictions`). With quotas, the records of tenants over
        their quota go first (:meth:`_evict_over_quota`).

        ``tenant``: only that tenant's records (it is over its quota), by this process's order of
        them, then by the shared stamps the same way (over an eighth of its quota unseen here).

        Returns what is left of ``excess`` (0 or less: covered). Raises TierFullError (the
        caller's transaction is then aborted) when it is not covered (everything is pinned),
        unless ``must`` is false."""
        sh = self._shared
        assert sh is not None

        def take(k: bytes, size: int, meta: Any = None) -> None:
            self._drop(txn, k, txn.get(k, db=sh.acc) if meta is None else meta)
            txn.delete(k, db=sh.rec)
            txn.delete(k, db=sh.acc)
            evicted[k] = size

        if tenant is None:
            if self.quotas.enabled:
                excess = self._evict_over_quota(txn, excess, protect, evicted)
                if excess <= 0:
                    return excess
            foreign = self._used_in(txn) - self._policy.total_bytes  # bytes this process has never seen
            bound = self._cap
            order = self._policy.victims()
        else:
            assert self._ledger is not None
            foreign = self._ledger.usage(txn, tenant) - self._torders.known_bytes(tenant)
            bound = self.quotas.limit(tenant, self._cap) or self._cap
            order = self._torders.victims(tenant)
        if foreign > bound // 8 and time.monotonic() >= self._next_scan:
            # their records may be the oldest
            return self._scan_in(txn, excess, protect, evicted, take, tenant, must)
        for k in order:  # not changed here: _after_evictions forgets them
            if excess <= 0:
                return excess
            if k in protect or k in evicted or self.is_pinned(k):
                continue
            meta = txn.get(k, db=sh.acc)  # (read once: its size, and its place in a record file)
            size = 0 if meta is None else ACCESS.unpack_from(meta)[1]
            if size and tenant is not None and entry_tenant(meta, lambda k=k: txn.get(k, db=sh.rec)) != tenant:
                continue  # written again since by another tenant (in another process): not this tenant's
            if size:
                take(k, size, meta)
                excess -= size
            else:  # already gone: another process deleted or evicted it
                evicted[k] = 0
        if excess > 0:
            return self._scan_in(txn, excess, protect, evicted, take, tenant, must)
        return excess

    def _evict_over_quota(self, txn: Any, excess: int, protect: set[bytes], evicted: dict[bytes, int]) -> int:
        """The environment is over its cap by ``excess``: the tenants over their quota lose their
        own oldest records first (the furthest over first), down to their quota at most. Returns
        what is left of ``excess``."""
        assert self._ledger is not None
        over = []
        for t, held in self._ledger.all(txn).items():
            quota = self.quotas.limit(t, self._cap)
            if quota is not None and held > quota:
                over.append((held - quota, t))
        for gap, t in sorted(over, reverse=True):
            if excess <= 0:
                break
            want = min(gap, excess)
            excess -= want - self._evict_in(txn, want, protect, evicted, tenant=t, must=False)
        return excess

    def _scan_in(
        self,
        txn: Any,
        excess: int,
        protect: set[bytes],
        evicted: dict[bytes, int],
        take: Callable[[bytes, int], None],
        tenant: int | None = None,
        must: bool = True,
    ) -> int:
        """Evict by the shared access stamps (every process's records, oldest first; ``tenant``:
        only that tenant's). A full read of the access DB: when not forced by a shortfall, run at
        most every 20x its own duration. Returns what is left of ``excess``."""
        started = time.monotonic()
        self._count("shared_lru_scans")
        self._rescan = self._ranked(txn)
        for info in self._rescan:
            if excess <= 0:
                break
            k = info.key
            if tenant is not None and info.tenant != tenant:
                continue
            if k in protect or evicted.get(k) or self.is_pinned(k):
                continue
            size = info.size + HEADER_SIZE
            take(k, size)
            excess -= size
        now = time.monotonic()
        self._next_scan = now + max(1.0, 20 * (now - started))
        if excess > 0 and must:
            whose = "" if tenant is None else f" of tenant {self.quotas.label(tenant)} (over its quota)"
            raise TierFullError(
                f"tier {self.name!r}: size cap of {self._cap} bytes reached and every record{whose} that"
                " could be evicted is pinned (in use)"
            )
        return excess

    def _after_evictions(self, evicted: dict[bytes, int]) -> None:
        """After the commit: drop what went from the LRU, and adopt a shared LRU order just read."""
        if self._rescan is not None:
            self._adopt(self._rescan, skip=evicted)
            self._rescan = None
        self._forget(evicted)
        self._count("evictions", sum(1 for size in evicted.values() if size))
        if evicted and self._removal_listener is not None:  # (and those another process took first)
            self._removed(list(evicted))

    def _forget(self, keys: Any) -> None:
        torders = self._torders if self._torders else None
        for k in keys:
            self._policy.remove(k)
            self._dirty.pop(k, None)
            if torders is not None:
                torders.remove(k)

    def _ranked(self, txn: Any) -> list[RecordInfo]:
        """Every record of the environment (every process's) by its shared access stamp, in the
        policy's eviction order (:meth:`~tieredkv.eviction.EvictionPolicy.rank`), with its tenant
        (looked up only while some tenant other than the default one holds records)."""
        infos = []
        sh = self._sh
        get, rec = txn.get, sh.rec
        tenanted = txn.stat(sh.tenants)["entries"] > 0
        for k, v in txn.cursor(db=sh.acc):
            stamp, size = ACCESS.unpack_from(v)
            tenant = entry_tenant(v, lambda k=k: get(k, db=rec)) if tenanted else 0
            infos.append(RecordInfo(bytes(k), size - HEADER_SIZE, stamp, tenant))
        return self._policy.rank(infos)

    def _adopt(self, ranked: list[RecordInfo], skip: Container[bytes]) -> None:
        """Replace the in-memory orders by ``ranked`` (first = evict first), less ``skip``."""
        policy = make_policy(self.config.eviction_policy)
        orders = TenantOrders(self.config.eviction_policy)
        for info in ranked:
            if info.key not in skip:
                policy.insert(info.key, info.size + HEADER_SIZE)
                if info.tenant:
                    orders.insert(info.key, info.size + HEADER_SIZE, info.tenant)
        self._policy = policy
        self._torders = orders

"""Tenants in the LMDB tier (:class:`~tieredkv.backends.lmdb.LMDBTier`): each record's tenant in
the index, per-tenant byte counters kept in the environment, and per-process orders of each
tenant's records.

Layout (beside the tier's own, see :mod:`~tieredkv.backends.lmdb.layout`):

* **A record's tenant** (:mod:`tieredkv.format`, header bytes 48..55; 0: the default tenant) is
  found in the index without touching a payload: for a record stored apart, in the header kept
  after its access stamp; for a record in a record file (its header is in the file), after its
  place in its ``records`` value (``PLACE`` then ``<Q`` tenant; a default-tenant record's value
  is the place alone, as before); for a record stored whole, in the header its ``records`` value
  starts with (:func:`entry_tenant`).
* **Counters**: named DB ``tenants``, tenant id ``<Q`` → ``<QQ`` (record bytes, records), for
  every tenant but the default one that holds records (an entry goes with its last record). The
  default tenant's bytes are the environment's used-bytes counter less the others. They are
  kept like that counter: read and changed inside each write transaction, so the processes that
  share a directory keep them exact (LMDB lets one writer in at a time).
* ``tieredkv:tenants-at`` (main DB, ``<Q``): the id of the write transaction that last left the
  counters exact. Each write transaction of this version first checks that it is the id right
  before its own (:meth:`Ledger.begin`): otherwise another writer committed meanwhile that does
  not keep them (an earlier tieredkv on the same directory, a tool), or the environment is from
  before tenants, and they are rebuilt by a scan of the index (:func:`count_tenants`), once.

:class:`TenantOrders` is a process's eviction order of each tenant's records (the tier's policy,
one per tenant), beside its order of every record: a tenant over its quota loses its own oldest
records first (:meth:`~tieredkv.backends.lmdb.eviction.LMDBEviction._evict_in`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from tieredkv.backends.lmdb.layout import ACCESS, PLACE
from tieredkv.eviction import EvictionPolicy, make_policy
from tieredkv.format import HEADER_SIZE, MAGIC, TENANT_AT, TENANT_VERSION

__all__ = [
    "AT_KEY",
    "TENANTS_DB",
    "Ledger",
    "TenantOrders",
    "count_tenants",
    "counters_exact",
    "entry_tenant",
    "header_tenant",
    "place_value",
    "read_counters",
]

TENANTS_DB = b"tenants"
AT_KEY = b"tieredkv:tenants-at"
_ID = struct.Struct("<Q")
_COUNT = struct.Struct("<QQ")  # record bytes, records
_ACCESS_SIZE = ACCESS.size  # the access entry's stamp and size
_PLACE_SIZE = PLACE.size  # a filed record's place
_FILED_SIZE = _ACCESS_SIZE + _PLACE_SIZE
_APART_SIZE = _ACCESS_SIZE + HEADER_SIZE


def header_tenant(head: Any) -> int:
    """The tenant a record header names (0 for a version 1 header, or anything not a header)."""
    if head is None or len(head) < TENANT_AT + 8 or bytes(head[:4]) != MAGIC:
        return 0
    if int.from_bytes(head[4:6], "little") != TENANT_VERSION:
        return 0
    return int(_ID.unpack_from(head, TENANT_AT)[0])


def place_value(place: bytes, tenant: int) -> bytes:
    """The ``records`` value of a record in a record file: its place, then its tenant (if any)."""
    return place + _ID.pack(tenant) if tenant else place


def entry_tenant(meta: Any, rec: Any) -> int:
    """The tenant of the record whose access entry is ``meta`` and ``records`` value ``rec``
    (``rec`` may be a callable that reads it: only records not stored apart need it)."""
    if meta is not None and len(meta) == _APART_SIZE:
        return header_tenant(memoryview(meta)[_ACCESS_SIZE:])
    value = rec() if callable(rec) else rec
    if value is None:
        return 0
    if meta is not None and len(meta) == _FILED_SIZE:
        return int(_ID.unpack_from(value, _PLACE_SIZE)[0]) if len(value) == _PLACE_SIZE + 8 else 0
    return header_tenant(value)  # stored whole


def count_tenants(txn: Any, acc: Any, rec: Any) -> dict[int, list[int]]:
    """Bytes and records of each tenant but the default one, by a scan of the index."""
    out: dict[int, list[int]] = {}
    get = txn.get
    for k, meta in txn.cursor(db=acc):
        size = struct.unpack_from("<Q", meta, 8)[0]
        t = entry_tenant(meta, lambda k=k: get(k, db=rec))
        if t:
            c = out.setdefault(t, [0, 0])
            c[0] += size
            c[1] += 1
    return out


def counters_exact(txn: Any, *, write: bool) -> bool:
    """Whether the counters are exact in ``txn``: the last transaction committed before it (a
    write transaction's id is the last one's plus one) was one that kept them."""
    at = txn.get(AT_KEY)
    return at is not None and _ID.unpack(at)[0] == txn.id() - (1 if write else 0)


class Ledger:
    """The tenant counters within one write transaction: read from the ``tenants`` DB, changed in
    memory (:meth:`add`), written back at the end (:meth:`settle`). Used by the tier's thread only."""

    def __init__(self, db: Any, acc: Any, rec: Any) -> None:
        self.db, self.acc, self.rec = db, acc, rec
        self._delta: dict[int, list[int]] = {}
        #: Some record of a tenant other than the default may be involved: counters are not empty,
        #: or this transaction adds one (else a removal need not look for its record's tenant).
        self.active = False
        self.rebuilt = 0  # counters rebuilt by a scan (they were not exact)

    def begin(self, txn: Any) -> None:
        """Start a write transaction's work: counters rebuilt first when another writer left them
        behind (see the module docstring)."""
        self._delta = {}
        if not counters_exact(txn, write=True):
            self.rebuild(txn)
        self.active = txn.stat(self.db)["entries"] > 0

    def rebuild(self, txn: Any) -> None:
        counts = count_tenants(txn, self.acc, self.rec)
        txn.drop(self.db, delete=False)
        for t, (nbytes, n) in sorted(counts.items()):
            txn.put(_ID.pack(t), _COUNT.pack(nbytes, n), db=self.db)
        txn.put(AT_KEY, _ID.pack(txn.id()))
        self.rebuilt += 1

    def add(self, tenant: int, nbytes: int, records: int) -> None:
        """Count ``nbytes`` / ``records`` in (negative: out) for ``tenant`` (the default: ignored)."""
        if tenant:
            d = self._delta.get(tenant)
            if d is None:
                d = self._delta[tenant] = [0, 0]
            d[0] += nbytes
            d[1] += records
            self.active = True

    def usage(self, txn: Any, tenant: int) -> int:
        """Bytes ``tenant`` holds now, in this transaction."""
        raw = txn.get(_ID.pack(tenant), db=self.db)
        held = 0 if raw is None else _COUNT.unpack(raw)[0]
        d = self._delta.get(tenant)
        return held + (d[0] if d else 0)

    def all(self, txn: Any) -> dict[int, int]:
        """Bytes of every tenant but the default one, in this transaction."""
        out = {_ID.unpack(k)[0]: _COUNT.unpack(v)[0] for k, v in txn.cursor(db=self.db)}
        for t, (nbytes, _) in self._delta.items():
            out[t] = out.get(t, 0) + nbytes
        return {t: n for t, n in out.items() if n > 0}

    def settle(self, txn: Any) -> None:
        """Write the changed counters and this transaction's id (it leaves them exact)."""
        for t, (nbytes, n) in self._delta.items():
            if not nbytes and not n:
                continue
            key = _ID.pack(t)
            raw = txn.get(key, db=self.db)
            held, count = (0, 0) if raw is None else _COUNT.unpack(raw)
            held, count = held + nbytes, count + n
            if count <= 0 or held <= 0:
                txn.delete(key, db=self.db)
            else:
                txn.put(key, _COUNT.pack(held, count), db=self.db)
        self._delta = {}
        txn.put(AT_KEY, _ID.pack(txn.id()))


def read_counters(txn: Any, db: Any) -> dict[int, tuple[int, int]] | None:
    """Each tenant's (bytes, records) as the ``tenants`` DB holds them, or None when they are not
    exact in this read transaction (a writer that does not keep them committed last)."""
    if not counters_exact(txn, write=False):
        return None
    return {_ID.unpack(k)[0]: _COUNT.unpack(v) for k, v in txn.cursor(db=db)}


class TenantOrders:
    """This process's eviction order of each tenant's records (the default tenant's are not
    kept here: the tier's order of every record covers them)."""

    def __init__(self, policy: str) -> None:
        self._policy = policy
        self.of: dict[bytes, int] = {}  # key -> its tenant (not the default)
        self._orders: dict[int, EvictionPolicy] = {}

    def insert(self, key: bytes, size: int, tenant: int) -> None:
        old = self.of.get(key)
        if old is not None and old != tenant:
            self.remove(key)
        if tenant:
            self.of[key] = tenant
            order = self._orders.get(tenant)
            if order is None:
                order = self._orders[tenant] = make_policy(self._policy)
            order.insert(key, size)

    def touch(self, key: bytes) -> None:
        t = self.of.get(key)
        if t:
            self._orders[t].touch(key)

    def remove(self, key: bytes) -> None:
        t = self.of.pop(key, 0)
        if t:
            order = self._orders[t]
            order.remove(key)
            if not len(order):
                del self._orders[t]

    def victims(self, tenant: int) -> Iterator[bytes]:
        """``tenant``'s keys this process knows, in eviction order (not to be changed meanwhile)."""
        order = self._orders.get(tenant)
        return iter(()) if order is None else order.victims()

    def known_bytes(self, tenant: int) -> int:
        order = self._orders.get(tenant)
        return 0 if order is None else order.total_bytes

    def __bool__(self) -> bool:
        return bool(self.of)

"""What the manager and the worker of one engine share (:mod:`tieredkv.integrations.vllm.spec`).

* :class:`TieredKVLoadStoreSpec` — the medium side of a transfer, handed by the manager's
  ``prepare_load`` / ``prepare_store`` to the worker's ``submit_load`` / ``submit_store``.
* :func:`acquire_store` / :func:`release_store` — one :class:`~tieredkv.store.TieredStore` per
  engine and process, counted by its users (the manager and the worker: vLLM runs the scheduler
  and a single worker in one process), closed when the last one lets it go; with it, the
  namespace of the current cache generation and the whole-chunk keys that were not stored.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadKey

from tieredkv.config import TieredKVConfig
from tieredkv.keys import Namespace, stored_key
from tieredkv.store import TieredStore

__all__ = ["StoredKeys", "TieredKVLoadStoreSpec", "acquire_store", "release_store"]


class TieredKVLoadStoreSpec(LoadStoreSpec):
    """The medium side of a transfer: vLLM offload keys, group-major, ascending chunk.

    ``fingerprint`` is the namespace (cache generation included) the manager prepared the
    transfer under; ``stored`` (loads) is, per key, the stored key to read: the whole chunk or a
    partial record (:func:`~tieredkv.keys.partial_chunk_key`) whose leading sub-blocks are invalid.
    ``tenant``: the request's tenant id (its ``cache_salt``; 0: the default tenant), whose records
    a store writes and a load promotes. ``tiers``: the tier names the request's tier filter allows
    (``kv_store_tiers`` / ``kv_load_tiers``); None: every tier of each group's route.
    """

    def __init__(
        self,
        keys: Sequence[OffloadKey],
        fingerprint: bytes = b"",
        stored: Sequence[bytes] | None = None,
        tenant: int = 0,
        tiers: frozenset[str] | None = None,
    ) -> None:
        self.keys: list[OffloadKey] = list(keys)
        self.fingerprint = fingerprint
        self.stored: list[bytes] = (
            list(stored) if stored is not None else [stored_key(fingerprint, k) for k in self.keys]
        )
        self.tenant = tenant
        self.tiers = tiers

    def __repr__(self) -> str:
        return f"TieredKVLoadStoreSpec({len(self.keys)} keys)"


# ---- one store per engine and process, shared by manager and worker ---------------------------


class _Shared:
    """What the manager and the worker of one engine share (same process)."""

    def __init__(self, store: TieredStore, namespace: Namespace) -> None:
        self.store = store
        self.refs = 0
        self.unstored: set[bytes] = set()
        """Whole-chunk stored keys whose store job ended without the whole chunk held by a tier
        (refused, dropped, or only a partial record): the manager must not treat them as stored."""
        self.namespace = namespace

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @namespace.setter
    def namespace(self, ns: Namespace) -> None:
        self._namespace = ns
        #: A plain attribute: the scheduler reads it once per lookup.
        self.fingerprint: bytes = ns.fingerprint
        #: vLLM key -> stored key under this fingerprint (a new generation starts a new map).
        self.skeys = StoredKeys(ns.fingerprint)


class StoredKeys(dict[bytes, bytes]):
    """vLLM's key -> its stored key (``fingerprint + key``), made on first use.

    vLLM's scheduler hands the manager the same key objects step after step (a waiting request's
    keys are asked again on every step, a stored key comes back at ``complete_store``): one
    dict read, the key's hash cached in vLLM's key object, instead of a concatenation, a new
    object and its hash (SipHash over 52 bytes) per call. Holds at most ``limit`` keys: full,
    it starts again empty (what it holds is only ever recomputed, never wrong)."""

    __slots__ = ("fp", "limit")

    def __init__(self, fingerprint: bytes, limit: int = 1 << 16) -> None:
        super().__init__()
        self.fp = fingerprint
        self.limit = limit

    def __missing__(self, key: bytes) -> bytes:
        if len(self) >= self.limit:
            self.clear()
        skey = self[key] = self.fp + key
        return skey


_STORES: dict[tuple[Any, ...], _Shared] = {}
_STORES_LOCK = threading.Lock()


def acquire_store(ident: tuple[Any, ...], cfg: TieredKVConfig, ns: Namespace) -> _Shared:
    """The shared state of the engine ``ident`` names (its store started from ``cfg`` under ``ns``
    by the first caller), counted as one more user until :func:`release_store`."""
    with _STORES_LOCK:
        entry = _STORES.get(ident)
        if entry is None:
            entry = _STORES[ident] = _Shared(TieredStore(cfg, namespace=ns).start(), ns)
        entry.refs += 1
        return entry


def release_store(ident: tuple[Any, ...]) -> None:
    """One user of ``ident``'s shared state less; the last one closes its store."""
    with _STORES_LOCK:
        entry = _STORES.get(ident)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        del _STORES[ident]
    entry.store.close()

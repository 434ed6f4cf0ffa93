"""What every part of an LMDB tier shares: its state, its threads, and the transaction bracket.

:class:`LMDBCore` is the bottom of the tier's layers, each a module of its own job, stacked so
that each uses only those below it: :mod:`~tieredkv.backends.lmdb.records` (record files and
their upkeep), :mod:`~tieredkv.backends.lmdb.eviction`, :mod:`~tieredkv.backends.lmdb.writes`,
:mod:`~tieredkv.backends.lmdb.reads`, :mod:`~tieredkv.backends.lmdb.raw` (admin records) and
:class:`~tieredkv.backends.lmdb.tier.LMDBTier` (lifecycle, listings, stats).

Every blocking LMDB call runs on one dedicated thread (a single-worker executor: :meth:`_run`),
never on the event loop; all LRU state is touched only from that thread. A second thread (the
helper) reads half of a large batch and computes a large write's headers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import lmdb

from tieredkv.backends.base import RecordInfo, Tier
from tieredkv.backends.lmdb.config import LMDBTierConfig
from tieredkv.backends.lmdb.env import RESIZE_RETRIES, SharedEnv
from tieredkv.backends.lmdb.layout import FILES, SPARE, USED, USED_KEY
from tieredkv.backends.lmdb.tenants import Ledger, TenantOrders
from tieredkv.eviction import EvictionPolicy, make_policy

__all__ = ["LMDBCore"]

_T = TypeVar("_T")


class LMDBCore(Tier):
    """The state of an LMDB tier, its threads and its transactions (no medium logic)."""

    def __init__(self, config: LMDBTierConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config or LMDBTierConfig(), **kwargs)
        cfg: LMDBTierConfig = self.config
        self.path = os.path.abspath(os.path.expanduser(cfg.path))
        self._cap = int(cfg.size_cap_bytes)
        self._max_map = int(cfg.max_map_size_bytes)
        self._pool: ThreadPoolExecutor | None = None
        # the tier's second thread: reads the second half of a large batch, encodes a write's records
        self._helper: ThreadPoolExecutor | None = None
        self._shared: SharedEnv | None = None
        self._policy: EvictionPolicy = make_policy(cfg.eviction_policy)  # key -> record bytes
        self._torders = TenantOrders(cfg.eviction_policy)  # the same, per tenant (not the default one)
        self._ledger: Ledger | None = None  # the tenant counters, within a write transaction
        self._dirty: dict[bytes, float] = {}
        self._on_helper = 0  # batches on the helper thread now (loop thread only)
        self._rescan: list[RecordInfo] | None = None  # shared order read by the last eviction
        self._next_scan = 0.0  # monotonic time before which only a shortfall triggers a shared scan
        self._files = os.path.join(self.path, FILES)
        self._spares = os.path.join(self._files, SPARE)
        self._file_min = None if cfg.file_batch_bytes is None else int(cfg.file_batch_bytes)
        # what the open write transaction frees in record files: whole files, and records in files
        self._doomed: list[bytes] = []
        self._holes: dict[bytes, list[tuple[int, int]]] = {}
        self._kept: set[str] = set()  # names of the spares this tier kept (given back at close when idle here)
        self._upkeep: asyncio.Task[None] | None = None  # the periodic sweep (:meth:`_upkeep_loop`)

    # ---- the shared environment --------------------------------------------------------

    @property
    def _sh(self) -> SharedEnv:
        """The shared environment (only used while open)."""
        assert self._shared is not None, "LMDB tier used while not open"
        return self._shared

    @property
    def _env(self) -> Any:
        return None if self._shared is None else self._shared.env

    # ---- thread plumbing ---------------------------------------------------------------

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _txn(self, fn: Callable[[Any], _T], write: bool = False, db: Any = None, buffers: bool = False) -> _T:
        """``fn(txn)`` in one transaction (committed when ``write``), bracketed by the shared lock;
        a map another process grew is adopted and ``fn`` retried."""
        sh = self._shared
        assert sh is not None
        for attempt in range(RESIZE_RETRIES + 1):
            try:
                with sh.shared(), sh.env.begin(write=write, db=db, buffers=buffers) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                if attempt == RESIZE_RETRIES:
                    raise
                sh.adopt_map()
                self._count("map_adoptions")
        raise AssertionError("unreachable")

    # ---- shared accounting (inside a write transaction) ---------------------------------

    def _used_in(self, txn: Any) -> int:
        """The used-bytes counter of the environment, as ``txn`` sees it."""
        raw = txn.get(USED_KEY)
        return 0 if raw is None else USED.unpack(raw)[0]

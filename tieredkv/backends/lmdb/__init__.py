"""The LMDB tier: one LMDB environment per directory per process on local disk (NVMe), record
files beside the index for large batches.

* ``tier`` — :class:`LMDBTier`: lifecycle, listings, stats; built on the layers below, each
  using only those before it:
* ``layout`` — what the named DBs hold, and the structs that pack their entries.
* ``env`` — the environment this process's tiers on one directory share; map growth, other
  processes.
* ``core`` — a tier's state, threads and transaction bracket.
* ``records`` — record files of a tier: written, freed, kept as spares, swept.
* ``eviction`` — what goes to fit the cap and the tenants' quotas.
* ``writes`` — puts, deletions, a full map, a full disk.
* ``reads`` — loads, lookups, records that moved during a read.
* ``raw`` — whole records for admin tools, migrations and repairs.
* ``files`` — record files on disk: ownership flocks, spares, the orphan sweep.
* ``space`` — a full disk told from a failing one; the index reserve.
* ``tenants`` — tenants in the index, per-tenant counters and quota evictions.
* ``config`` — :class:`LMDBTierConfig` (importing it imports no py-lmdb).

The tier class is imported on first use (``from tieredkv.backends.lmdb import LMDBTier``), so
importing the package, or its ``config``, does not import the tier's client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tieredkv._lazy import lazy_names
from tieredkv.backends.lmdb.config import LMDBTierConfig

if TYPE_CHECKING:
    from tieredkv.backends.lmdb.tier import LMDBTier

__all__ = ["LMDBTier", "LMDBTierConfig"]


__getattr__ = lazy_names(__name__, {"LMDBTier": "tier"})

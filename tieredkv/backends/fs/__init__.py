"""The shared-filesystem tier (``kind: fs``): one directory every node mounts, one checksummed
record per file, published atomically, capped for the directory whoever writes.

* ``tier`` — :class:`FSTier`: lifecycle, the contract's operations, stats; built on:
* ``layout`` — where records, temporary files, the marker and the ledger live; fan-out; owners.
* ``ledger`` — the shared usage ledger and its POSIX record lock.
* ``records`` — record files written (temporary name, rename), read and checked, a slice of a
  batch at a time on an I/O thread (handed there through aiofiles).
* ``space`` — reservations, eviction by access time, recounts, the sweep of temporary files.
* ``config`` — :class:`FSTierConfig` (importing it imports no aiofiles).

The tier class is imported on first use (``from tieredkv.backends.fs import FSTier``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tieredkv._lazy import lazy_names
from tieredkv.backends.fs.config import FSTierConfig

if TYPE_CHECKING:
    from tieredkv.backends.fs.tier import FSTier

__all__ = ["FSTier", "FSTierConfig"]


__getattr__ = lazy_names(__name__, {"FSTier": "tier"})

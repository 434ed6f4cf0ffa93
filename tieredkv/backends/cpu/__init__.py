"""The CPU tier: an in-process slab of host memory (pinned with CUDA), slot classes, an eviction
policy per class.

* ``tier`` — :class:`CPUTier`: config, lifecycle, the tier hooks, raw records.
* ``slab`` — its base :class:`~tieredkv.backends.cpu.slab.SlabTier`: segments, slot classes,
  allocation and eviction, the pipeline's reserve / commit / borrow path.
* ``tenants`` — :class:`~tieredkv.backends.cpu.tenants.TenantBooks`: each tenant's bytes, quota
  and eviction orders in the slab.
* ``config`` — :class:`CPUTierConfig` (importing it imports no torch).

The tier class is imported on first use (``from tieredkv.backends.cpu import CPUTier``), so
importing the package, or its ``config``, does not import the tier's client library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tieredkv._lazy import lazy_names
from tieredkv.backends.cpu.config import CPUTierConfig

if TYPE_CHECKING:
    from tieredkv.backends.cpu.tier import CPUTier

__all__ = ["CPUTier", "CPUTierConfig"]


__getattr__ = lazy_names(__name__, {"CPUTier": "tier"})

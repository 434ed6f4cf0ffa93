"""tieredkv as vLLM 0.33's KV offload backend.

Three ways in, all configured through ``--kv-transfer-config`` (see docs/vllm.md):

* :class:`TieredKVSecondaryTier` — a ``SecondaryTierManager`` under vLLM's own
  ``TieringOffloadingSpec``: vLLM keeps its GPU↔CPU worker and shared primary region; tieredkv
  receives each group's chunks (primary rows) and routes them to LMDB / Redis by its policy.
* :class:`TieredKVOffloadingSpec` — a whole ``OffloadingSpec`` (``spec_module_path``): tieredkv's
  own manager and worker (staging pool, copier, pipeline, CPU / LMDB / Redis tiers).
* :class:`TieredKVConnector` — a connector (``kv_connector_module_path``): vLLM's
  ``OffloadingConnector`` whose scheduler side plans stores and aligns hits with tieredkv's rules
  (no refused or partially accepted chunk skipped, Mamba hits on the Mamba grid); works with any
  of vLLM's offloading specs, tieredkv's included. It also puts tieredkv's counters on vLLM's own
  ``/metrics`` (``vllm:kv_offload_tieredkv_*``, see :mod:`tieredkv.integrations.vllm.stats`).

vLLM is imported only when one of these classes is first touched (vLLM's factories do
``getattr(module, name)``), so ``import tieredkv.integrations.vllm`` stays cheap and
``import tieredkv`` never imports vLLM.
"""

from __future__ import annotations

from typing import Any

from tieredkv.integrations.vllm.namespace import namespace_from_offloading_config

__all__ = ["TieredKVConnector", "TieredKVOffloadingSpec", "TieredKVSecondaryTier", "namespace_from_offloading_config"]

SUPPORTED_VLLM = ("0.33",)


def __getattr__(name: str) -> Any:
    if name in ("TieredKVConnector", "TieredKVConnectorScheduler"):
        from tieredkv.integrations.vllm import connector

        return getattr(connector, name)
    if name in ("StoreStatsReporter", "TieredKVPromMetrics"):
        from tieredkv.integrations.vllm import stats

        return getattr(stats, name)
    if name == "TieredKVSecondaryTier":
        from tieredkv.integrations.vllm.secondary import TieredKVSecondaryTier

        return TieredKVSecondaryTier
    if name in ("TieredKVOffloadingSpec", "TieredKVManager", "TieredKVWorker", "TieredKVLoadStoreSpec"):
        from tieredkv.integrations.vllm import spec

        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

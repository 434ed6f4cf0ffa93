"""tieredkv as vLLM 0.33's KV offload backend.

Three ways in, all configured through ``--kv-transfer-config`` (see docs/vllm.md):

* :class:`TieredKVSecondaryTier` — a ``SecondaryTierManager`` under vLLM's own
  ``TieringOffloadingSpec``: vLLM keeps its GPU↔CPU worker and shared primary region; tieredkv
  receives each group's chunks (primary rows) and routes them to LMDB / Redis by its policy.
* :class:`TieredKVOffloadingSpec` — a whole ``OffloadingSpec`` (``spec_module_path``): tieredkv's
  own manager and worker (staging pool, copier, pipeline, CPU / LMDB / Redis tiers).
* :class:`TieredKVConnector` — a connector (``kv_connector_module_path``): vLLM's
  ``OffloadingConnector`` whose scheduler side plans stores and aligns hits with tieredkv's rules
  (no refused chunk skipped, Mamba hits on the Mamba grid); works with any
  of vLLM's offloading specs, tieredkv's included. It also puts tieredkv's counters on vLLM's own
  ``/metrics`` (``vllm:kv_offload_tieredkv_*``, see :mod:`tieredkv.integrations.vllm.stats`).

vLLM is imported only when one of these classes is first touched (vLLM's factories do
``getattr(module, name)``), so ``import tieredkv.integrations.vllm`` stays cheap and
``import tieredkv`` never imports vLLM.

**Version gate.** vLLM's offloading API changes between minor releases, and the connector builds
on vLLM 0.33's private names (all listed at the top of :mod:`~tieredkv.integrations.vllm.compat`).
Importing this package where another vLLM is installed fails at once with one line, what is
supported and what was found (the installed distribution's version, read without importing vLLM);
:mod:`~tieredkv.integrations.vllm.compat` checks the imported ``vllm.__version__`` as well.
"""

from __future__ import annotations

from typing import Any

from tieredkv.integrations.vllm.version import (
    SUPPORTED_VLLM,
    installed_vllm,
    require_supported_vllm,
    unsupported_vllm,
)

__all__ = [
    "SUPPORTED_VLLM",
    "TieredKVConnector",
    "TieredKVOffloadingSpec",
    "TieredKVSecondaryTier",
    "namespace_from_offloading_config",
    "require_supported_vllm",
    "unsupported_vllm",
]

# Without vLLM the package still imports (its vLLM-free modules: namespaces, lookups); the
# connector's module then fails with the gate's line ("found no vLLM"), compat.py being its first
# vLLM import.
if (_found := installed_vllm()) is not None:
    require_supported_vllm(_found)

from tieredkv.integrations.vllm.namespace import namespace_from_offloading_config


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

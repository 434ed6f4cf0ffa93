"""``TieredKVOffloadingSpec``: tieredkv as a whole vLLM 0.33 ``OffloadingSpec``.

Loaded by vLLM's ``OffloadingSpecFactory`` through ``spec_name`` / ``spec_module_path``. The
spec owns both sides:

* :class:`TieredKVManager` (scheduler side) — tracks what is being written and asks tieredkv's
  tiers what is stored, never blocking: a key being written answers HIT_PENDING, an unknown key
  RETRY until a batched ``TieredStore.lookup_async`` (sent at the end of the step) resolves it.
  ``prepare_store`` is all-or-nothing: ``None`` (retry the same range later) when the chunks in
  flight would overrun the staging budget, never a key dropped for lack of space.
  ``prepare_load`` pins the chunks in every tier until ``complete_load``. Both name the request's
  tenant (:func:`~tieredkv.integrations.vllm.tenants.request_tenant`: its ``cache_salt`` behind
  ``TieredKVConnector``, else ``kv_transfer_params["cache_salt"]``) in the transfer's spec.
* :class:`TieredKVWorker` (worker side) — registers each KV group's tensors with tieredkv's
  pipeline (staging pool + copier; CUDA or CPU tensors) and turns vLLM's
  ``GPULoadStoreSpec`` + key list into per-group store / load jobs, as records of the spec's
  tenant (bounded by its quota in every tier; a load's promotions are the loading tenant's). The
  pipeline routes each group to its tiers by tieredkv's per-group policy (chunk bytes, kind).

The manager and the worker share one :class:`~tieredkv.store.TieredStore` per engine and
process (vLLM runs the scheduler and a single worker in one process: ``world_size == 1``), so
the scheduler sees exactly the tiers the worker writes, the in-process CPU tier included.
Several workers (TP/PP > 1) run in other processes: use :class:`TieredKVSecondaryTier` under
vLLM's ``TieringOffloadingSpec`` there (refused here with a clear error).

Modules: this one (the spec, the module vLLM's ``spec_module_path`` names; it exports every
class below), :mod:`~tieredkv.integrations.vllm.manager` (the scheduler side),
:mod:`~tieredkv.integrations.vllm.worker` (the worker side) and
:mod:`~tieredkv.integrations.vllm.shared` (the store they share, the transfer's spec).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from tieredkv.config import TieredKVConfig, load_config
from tieredkv.errors import ConfigError
from tieredkv.integrations.vllm.manager import TieredKVManager
from tieredkv.integrations.vllm.namespace import group_kinds, namespace_from_offloading_config
from tieredkv.integrations.vllm.shared import TieredKVLoadStoreSpec
from tieredkv.integrations.vllm.stats import metric_definitions
from tieredkv.integrations.vllm.worker import TieredKVWorker

__all__ = ["TieredKVLoadStoreSpec", "TieredKVManager", "TieredKVOffloadingSpec", "TieredKVWorker"]


class TieredKVOffloadingSpec(OffloadingSpec):
    """``kv_connector_extra_config``: ``tieredkv_config`` (path of a tieredkv YAML; else
    ``$TIEREDKV_CONFIG``, else tieredkv's defaults), optional ``max_inflight_store_chunks``
    (default: what the staging pool holds), ``keep_on_reset`` (default false: a vLLM cache reset
    starts a new cache generation), ``stats_interval_s`` (0.1: how often, at most, tieredkv's
    counters are read for vLLM's stats while transfers are in flight; 0: every step), ``group_kinds`` (one of full / sliding_window / mamba per
    group, when layer names do not tell), plus vLLM's own keys (``blocks_per_chunk``, ...)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's metrics of a spec plus tieredkv's ``vllm:kv_offload_tieredkv_*``, which
        :meth:`TieredKVManager.get_stats` reports: on vLLM's ``/metrics`` under any connector."""
        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        source = self.extra_config.get("tieredkv_config") or os.environ.get("TIEREDKV_CONFIG")
        self.tkv_config: TieredKVConfig = load_config(source)
        par = config.parallel
        if int(par.world_size) > 1:
            raise ConfigError(
                f"TieredKVOffloadingSpec: world_size={par.world_size} (tp={par.tp_size}, pp={par.pp_size}); the whole"
                " spec shares one tieredkv store between the scheduler and a single in-process worker. For several"
                ' workers use spec_name "TieringOffloadingSpec" with a "TieredKVSecondaryTier" secondary tier'
            )
        self.group_kinds = group_kinds(config, self.extra_config.get("group_kinds"))
        self.namespace = namespace_from_offloading_config(config, self.tkv_config, kinds=self.group_kinds)
        self.store_ident = (str(config.engine_id), self.namespace.fingerprint, str(source))
        self.keep_on_reset = _flag(self.extra_config.get("keep_on_reset", False), "keep_on_reset")
        chunk_bytes = max(1, int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk))
        staging = int(self.tkv_config.pipeline.staging_bytes)
        self.max_inflight_store_chunks = int(
            self.extra_config.get("max_inflight_store_chunks", 0) or max(1, staging // chunk_bytes // 2)
        )
        interval = self.extra_config.get("stats_interval_s", 0.1)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval >= 0:
            raise ConfigError(f"kv_connector_extra_config.stats_interval_s: got {interval!r}; use a number >= 0")
        self.stats_interval_s = float(interval)
        self._manager: TieredKVManager | None = None
        self._worker: TieredKVWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = TieredKVManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TieredKVWorker(self, kv_caches)
        return self._worker


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"kv_connector_extra_config.{name}: got {value!r}; use true or false")

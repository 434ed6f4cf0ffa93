"""The vLLM 0.33 surface ``TieredKVConnector`` is built on, in one place, behind the version gate.

Every vLLM name the connector (:mod:`~tieredkv.integrations.vllm.connector`,
:mod:`~tieredkv.integrations.vllm.connector_jobs`) uses is imported here, after vLLM's version is
checked (0.33.x, :mod:`~tieredkv.integrations.vllm.version`), and every vLLM
*private* name tieredkv depends on is listed below. A vLLM that renamed or dropped one fails with
its name: a class member at import, a scheduler attribute when the connector is built
(:func:`check_scheduler`), never mid-step.

vLLM 0.33.0's private names tieredkv depends on:

``vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py``
    ``_ConnectorMetricName``: the ``allocation_failure`` counter a refused store moves.
``.../v1/offloading/scheduler.py``, ``OffloadingConnectorScheduler`` (:data:`SCHEDULER_METHODS`)
    overridden: ``_acquire_step``, ``_manager_locked`` (the manager's lock regions),
    ``_lookup_complete_chunks``, ``_maximal_prefix_lookup`` (lookups), ``_build_store_jobs``,
    ``_build_partial_tail_store_jobs``, ``_build_aligned_boundary_store_jobs`` (stores),
    ``_reset_cache``; called: ``_calc_num_offloadable_tokens``, ``_reachable_store_block_mask``,
    ``_final_swa_alignment_blocks``, ``_make_boundary_key``, ``_generate_job_id``,
    ``_remove_pending_job``; relied on: ``_release_step`` (closes the region ``_acquire_step``
    opens), ``_step_region`` (a class attribute).
``OffloadingConnectorScheduler`` state its ``__init__`` sets (:data:`SCHEDULER_STATE`)
    ``_req_status``, ``_jobs``, ``_block_id_to_pending_jobs``, ``_current_batch_allocated_block_ids``,
    ``_current_batch_jobs_to_flush``, ``_events_tracker``, ``_connector_stats``, ``_mamba_align_size``.
``.../v1/base.py``, ``KVConnectorBase_V1``
    ``_connector_metadata`` (the step's metadata: the held requests the workers release).
``.../v1/offloading_connector.py``, ``OffloadingConnector``
    ``_canonical_layout`` (set by ``TieredKVConnector.__init__``, which replaces vLLM's).
``vllm/v1/core/kv_cache_utils.py``
    ``_NONE_HASH_SEED`` (:func:`none_hash_seed`, for :mod:`~tieredkv.integrations.vllm.hashseed`).
``vllm/v1/kv_offload/base.py``, ``ReqContext``
    ``_offload_key_positions`` (read by :func:`~tieredkv.integrations.vllm.lookups.request_offload_keys`:
    every key of a request, recorded before its first lookup, sent as one in-step lookup batch;
    without it lookups of keys no tier answers without waiting go the asynchronous way).

Beside them the connector uses public names of vLLM's internal offloading modules (the
``RequestOffloadState`` / ``RequestGroupState`` fields, ``GroupOffloadConfig``,
``TransferJobStatus``, the events tracker's ``record_*``): imported here too.
"""

from __future__ import annotations

from typing import Any

from tieredkv.integrations.vllm.version import require_supported_vllm, unsupported_vllm

try:
    import vllm
except ModuleNotFoundError as exc:
    if exc.name != "vllm":
        raise
    raise ImportError(unsupported_vllm(None)) from exc

VLLM_VERSION = str(getattr(vllm, "__version__", "") or "") or None
require_supported_vllm(VLLM_VERSION)

from vllm.config import VllmConfig  # after the version gate
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import _ConnectorMetricName
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
    RequestOffloadState,
    TransferJobStatus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LookupResult,
    OffloadingSpec,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.request import Request, RequestStatus

__all__ = [
    "ALLOCATION_FAILURE",
    "OTHER_PRIVATE",
    "SCHEDULER_METHODS",
    "SCHEDULER_STATE",
    "VLLM_VERSION",
    "GPULoadStoreSpec",
    "GroupOffloadConfig",
    "KVCacheConfig",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "LookupResult",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingConnector",
    "OffloadingConnectorMetadata",
    "OffloadingConnectorScheduler",
    "OffloadingConnectorWorker",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "ReqContext",
    "Request",
    "RequestOffloadState",
    "RequestStatus",
    "SchedulerOutput",
    "TransferJob",
    "TransferJobStatus",
    "VllmConfig",
    "build_offloading_config",
    "check_scheduler",
    "none_hash_seed",
]

#: vLLM's ``allocation_failure`` counter (``_ConnectorMetricName.ALLOCATION_FAILURE``).
ALLOCATION_FAILURE = _ConnectorMetricName.ALLOCATION_FAILURE

#: Members of vLLM's ``OffloadingConnectorScheduler`` the connector overrides, calls or relies on.
SCHEDULER_METHODS = (
    "_acquire_step",
    "_release_step",
    "_manager_locked",
    "_lookup_complete_chunks",
    "_maximal_prefix_lookup",
    "_build_store_jobs",
    "_build_partial_tail_store_jobs",
    "_build_aligned_boundary_store_jobs",
    "_reset_cache",
    "_calc_num_offloadable_tokens",
    "_reachable_store_block_mask",
    "_final_swa_alignment_blocks",
    "_make_boundary_key",
    "_generate_job_id",
    "_remove_pending_job",
    "_step_region",
)

#: Attributes vLLM's ``OffloadingConnectorScheduler.__init__`` sets that the connector reads or writes.
SCHEDULER_STATE = (
    "_req_status",
    "_jobs",
    "_block_id_to_pending_jobs",
    "_current_batch_allocated_block_ids",
    "_current_batch_jobs_to_flush",
    "_events_tracker",
    "_connector_stats",
    "_mamba_align_size",
    "manager",
    "config",
)

#: The other private names (see the list at the top).
OTHER_PRIVATE = (
    "_connector_metadata",
    "_canonical_layout",
    "_ConnectorMetricName",
    "_NONE_HASH_SEED",
    "_offload_key_positions",
)

_missing = [name for name in SCHEDULER_METHODS if not hasattr(OffloadingConnectorScheduler, name)]
if _missing:
    raise ImportError(
        unsupported_vllm(VLLM_VERSION, f": its OffloadingConnectorScheduler has no {', '.join(_missing)}")
    )


def check_scheduler(sched: Any) -> None:
    """Raise (one line) unless vLLM's ``__init__`` gave ``sched`` every attribute of :data:`SCHEDULER_STATE`."""
    missing = [name for name in SCHEDULER_STATE if not hasattr(sched, name)]
    if missing:
        raise TypeError(
            unsupported_vllm(VLLM_VERSION, f": its OffloadingConnectorScheduler sets no {', '.join(missing)}")
        )


def none_hash_seed() -> tuple[Any, Any]:
    """vLLM's block-hash seed of this process (None until vLLM sets it) and its fixed default."""
    from vllm.v1.core import kv_cache_utils

    return getattr(kv_cache_utils, "_NONE_HASH_SEED", None), getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", None)

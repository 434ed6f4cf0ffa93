"""The shared-filesystem tier's config model (``kind: fs``); imports nothing of the tier itself
(aiofiles)."""

from __future__ import annotations

from typing import ClassVar, Literal, Self

from pydantic import ByteSize, Field

from tieredkv.tierconfig import (
    ENCRYPTION_DOC,
    EVICTION_POLICY_DOC,
    EncryptionConfig,
    EvictionPolicyName,
    Size,
    TierConfigBase,
)

__all__ = ["FSTierConfig"]


class FSTierConfig(TierConfigBase):
    """One directory that every node mounts (NFS, Lustre, CephFS, JuiceFS, 3FS, or a local disk):
    one file per record, published atomically, the size cap held for the directory whoever writes."""

    kind: Literal["fs"] = Field("fs", description="Tier kind (selects the backend).")
    path: str = Field(
        "./tieredkv-data/fs",
        description="Directory of the tier (created if missing); every node that shares the tier mounts the same one.",
    )
    size_cap_bytes: Size = Field(
        ByteSize(2 << 30),
        gt=0,
        description=(
            "Bytes of records (headers included) the directory may hold, whoever writes; a store"
            " that would pass it evicts first (eviction_policy)."
        ),
    )
    sync_mode: Literal["durable", "fast"] = Field(
        "fast",
        description=(
            "'durable': fsync each record before it is renamed into place, and its directory after;"
            " 'fast': no fsync (a crash of the host may lose recent records, never leave a partial one visible)."
        ),
    )
    eviction_policy: EvictionPolicyName = Field("lru", description=EVICTION_POLICY_DOC)
    io_threads: int = Field(
        16,
        gt=0,
        le=256,
        description=(
            "Threads of this tier's file I/O (aiofiles hands each a slice of a batch): the file"
            " operations one process keeps in flight, what a network filesystem's latency needs."
        ),
    )
    touch_interval_s: float = Field(
        30.0,
        ge=0,
        description=(
            "A read sets a record's access time (explicitly: noatime mounts too) when the one it"
            " has is older than this; what LRU across nodes sees. 0: every read."
        ),
    )
    temp_max_age_s: float = Field(
        600.0,
        gt=0,
        description=(
            "A temporary file older than this is a crashed writer's and is swept, whoever made it;"
            " one of a dead process of this host goes at once."
        ),
    )
    reconcile_interval_s: float = Field(
        3600.0,
        gt=0,
        description=(
            "How often some node recounts the directory to correct the shared usage ledger (drift"
            " from writers killed mid-store); also done when the ledger is missing or damaged, or"
            " says full with nothing left to evict. A recount holds the ledger for its walk of the"
            " directory: raise this for a very large directory on a slow network filesystem."
        ),
    )
    lock_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Longest wait for the shared usage ledger's lock before a store is refused (counted).",
    )
    probe_budget_ms: float = Field(
        1.0,
        ge=0,
        description=(
            "A lookup the engine needs answered in its step stats the record's file on the"
            " calling thread while such stats take at most this long on average (else it is"
            " answered asynchronously, a step later); 0: only records this process knows of."
        ),
    )
    encryption: EncryptionConfig | None = Field(None, description=ENCRYPTION_DOC)

    local_dir_field: ClassVar[str | None] = "path"

    @property
    def configured_capacity(self) -> int | None:
        return int(self.size_cap_bytes)

    def with_capacity(self, capacity_bytes: int, *, largest_record_bytes: int = 0) -> Self:
        return self._updated(size_cap_bytes=max(capacity_bytes, largest_record_bytes))

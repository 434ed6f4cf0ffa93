"""The LMDB tier's config model (``kind: lmdb``); imports nothing of the tier itself (py-lmdb)."""

from __future__ import annotations

from typing import ClassVar, Literal, Self

from pydantic import ByteSize, Field, model_validator

from tieredkv.tierconfig import (
    ENCRYPTION_DOC,
    EVICTION_POLICY_DOC,
    EncryptionConfig,
    EvictionPolicyName,
    Size,
    TierConfigBase,
)

__all__ = ["LMDBTierConfig"]


class LMDBTierConfig(TierConfigBase):
    """One LMDB environment on local disk (NVMe)."""

    kind: Literal["lmdb"] = Field("lmdb", description="Tier kind (selects the backend).")
    path: str = Field("./tieredkv-data/lmdb", description="Directory of the LMDB environment (created if missing).")
    map_size_bytes: Size = Field(
        ByteSize(4 << 30), gt=0, description="Initial LMDB map size; grown on demand up to max_map_size_bytes."
    )
    max_map_size_bytes: Size = Field(
        ByteSize(64 << 30), gt=0, description="Upper bound for map growth after MapFullError."
    )
    size_cap_bytes: Size = Field(
        ByteSize(2 << 30),
        gt=0,
        description="Stored bytes allowed before LRU eviction; must be below map_size_bytes.",
    )
    sync_mode: Literal["durable", "fast"] = Field(
        "fast",
        description="'durable': fsync every write transaction; 'fast': no fsync per commit (a power loss may lose recent puts, never corrupt older ones).",
    )
    max_readers: int = Field(126, gt=0, description="LMDB reader slots.")
    eviction_policy: EvictionPolicyName = Field("lru", description=EVICTION_POLICY_DOC)
    file_batch_bytes: Size | None = Field(
        ByteSize(16 << 20),
        description=(
            "A write batch whose payloads add up to this many bytes or more is written as one record"
            " file beside the LMDB index (files/ under path: each payload copied once, where LMDB"
            " copies it twice); None keeps every record inside LMDB."
        ),
    )
    encryption: EncryptionConfig | None = Field(None, description=ENCRYPTION_DOC)

    local_dir_field: ClassVar[str | None] = "path"

    def with_capacity(self, capacity_bytes: int, *, largest_record_bytes: int = 0) -> Self:
        """The size cap at ``capacity_bytes``; the map (and its growth limit) at least twice it,
        plus 32 MiB of headroom for LMDB's B-tree and free pages."""
        cap = max(capacity_bytes, largest_record_bytes)
        map_size = max(int(self.map_size_bytes), 2 * cap + (32 << 20))
        max_map = max(int(self.max_map_size_bytes), 2 * map_size)
        return self._updated(size_cap_bytes=cap, map_size_bytes=map_size, max_map_size_bytes=max_map)

    @model_validator(mode="after")
    def _sizes(self) -> LMDBTierConfig:
        if self.size_cap_bytes >= self.map_size_bytes:
            raise ValueError(
                f"size_cap_bytes ({int(self.size_cap_bytes)}) must be below map_size_bytes ({int(self.map_size_bytes)});"
                " LMDB needs headroom for its B-tree and free pages — raise map_size_bytes or lower size_cap_bytes"
            )
        if self.max_map_size_bytes < self.map_size_bytes:
            raise ValueError("max_map_size_bytes must be at least map_size_bytes")
        return self

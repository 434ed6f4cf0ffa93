"""The CPU tier's config model (``kind: cpu``); imports nothing of the tier itself (torch)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ByteSize, Field, model_validator

from tieredkv.tierconfig import EVICTION_POLICY_DOC, EvictionPolicyName, Size, TierConfigBase

__all__ = ["CPUTierConfig"]


class CPUTierConfig(TierConfigBase):
    """In-process slab of host memory (pinned when CUDA is available)."""

    kind: Literal["cpu"] = Field("cpu", description="Tier kind (selects the backend).")
    capacity_bytes: Size = Field(ByteSize(1 << 30), gt=0, description="Size of the preallocated slab, e.g. '8GiB'.")
    segment_bytes: Size = Field(
        ByteSize(8 << 20),
        gt=0,
        description="Slab segment size; the largest chunk must fit in one segment.",
    )
    min_slot_bytes: Size = Field(
        ByteSize(4096),
        gt=0,
        description="Smallest slot size class; classes grow by x1.5 and x2 steps up to segment_bytes.",
    )
    pin_memory: Literal["auto", "always", "never"] = Field(
        "auto", description="Pin the slab: 'auto' pins when CUDA is available."
    )
    prefault: bool = Field(
        False,
        description="Touch every slab page at open so first stores do not pay page faults (the whole slab is"
        " resident from the start; serving deployments set it, a laptop try-out need not).",
    )
    eviction_policy: EvictionPolicyName = Field("lru", description=EVICTION_POLICY_DOC)

    @property
    def configured_capacity(self) -> int | None:
        return int(self.capacity_bytes)

    def with_capacity(self, capacity_bytes: int, *, largest_record_bytes: int = 0) -> Self:
        """Segments large enough for the largest record; the slab a whole number of them, at
        least ``capacity_bytes`` plus one segment (slot classes round records up)."""
        seg = max(int(self.segment_bytes), largest_record_bytes)
        return self._updated(segment_bytes=seg, capacity_bytes=(-(-capacity_bytes // seg) + 1) * seg)

    @model_validator(mode="after")
    def _sizes(self) -> CPUTierConfig:
        if self.segment_bytes > self.capacity_bytes:
            raise ValueError(
                f"segment_bytes ({int(self.segment_bytes)}) must not exceed capacity_bytes ({int(self.capacity_bytes)})"
            )
        if self.min_slot_bytes > self.segment_bytes:
            raise ValueError("min_slot_bytes must not exceed segment_bytes")
        return self

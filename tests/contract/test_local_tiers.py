"""The tier contract against the in-process tiers: CPU slab and LMDB files."""

from __future__ import annotations

from typing import Any

import pytest

from tieredkv.backends.base import Tier
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.registry import build_tier
from tieredkv.config import CPUTierConfig, LMDBTierConfig
from tieredkv.format import SEAL_TAG
from tieredkv.testing.contract import TierContract


class TestCPUTier(TierContract):
    @pytest.fixture
    async def make_tier(self) -> Any:
        tiers: list[CPUTier] = []

        async def make(capacity_bytes: int | None) -> CPUTier:
            cap = capacity_bytes or 64 << 20
            seg = min(8 << 20, cap)
            tier = CPUTier(CPUTierConfig(capacity_bytes=cap, segment_bytes=seg, min_slot_bytes=64))
            await tier.open()
            tiers.append(tier)
            return tier

        yield make
        for t in tiers:
            await t.close()


class TestLMDBTier(TierContract):
    # "files": every write batch goes to a record file beside the index (file_batch_bytes=1);
    # the default keeps the contract's small batches inside LMDB.
    @pytest.fixture(params=["default", "files"])
    async def make_tier(self, tmp_path: Any, request: pytest.FixtureRequest) -> Any:
        tiers: list[LMDBTier] = []
        layout = {"file_batch_bytes": 1} if request.param == "files" else {}

        async def make(capacity_bytes: int | None) -> LMDBTier:
            cap = capacity_bytes or 256 << 20
            cfg = LMDBTierConfig(
                path=str(tmp_path / f"lmdb{len(tiers)}"),
                size_cap_bytes=cap,
                map_size_bytes=max(2 * cap, 16 << 20),
                **layout,
            )
            tier = LMDBTier(cfg)
            await tier.open()
            tiers.append(tier)
            return tier

        yield make
        for t in tiers:
            await t.close()


class TestSealedLMDBTier(TierContract):
    """LMDB with encryption (the registry wraps the tier: SealedTier; records stored whole)."""

    record_tail = SEAL_TAG

    @pytest.fixture
    async def make_tier(self, tmp_path: Any, sealed_keys_file: str) -> Any:
        tiers: list[Tier] = []

        async def make(capacity_bytes: int | None) -> Tier:
            cap = capacity_bytes or 256 << 20
            cfg = LMDBTierConfig(
                path=str(tmp_path / f"lmdb{len(tiers)}"),
                size_cap_bytes=cap,
                map_size_bytes=max(2 * cap, 16 << 20),
                encryption={"keys_file": sealed_keys_file},
            )
            tier = build_tier(cfg)
            await tier.open()
            tiers.append(tier)
            return tier

        yield make
        for t in tiers:
            await t.close()

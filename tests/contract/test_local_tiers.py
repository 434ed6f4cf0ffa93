"""The tier contract against the in-process tiers: CPU slab and LMDB files."""

from __future__ import annotations

from typing import Any

import pytest

from tieredkv.backends.base import Tier
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.registry import build_tier
from tieredkv.config import CPUTierConfig, FSTierConfig, LMDBTierConfig
from tieredkv.format import SEAL_TAG
from tieredkv.testing.contract import TierContract, made_tiers


class TestCPUTier(TierContract):
    @pytest.fixture
    async def make_tier(self) -> Any:
        def build(capacity_bytes: int | None, _: int) -> Tier:
            cap = capacity_bytes or 64 << 20
            return CPUTier(CPUTierConfig(capacity_bytes=cap, segment_bytes=min(8 << 20, cap), min_slot_bytes=64))

        async with made_tiers(build) as make:
            yield make


def _lmdb(path: Any, capacity_bytes: int | None, **extra: Any) -> Tier:
    cap = capacity_bytes or 256 << 20
    return build_tier(
        LMDBTierConfig(path=str(path), size_cap_bytes=cap, map_size_bytes=max(2 * cap, 16 << 20), **extra)
    )


class TestLMDBTier(TierContract):
    # "files": every write batch goes to a record file beside the index (file_batch_bytes=1);
    # the default keeps the contract's small batches inside LMDB.
    @pytest.fixture(params=["default", "files"])
    async def make_tier(self, tmp_path: Any, request: pytest.FixtureRequest) -> Any:
        layout = {"file_batch_bytes": 1} if request.param == "files" else {}
        async with made_tiers(lambda cap, n: _lmdb(tmp_path / f"lmdb{n}", cap, **layout)) as make:
            yield make


class TestSealedLMDBTier(TierContract):
    """LMDB with encryption (the registry wraps the tier: SealedTier; records stored whole)."""

    record_tail = SEAL_TAG

    @pytest.fixture
    async def make_tier(self, tmp_path: Any, sealed_keys_file: str) -> Any:
        sealed = {"encryption": {"keys_file": sealed_keys_file}}
        async with made_tiers(lambda cap, n: _lmdb(tmp_path / f"lmdb{n}", cap, **sealed)) as make:
            yield make


def _fs(path: Any, capacity_bytes: int | None, **extra: Any) -> Tier:
    return build_tier(FSTierConfig(path=str(path), size_cap_bytes=capacity_bytes or 256 << 20, **extra))


class TestFSTier(TierContract):
    @pytest.fixture(params=["fast", "durable"])
    async def make_tier(self, tmp_path: Any, request: pytest.FixtureRequest) -> Any:
        async with made_tiers(lambda cap, n: _fs(tmp_path / f"fs{n}", cap, sync_mode=request.param)) as make:
            yield make


class TestSealedFSTier(TierContract):
    """fs with encryption (SealedTier around it; records stored whole)."""

    record_tail = SEAL_TAG

    @pytest.fixture
    async def make_tier(self, tmp_path: Any, sealed_keys_file: str) -> Any:
        sealed = {"encryption": {"keys_file": sealed_keys_file}}
        async with made_tiers(lambda cap, n: _fs(tmp_path / f"fs{n}", cap, **sealed)) as make:
            yield make

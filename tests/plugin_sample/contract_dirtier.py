"""The tier contract against DirTier: the one test class a new tier kind needs.

In a plug-in of one's own this is ``tests/test_contract.py``; here it is named so that
tieredkv's own test run does not collect it where the plug-in is not installed
(tests/integration/test_plugin_tier.py installs the plug-in and runs this file).
"""

from __future__ import annotations

from typing import Any

import pytest
from tieredkv_dirtier import DirTier, DirTierConfig

from tieredkv.testing.contract import TierContract


class TestDirTier(TierContract):
    @pytest.fixture
    async def make_tier(self, tmp_path: Any) -> Any:
        tiers: list[DirTier] = []

        async def make(capacity_bytes: int | None) -> DirTier:
            root = str(tmp_path / f"dir{len(tiers)}")
            tier = DirTier(DirTierConfig(root=root, capacity_bytes=capacity_bytes or 256 << 20))
            await tier.open()
            tiers.append(tier)
            return tier

        yield make
        for t in tiers:
            await t.close()

"""The eviction-policy seam: LRUPolicy online and offline, plan_eviction, and a second policy
registered in ``eviction.policies`` driving the CPU and LMDB tiers through their config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tieredkv import eviction
from tieredkv.backends.base import RecordInfo
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, load_config
from tieredkv.errors import ConfigError
from tieredkv.eviction import LRUPolicy, make_policy, plan_eviction
from tieredkv.keys import Namespace

NS = Namespace(model="eviction-test")


def key(i: int) -> bytes:
    return NS.key(i.to_bytes(32, "big"), 0)


class FIFOPolicy(LRUPolicy):
    """First in, first out: a read does not move a record (the whole policy is this override)."""

    name = "fifo"

    def touch(self, key: bytes) -> None:
        pass


@pytest.fixture
def fifo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(eviction.policies, "fifo", FIFOPolicy)
    yield


# ---- LRUPolicy online ------------------------------------------------------------------------


def test_lru_order_touch_overwrite_and_remove() -> None:
    p = make_policy("lru")
    for k, size in [(b"a", 10), (b"b", 20), (b"c", 30)]:
        p.insert(k, size)
    assert list(p.victims()) == [b"a", b"b", b"c"] and p.total_bytes == 60 and len(p) == 3
    p.touch(b"a")
    p.touch(b"zz")  # unknown: ignored
    assert list(p.victims()) == [b"b", b"c", b"a"] and b"zz" not in p
    p.insert(b"b", 5)  # an overwrite is a fresh write: newest, with its new size
    assert list(p.victims()) == [b"c", b"a", b"b"] and p.total_bytes == 45
    assert p.remove(b"c") == 30 and p.remove(b"c") == 0
    assert list(p.victims()) == [b"a", b"b"] and p.total_bytes == 15 and len(p) == 2
    assert b"a" in p and b"c" not in p


def test_lru_from_entries_and_unknown_policy_names_the_known_ones() -> None:
    p = LRUPolicy([(b"x", 3), (b"y", 4)])
    assert list(p.victims()) == [b"x", b"y"] and p.total_bytes == 7
    with pytest.raises(ValueError, match=r"unknown eviction policy 'arc'; known: \['lru'\]"):
        make_policy("arc")


# ---- offline: rank and plan_eviction ------------------------------------------------------------


def infos() -> list[RecordInfo]:
    # stamps: None (unknown: counts as oldest), 100, 200, 300; 10 bytes each
    return [
        RecordInfo(b"k3", 10, 300.0),
        RecordInfo(b"k0", 10, None),
        RecordInfo(b"k2", 10, 200.0),
        RecordInfo(b"k1", 10, 100.0),
    ]


def test_rank_puts_unstamped_first_then_oldest() -> None:
    assert [i.key for i in LRUPolicy().rank(infos())] == [b"k0", b"k1", b"k2", b"k3"]


def test_plan_without_limits_takes_everything() -> None:
    assert {i.key for i in plan_eviction(infos(), now=1000.0)} == {b"k0", b"k1", b"k2", b"k3"}


def test_plan_older_than_skips_records_without_a_stamp() -> None:
    got = plan_eviction(infos(), now=1000.0, older_than=750.0)  # older than t=250
    assert sorted(i.key for i in got) == [b"k1", b"k2"]


def test_plan_to_size_takes_in_policy_order_until_the_rest_fits() -> None:
    assert [i.key for i in plan_eviction(infos(), now=1000.0, to_size=25)] == [b"k0", b"k1"]
    assert plan_eviction(infos(), now=1000.0, to_size=40) == []
    # record_bytes counts what the medium holds (e.g. header + payload)
    got = plan_eviction(infos(), now=1000.0, to_size=25, record_bytes=lambda i: i.size + 64)
    assert [i.key for i in got] == [b"k0", b"k1", b"k2", b"k3"]


def test_plan_older_than_and_to_size_combine() -> None:
    got = plan_eviction(infos(), now=1000.0, older_than=850.0, to_size=20)  # k1 by age, then k0
    assert [i.key for i in got] == [b"k1", b"k0"]


def test_plan_uses_the_policy_given() -> None:
    class NewestFirst(LRUPolicy):
        def rank(self, infos_: object) -> list[RecordInfo]:
            return sorted(infos_, key=lambda i: -(i.stamp or 0.0))  # type: ignore[attr-defined]

    got = plan_eviction(infos(), now=1000.0, to_size=30, policy=NewestFirst())
    assert [i.key for i in got] == [b"k3"]


# ---- the config names a policy -------------------------------------------------------------------


def test_config_refuses_an_unknown_policy_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "cpu", "eviction_policy": "fifo"}]}, env={})
    msg = str(ei.value)
    assert "tiers.0.eviction_policy: got 'fifo'" in msg and "known: ['lru']" in msg
    assert "tieredkv.eviction.policies" in msg


def test_a_registered_policy_validates_in_config(fifo: None) -> None:
    cfg = load_config({"tiers": [{"kind": "lmdb", "eviction_policy": "fifo"}]}, env={})
    assert cfg.tiers[0].eviction_policy == "fifo"
    assert load_config(env={}).tiers[0].eviction_policy == "lru"


# ---- a second policy drives the tiers -------------------------------------------------------------

CHUNK = 60 * 1024  # + 64-byte header: the 64 KiB slot class; 4 per 256 KiB segment


async def _fill_read_first_then_overflow(tier: CPUTier | LMDBTier, n: int) -> list[bool]:
    """Store n records (the tier holds exactly n), read the first, store one more: which stayed?"""
    data = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8)
    for i in range(n):
        await tier.put_many([(key(i), data)])
    assert await tier.get_many([key(0)]) == [data.numpy().tobytes()]
    await tier.put_many([(key(n), data)])
    return await tier.contains_many([key(i) for i in range(n + 1)])


def _cpu(policy: str) -> CPUTier:
    seg = 256 * 1024
    return CPUTier(
        CPUTierConfig(capacity_bytes=2 * seg, segment_bytes=seg, min_slot_bytes=64 * 1024, eviction_policy=policy)
    )


@pytest.mark.parametrize(("policy", "evicted"), [("lru", 1), ("fifo", 0)])
async def test_cpu_tier_evicts_in_the_order_of_its_configured_policy(fifo: None, policy: str, evicted: int) -> None:
    async with _cpu(policy) as tier:
        present = await _fill_read_first_then_overflow(tier, 8)
        assert [i for i, p in enumerate(present) if not p] == [evicted]
        assert tier.counters["evictions"] == 1


@pytest.mark.parametrize(("policy", "evicted", "then"), [("lru", 1, 2), ("fifo", 0, 1)])
async def test_lmdb_tier_evicts_in_the_order_of_its_configured_policy(
    fifo: None, tmp_path: Path, policy: str, evicted: int, then: int
) -> None:
    rec = CHUNK + 64
    cfg = LMDBTierConfig(
        path=str(tmp_path / "kv"), size_cap_bytes=4 * rec, map_size_bytes="16MiB", eviction_policy=policy
    )
    async with LMDBTier(cfg) as tier:
        present = await _fill_read_first_then_overflow(tier, 4)
        assert [i for i, p in enumerate(present) if not p] == [evicted]
    # Reopened, the order comes back from the shared access stamps (the read of key 0 was stamped)
    # through the policy's rank: LRU now evicts key 2 (key 0 was read after it), FIFO key 1.
    async with LMDBTier(cfg) as tier:
        await tier.put_many([(key(100), torch.zeros(CHUNK, dtype=torch.uint8))])
        present = await tier.contains_many([key(i) for i in range(5)])
        assert [i for i, p in enumerate(present) if not p] == sorted([evicted, then])

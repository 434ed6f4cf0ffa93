"""Corruption drill: random bit flips, truncations and extensions of stored records.

Hundreds of records in the CPU, LMDB, single-node Redis and Redis Cluster tiers are damaged
through ``raw_get_many`` / ``raw_put_many`` (the bytes exactly as stored). Every damaged record
must be detected on read: a miss (never the bytes), deleted from the tier, and counted in
``counters["corrupt"]`` — one count per damaged record. Undamaged neighbours are still served
byte for byte.

Flips land anywhere in the record, the reserved header bytes (48..63, which must be zero)
included.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.drills._util import NS, check_payload, payload, report
from tieredkv.backends.base import Tier
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, RedisTierConfig
from tieredkv.errors import CorruptRecordError
from tieredkv.format import HEADER_SIZE, encode_record, verify_record
from tieredkv.testing.servers import RedisCluster, RedisServer

pytestmark = [pytest.mark.timeout(120)]

DAMAGED = {"cpu": 200, "lmdb": 200, "redis": 150, "redis-cluster": 90}
CONTROLS = 30


def _mutate(rec: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random damage: 1-3 flipped bits, a truncation, or appended garbage."""
    kind = rng.choices(["flip", "truncate", "extend"], weights=[6, 3, 1])[0]
    if kind == "truncate":
        return kind, rec[: rng.randrange(len(rec))]
    if kind == "extend":
        return kind, rec + rng.randbytes(rng.randint(1, 100))
    out = bytearray(rec)
    for pos in rng.sample(range(len(out)), rng.randint(1, 3)):
        out[pos] ^= 1 << rng.randrange(8)
    return kind, bytes(out)


@pytest_asyncio.fixture(params=list(DAMAGED))
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    name = request.param
    prefix = f"drill{uuid.uuid4().hex[:8]}"
    t: Tier
    if name == "cpu":
        t = CPUTier(CPUTierConfig(capacity_bytes="16MiB", segment_bytes="1MiB"))
    elif name == "lmdb":
        t = LMDBTier(LMDBTierConfig(path=str(tmp_path / "lmdb"), map_size_bytes="32MiB", size_cap_bytes="16MiB"))
    elif name == "redis":
        srv: RedisServer = request.getfixturevalue("redis_server")
        t = RedisTier(RedisTierConfig(url=srv.url, key_prefix=prefix))
    else:
        c: RedisCluster = request.getfixturevalue("redis_cluster")
        t = RedisTier(RedisTierConfig(url=c.url, cluster=True, key_prefix=prefix, hash_tag_buckets=64))
    t.name = name
    async with t:
        yield t
        if t.kind == "redis":
            await t.delete_many([k for k in [i.key async for i in t.scan(NS)]])


async def test_every_damaged_record_is_a_counted_deleted_miss(tier: Tier) -> None:
    rng = random.Random(f"corrupt-{tier.name}")
    n = DAMAGED[tier.name]
    idx = list(range(n + CONTROLS))
    keys = [NS.key(rng.randbytes(32), i % 3) for i in idx]
    index = {k: i for i, k in zip(idx, keys)}
    await tier.put_many([(k, payload(i, 1, rng.choice([64, 700, 4096, 20000]))) for i, k in zip(idx, keys)])
    damaged, controls = keys[:n], keys[n:]
    raw = await tier.raw_get_many(damaged)
    kinds: Counter[str] = Counter()
    bad: list[tuple[bytes, bytes]] = []
    for k, rec in zip(damaged, raw):
        assert rec is not None
        kind, mutated = _mutate(rec, rng)
        assert mutated != rec
        kinds[kind] += 1
        bad.append((k, mutated))
    await tier.raw_put_many(bad)
    before = tier.counters["corrupt"]

    got = await tier.get_many(damaged)
    served = [k for k, g in zip(damaged, got) if g is not None]
    assert not served, f"{len(served)} damaged records were served"
    detected = tier.counters["corrupt"] - before
    assert detected == n, f"corrupt counter moved by {detected}, expected {n}"
    assert not any(await tier.contains_many(damaged)), "damaged records must be deleted"
    assert await tier.raw_get_many(damaged) == [None] * n
    # A second read is a plain miss (nothing left to count).
    assert await tier.get_many(damaged[:10]) == [None] * 10 and tier.counters["corrupt"] - before == n
    # Neighbours are untouched and served byte for byte, also into caller buffers.
    for k, data in zip(controls, await tier.get_many(controls)):
        assert data is not None and check_payload(index[k], data) == 1
    bufs = [bytearray(20000) for _ in controls]
    lens = await tier.get_many(controls, into=bufs)
    for k, b, n_ in zip(controls, bufs, lens):
        assert n_ is not None and check_payload(index[k], bytes(b[:n_])) == 1
    report(f"corruption[{tier.name}]", damaged=n, detected=detected, served=len(served), **dict(kinds))


@pytest.mark.parametrize("offset", [48, 55, 63])
def test_flip_in_reserved_header_bytes_is_detected(offset: int) -> None:
    key = NS.key(b"\x07" * 32, 0)
    rec = bytearray(encode_record(key, b"payload bytes" * 10))
    rec[offset] ^= 0x10
    with pytest.raises(CorruptRecordError):
        verify_record(bytes(rec), key)


def test_mutator_covers_header_and_payload() -> None:
    """The drill's damage reaches every checked header field, not just the payload."""
    rng = random.Random(1)
    rec = bytes(encode_record(NS.key(b"\x01" * 32, 0), b"x" * 200))
    hit: set[int] = set()
    for _ in range(3000):
        kind, m = _mutate(rec, rng)
        if kind == "flip":
            hit.update(i for i in range(len(rec)) if m[i] != rec[i])
    assert all(i in hit for i in range(HEADER_SIZE))

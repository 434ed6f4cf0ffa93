"""``tieredkv verify --repair`` on a Redis tier that an engine is writing: a record is deleted only
while it still holds the bytes that failed (compare-and-delete), so no good record written by
anyone since the scrub read it is lost; a record that fails only once (rewritten meanwhile) is
read again before it is reported.

* a deterministic race: a good record lands between the scrub's read and its deletion (a fault
  hook around the real tier's delete calls), on a single server and a cluster;
* a live drill: a writer process alternates good and damaged records on part of its keys while
  the real CLI scrubs and repairs the server again and again.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.drills._redis_writer import GOOD, KEYSPACE, damaged, key
from tests.drills._util import Child, check_payload, payload, report
from tests.integration.test_cli_admin import redis_tier, run_json, write_config
from tieredkv.backends.base import Tier
from tieredkv.backends.redis import RedisTier
from tieredkv.cli import ops
from tieredkv.config import RedisTierConfig, load_config
from tieredkv.testing.servers import RedisCluster, RedisServer

pytestmark = [pytest.mark.timeout(180)]

WRITER = Path(__file__).with_name("_redis_writer.py")


def _tier(url: str, prefix: str, cluster: bool = False) -> RedisTier:
    return RedisTier(RedisTierConfig(url=url, key_prefix=prefix, cluster=cluster, socket_timeout_s=5.0))


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_repair_keeps_a_record_rewritten_between_the_scrub_and_the_delete(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv: RedisServer | RedisCluster = request.getfixturevalue("redis_server" if where == "single" else "redis_cluster")
    prefix = "rep" + uuid.uuid4().hex[:8]
    cluster = where == "cluster"
    cfg_path = write_config(tmp_path, redis_tier(srv.url, "r", cluster=cluster, prefix=prefix))
    rewritten, stays_bad = [key(i) for i in range(4)], [key(i) for i in range(4, 8)]

    async def seed() -> None:
        async with _tier(srv.url, prefix, cluster) as t:
            await t.raw_put_many([(key(i), damaged(i, 1)) for i in range(8)])

    asyncio.run(seed())

    async def an_engine_writes(keys: Sequence[bytes]) -> None:
        async with _tier(srv.url, prefix, cluster) as t:
            await t.put_many([(k, payload(i, 2, 2048)) for i, k in enumerate(rewritten) if k in keys])

    originals = {name: getattr(Tier, name) for name in ("delete_many", "delete_if_same")}

    def racing(name: str) -> Any:
        async def call(self: Tier, items: Sequence[Any]) -> int:  # an engine's write lands first
            await an_engine_writes([it if isinstance(it, bytes) else it[0] for it in items])
            return await originals[name](self, items)

        return call

    for name in originals:
        monkeypatch.setattr(Tier, name, racing(name))
    result = asyncio.run(ops.verify(load_config(cfg_path), None, None, None, repair=True))
    monkeypatch.undo()

    async def after() -> list[bytes | None]:
        async with _tier(srv.url, prefix, cluster) as t:
            return await t.get_many(rewritten + stays_bad)

    got = asyncio.run(after())
    (row,) = result.tiers
    assert row.corrupt == 8 and row.repaired == 4, row
    assert got[:4] == [payload(i, 2, 2048) for i in range(4)], "a good record written after the scrub was deleted"
    assert got[4:] == [None] * 4


def test_live_repair_while_a_writer_alternates_good_and_damaged_records(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    prefix = "live" + uuid.uuid4().hex[:8]
    cfg_path = write_config(tmp_path, redis_tier(redis_server.url, "r", prefix=prefix))
    writer = Child([sys.executable, str(WRITER), redis_server.url, prefix, "7"], stdin=True)
    runs: list[dict[str, Any]] = []
    try:
        writer.wait_ready(60)
        while len(runs) < 8 or sum(r["tiers"][0]["repaired"] for r in runs) == 0:
            assert len(runs) < 40, "no scrub ever found a damaged record to repair"
            runs.append(run_json("verify", "-c", str(cfg_path), "--repair"))
        assert writer.proc.stdin is not None
        writer.proc.stdin.close()
        assert writer.proc.wait(60) == 0, writer.stderr()
    finally:
        writer.kill()
    lines = [line.split() for line in writer.lines]
    final = run_json("verify", "-c", str(cfg_path), "--repair")  # the writer is gone: what is left
    last: dict[int, tuple[str, int]] = {}
    for parts in lines:
        if parts and parts[0] in ("P", "X"):
            last[int(parts[1])] = (parts[0], int(parts[2]))

    async def contents() -> list[bytes | None]:
        async with _tier(redis_server.url, prefix) as t:
            return await t.get_many([key(i) for i in range(KEYSPACE)])

    held = asyncio.run(contents())
    false_reports = [c for r in runs for c in r["corrupt"] if c["key"] in {key(i).hex() for i in range(GOOD)}]
    lost = wrong = 0
    for i, got in enumerate(held):
        what = last.get(i)
        if what is None or what[0] == "X":
            assert got is None, f"key {i}: a damaged record outlived the last repair"
            continue
        if got is None:
            lost += 1
        elif check_payload(i, got) != what[1]:
            wrong += 1
    repaired = sum(r["tiers"][0]["repaired"] for r in [*runs, final])
    report(
        "redis-live-repair",
        scrubs=len(runs) + 1,
        writes=sum(1 for p in lines if p and p[0] in "PX"),
        repaired=repaired,
        false_corrupt=len(false_reports),
        good_lost=lost,
        wrong=wrong,
    )
    assert false_reports == [] and lost == 0 and wrong == 0
    assert final["tiers"][0]["corrupt"] == final["tiers"][0]["repaired"]

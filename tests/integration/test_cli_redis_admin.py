"""The admin CLI on Redis, where the server keeps the ages: listing must not touch a record
(so ``evict --older-than`` / ``--to-size`` see real idle times), ``ls --limit`` must stop after
its page, and ``status`` must count our records, not the whole database."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.integration.test_cli_admin import present, redis_tier, run, run_json, seed, write_config
from tieredkv.backends.redis.keys import redis_key
from tieredkv.format import HEADER_SIZE, encode_record
from tieredkv.keys import Namespace
from tieredkv.testing.servers import RedisCluster, RedisServer, redis_command

#: Generous bound for a condition that takes seconds on an idle machine.
WAIT_S = 90.0


def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Ages:
    """``OBJECT IDLETIME`` of our records, asked of the node that owns each key (it does not touch)."""

    def __init__(self, ports: list[int], prefix: str) -> None:
        self.ports, self.prefix = ports, prefix.encode()

    def idle(self, key: bytes) -> int:
        rk = redis_key(self.prefix, key, 16)
        for port in self.ports:
            reply = redis_command(port, "OBJECT", "IDLETIME", rk)
            if reply.startswith(b":"):
                return int(reply[1:])
        raise AssertionError(f"no node answered OBJECT IDLETIME for {rk!r}")


@pytest.fixture(params=["single", "cluster"])
def redis_cfg(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str, Ages]:
    prefix = "ages" + uuid.uuid4().hex[:8]
    if request.param == "single":
        srv: RedisServer = request.getfixturevalue("redis_server")
        return write_config(tmp_path, redis_tier(srv.url, "shared", prefix=prefix)), "shared", Ages([srv.port], prefix)
    cl: RedisCluster = request.getfixturevalue("redis_cluster")
    cfg = write_config(tmp_path, redis_tier(cl.url, "cluster", cluster=True, prefix=prefix))
    return cfg, "cluster", Ages([p for _, p in cl.nodes], prefix)


def ages(cfg: Path) -> dict[str, float]:
    return {r["key"]: r["age_s"] for r in run_json("ls", "-c", str(cfg), "--limit", "100")["records"]}


def test_redis_ages_grow_survive_ls_and_drive_evict(redis_cfg: tuple[Path, str, Ages]) -> None:
    cfg, tier, idle = redis_cfg
    (old,) = seed(cfg, tier, 1, groups=1)
    wait_for(lambda: idle.idle(old) >= 3, "the first record to idle 3 s")
    (mid,) = seed(cfg, tier, 1, groups=1, start=1)
    # 6 s apart: the --older-than cut below leaves the youngest record 4.5 s of slack, which the
    # CLI's start on a busy machine (seconds, under a parallel suite) must not use up
    wait_for(lambda: idle.idle(mid) >= 6, "the second record to idle 6 s")
    (new,) = seed(cfg, tier, 1, groups=1, start=2)

    before = {k: idle.idle(k) for k in (old, mid, new)}
    first = ages(cfg)
    after = {k: idle.idle(k) for k in (old, mid, new)}
    # the CLI's age is the server's idle time (whole seconds, on a clock that ticks ~10 times a second)
    for k in (old, mid, new):
        assert before[k] - 1.5 <= first[k.hex()] <= after[k] + 1.5, (k, before, first, after)
    assert first[old.hex()] >= 5 and first[mid.hex()] >= 2 and first[new.hex()] < first[mid.hex()] < first[old.hex()]
    # ls did not touch: the server's idle clock did not restart, and the age keeps growing
    assert idle.idle(old) >= first[old.hex()] - 1
    wait_for(lambda: idle.idle(old) >= first[old.hex()] + 2, "the age to grow past the first ls")
    second = ages(cfg)
    assert second[old.hex()] >= first[old.hex()] + 2, (first, second)

    # --to-size keeps the two most recently used (all three are the same size): the oldest goes
    (size,) = {r["size"] for r in run_json("ls", "-c", str(cfg))["records"]}
    s = run_json("evict", "-c", str(cfg), "--to-size", str(2 * (HEADER_SIZE + size)))
    assert s["tiers"][0]["evicted"] == 1
    assert present(cfg, tier, [old, mid, new]) == [False, True, True]

    # --older-than between the other two ages removes the older one only
    now = ages(cfg)
    assert now[mid.hex()] - now[new.hex()] >= 5  # 6 s apart, read on a clock of whole seconds
    cut = now[new.hex()] + 4.5  # the middle one is older than the cut by at least 0.5 s
    s = run_json("evict", "-c", str(cfg), "--older-than", f"{cut:.1f}s")
    assert s["tiers"][0]["evicted"] == 1 and s["tiers"][0]["no_age"] == 0
    assert present(cfg, tier, [old, mid, new]) == [False, False, True]


# ---- bounded work ----------------------------------------------------------------------------


def _commandstats(port: int) -> dict[str, tuple[int, int]]:
    """``{command: (calls, usec)}`` from ``INFO commandstats``."""
    text = redis_command(port, "INFO", "commandstats").decode()
    return {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"cmdstat_([a-z|_-]+):calls=(\d+),usec=(\d+)", text)
    }


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {
        k: (c - before.get(k, (0, 0))[0], u - before.get(k, (0, 0))[1])
        for k, (c, u) in after.items()
        if (c, u) != before.get(k, (0, 0))
    }


async def _load(url: str, prefix: str, namespaces: list[Namespace], per_ns: int, foreign: int) -> None:
    """``per_ns`` real records per namespace plus ``foreign`` keys of another application, pipelined."""
    client = aioredis.Redis.from_url(url)
    try:
        for ns in namespaces:
            for start in range(0, per_ns, 10_000):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + 10_000, per_ns)):
                    key = ns.key(i.to_bytes(8, "big"), 0)
                    pipe.set(redis_key(prefix.encode(), key, 16), encode_record(key, b"p" * 16))
                await pipe.execute()
        pipe = client.pipeline(transaction=False)
        for i in range(foreign):
            pipe.set(f"otherapp:{i}", b"x" * 100)
        await pipe.execute()
    finally:
        await client.aclose()


def test_ls_limit_is_bounded_and_status_counts_only_our_keys(tmp_path: Path) -> None:
    prefix = "big"
    nss = [Namespace(model="test/bounded-a"), Namespace(model="test/bounded-b")]
    with RedisServer() as srv:
        asyncio.run(_load(srv.url, prefix, nss, 50_000, 5_000))
        assert int(redis_command(srv.port, "DBSIZE")[1:]) == 105_000
        cfg = write_config(tmp_path, redis_tier(srv.url, "shared", prefix=prefix))

        before = _commandstats(srv.port)
        page = run_json("ls", "-c", str(cfg), "--limit", "5")
        spent = _delta(before, _commandstats(srv.port))
        assert len(page["records"]) == 5 and page["next_offset"] == 5 and page["total"] is None
        usec = sum(u for _, u in spent.values())
        touched = sum(c for k, (c, _) in spent.items() if k not in ("scan", "info", "ping", "hello", "client|setinfo"))
        # one SCAN page (COUNT 1000) and its keys, never the 100 000: well under a second of server work
        assert spent["scan"][0] <= 3 and touched <= 3000 and usec < 200_000, spent

        st = run_json("status", "-c", str(cfg))["tiers"][0]
        assert st["records"] == 100_000 and st["extra"]["db_keys"] == 105_000
        assert st["records_by_namespace"] == {ns.fingerprint.hex(): 50_000 for ns in nss}
        assert "by scan" in st["records_scope"]

        human = run("status", "-c", str(cfg))
        assert human.returncode == 0 and "100000" in human.stdout and "by scan" in human.stderr

"""Redis fault drills: a server killed and restarted mid-load, a cluster master killed (with and
without replicas), and a stalled server (SIGSTOP) — no exception reaches the caller, no wrong
byte is served, deadlines fire, breakers open and heal.

Complements tests/integration/test_redis_tier.py (tier-level dead server / cluster node kill)
and tests/integration/test_pipeline.py (single-chunk stores while Redis is down).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from redis.crc import key_slot

from tests.drills._util import NS, block_hash, check_payload, payload, report, wait_jobs
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import CPUTierConfig, PipelineConfig, PolicyRule, RedisTierConfig
from tieredkv.errors import TierUnavailableError
from tieredkv.pipeline import Pipeline
from tieredkv.policy import TierPolicy
from tieredkv.testing.servers import RedisCluster, RedisServer, redis_command

pytestmark = [pytest.mark.timeout(120)]

SIZE = 4096


def _redis_cfg(url: str, **kw: Any) -> RedisTierConfig:
    base = {
        "url": url,
        "key_prefix": f"drill{uuid.uuid4().hex[:8]}",
        "socket_timeout_s": 0.5,
        "connect_timeout_s": 0.2,
        "op_timeout_s": 2.0,
    }
    return RedisTierConfig(**{**base, **kw})


def _pipeline(red: RedisTier, **cfg: Any) -> Pipeline:
    """CPU + Redis; group 0 writes through both, group 1 (sliding window) lives in Redis only."""
    cpu = CPUTier(CPUTierConfig(capacity_bytes="32MiB", segment_bytes="1MiB"))
    pol = TierPolicy([PolicyRule(kinds=["sliding_window"], tiers=["redis"]), PolicyRule()], ["cpu", "redis"])
    pol.route(1, SIZE, "sliding_window")
    pol.route(0, SIZE, "full")
    pcfg = PipelineConfig(**{"breaker_failures": 2, "breaker_reset_s": 0.3, "job_timeout_s": 10.0, **cfg})
    return Pipeline([cpu, red], pol, pcfg)


def _key(i: int) -> bytes:
    return NS.key(block_hash(i), i % 2)


def test_single_node_killed_and_restarted_mid_load() -> None:
    """A key-heavy put/get load while Redis is SIGKILLed and restarted twice."""
    rng = random.Random("kill-restart")
    with RedisServer() as srv:
        red = RedisTier(_redis_cfg(srv.url))
        p = _pipeline(red).start()
        try:
            written: list[int] = []
            job = 0
            counts = {"jobs": 0, "keys_served": 0, "keys_missed": 0, "redis_served": 0, "wrong_bytes": 0}
            seen_states: list[str] = []
            events = {30: "kill", 60: "restart", 90: "kill", 120: "restart"}
            heal_s: list[float] = []
            restarted_at = None
            for it in range(160):
                if events.get(it) == "kill":
                    srv.kill()
                elif events.get(it) == "restart":
                    srv.restart()
                    restarted_at = time.monotonic()
                new = list(range(it * 16, it * 16 + 16))
                job += 1
                put_id = job
                assert p.submit_put(put_id, [(_key(i), payload(i, 1, SIZE)) for i in new])
                reads = rng.sample(written, min(16, len(written))) + new[:4]
                bufs = [bytearray(SIZE) for _ in reads]
                job += 1
                assert p.submit_get(job, [(_key(i), b) for i, b in zip(reads, bufs)])
                res = wait_jobs(p, {put_id, job})
                counts["jobs"] += 2
                got = res[job]
                by_key = {_key(i): (i, b) for i, b in zip(reads, bufs)}
                for k in got.done:
                    i, b = by_key[k]
                    try:
                        check_payload(i, bytes(b))
                    except AssertionError:
                        counts["wrong_bytes"] += 1
                counts["keys_served"] += len(got.done)
                counts["keys_missed"] += len(got.failed)
                counts["redis_served"] += got.tiers.get("redis", 0)
                written += new
                state = p.breaker_states()["redis"]
                seen_states.append(state)
                if restarted_at is not None and state == "closed" and res[put_id].tiers.get("redis") == 16:
                    heal_s.append(time.monotonic() - restarted_at)
                    restarted_at = None
                time.sleep(0.01)
            st = p.stats()
        finally:
            p.close()
        assert counts["wrong_bytes"] == 0
        assert "open" in seen_states[30:60] and "open" in seen_states[90:120], "the breaker never opened"
        assert len(heal_s) == 2 and max(heal_s) < 5.0, f"breaker healed after restarts: {heal_s}"
        assert seen_states[-1] == "closed"
        assert counts["redis_served"] > 0 and st.dropped["redis"] > 0
        report(
            "redis-kill-restart",
            kills=2,
            **counts,
            dropped_stores=st.dropped["redis"],
            breaker_opens=st.lanes["redis"].breaker_opens,
            heal_s=[round(h, 2) for h in heal_s],
        )


def test_stalled_server_deadlines_fire_and_nothing_hangs() -> None:
    """SIGSTOP the server: every operation fails within its deadline; the pipeline job fails
    cleanly; after SIGCONT the same client serves the right bytes (no stale reply mixed in)."""
    with RedisServer() as srv:
        cfg = _redis_cfg(srv.url, socket_timeout_s=0.5, op_timeout_s=1.0)
        keys = [_key(i) for i in range(1, 41, 2)]  # group 1: Redis only
        bound = cfg.op_timeout_s + 1.0  # the deadline plus scheduling slack on a busy 2-core box

        async def direct() -> dict[str, float]:
            async with RedisTier(cfg) as tier:
                await tier.put_many([(k, payload(i, 1, SIZE)) for i, k in zip(range(1, 41, 2), keys)])
                assert srv.pid is not None
                os.kill(srv.pid, signal.SIGSTOP)
                took: dict[str, float] = {}
                try:
                    for name, op in (
                        ("get", tier.get_many(keys)),
                        ("put", tier.put_many([(keys[0], b"x")])),
                        ("contains", tier.contains_many(keys)),
                    ):
                        t0 = time.perf_counter()
                        with pytest.raises(TierUnavailableError):
                            await op
                        took[name] = time.perf_counter() - t0
                finally:
                    os.kill(srv.pid, signal.SIGCONT)
                got = await tier.get_many(keys)
                for i, g in zip(range(1, 41, 2), got):
                    assert g is not None and check_payload(i, g) == 1
                assert tier.counters["corrupt"] == 0
                return took

        took = asyncio.run(direct())
        assert max(took.values()) < bound, took

        red = RedisTier(cfg)
        p = _pipeline(red).start()
        stopped = False
        try:
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGSTOP)
            stopped = True
            t0 = time.perf_counter()
            bufs = [bytearray(SIZE) for _ in keys]
            assert p.submit_get(1, list(zip(keys, bufs)))
            assert p.submit_put(2, [(_key(0), payload(0, 1, SIZE)), (_key(1001), payload(1001, 1, SIZE))])
            assert time.perf_counter() - t0 < 0.1, "submit must return at once"
            res = wait_jobs(p, {1, 2}, timeout=bound + 3)
            job_s = time.perf_counter() - t0
            assert not res[1].ok and res[1].done == () and res[1].error
            assert res[2].done == (_key(0),)  # the CPU tier took group 0; group 1 (Redis) dropped
            t1 = time.perf_counter()
            p.close(timeout=bound + 1)
            close_s = time.perf_counter() - t1
        finally:
            if stopped:
                os.kill(srv.pid, signal.SIGCONT)
            p.close()
        assert job_s < bound + 1 and close_s < bound + 3
        report(
            "redis-sigstop",
            ops_timed_out=len(took),
            max_op_s=round(max(took.values()), 2),
            pipeline_job_s=round(job_s, 2),
            close_s=round(close_s, 2),
            bound_s=bound,
        )


# ---- Redis Cluster -------------------------------------------------------------------------


def _topology(port: int) -> dict[int, dict[str, Any]]:
    """``{port: {id, role, master_id, slots}}`` from CLUSTER NODES."""
    out: dict[int, dict[str, Any]] = {}
    for line in redis_command(port, "CLUSTER", "NODES").decode().splitlines():
        f = line.split()
        slots = []
        for s in f[8:]:
            if not s.startswith("["):
                a, _, b = s.partition("-")
                slots.append((int(a), int(b or a)))
        role = "master" if "master" in f[2] else "replica"
        out[int(f[1].split("@")[0].rsplit(":", 1)[1])] = {
            "id": f[0],
            "role": role,
            "master_id": f[3],
            "slots": slots,
            "fail": "fail" in f[2],
        }
    return out


def _on(port: int, topo: dict[int, dict[str, Any]], tier: RedisTier, keys: list[bytes]) -> list[bytes]:
    ranges = topo[port]["slots"]
    return [k for k in keys if any(a <= key_slot(tier.redis_key(k)) <= b for a, b in ranges)]


class _ReplicatedCluster(RedisCluster):
    """3 masters + 3 replicas (RedisCluster itself makes masters only)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(masters=6, **kw)

    def _create(self, cli: str) -> None:
        argv = [
            cli,
            "--cluster",
            "create",
            *(f"{h}:{p}" for h, p in self.nodes),
            "--cluster-replicas",
            "1",
            "--cluster-yes",
        ]
        res = subprocess.run(
            argv, capture_output=True, timeout=self.startup_timeout, stdin=subprocess.DEVNULL, check=False
        )
        out = (res.stdout + res.stderr).decode(errors="replace")
        if res.returncode != 0 or "All 16384 slots covered" not in out:
            raise RuntimeError(f"redis-cli --cluster create failed (rc={res.returncode}):\n{out[-2000:]}")

    def wait_replicated(self, timeout: float = 60.0) -> None:
        """Until every node's CLUSTER NODES shows each master that serves slots with a replica of
        its own: replicas are attached after ``--cluster create`` returns, and nodes learn of
        them by gossip (a test that read the topology at once found no replica for a master)."""
        deadline = time.monotonic() + timeout
        while True:
            views = [_topology(port) for _, port in self.nodes]
            if all(
                any(r["master_id"] == m["id"] for r in topo.values())
                for topo in views
                for m in topo.values()
                if m["role"] == "master" and m["slots"]
            ):
                return
            assert time.monotonic() < deadline, f"replicas not attached within {timeout} s: {views}"
            time.sleep(0.1)


@contextmanager
def _cluster(replicas: bool = False) -> Iterator[RedisCluster]:
    # Keep serving the slots that are still covered when a master is gone (the default, "yes",
    # makes every node refuse every key once a master is marked failed).
    args = ["--cluster-require-full-coverage", "no"]
    c = (
        _ReplicatedCluster(extra_args=args, node_timeout_ms=1000)
        if replicas
        else RedisCluster(extra_args=args, node_timeout_ms=1000)
    )
    with c:
        if isinstance(c, _ReplicatedCluster):
            c.wait_replicated()
        yield c


def test_cluster_master_killed_other_slots_still_served() -> None:
    async def run(c: RedisCluster) -> dict[str, int]:
        async with RedisTier(_redis_cfg(c.url, cluster=True, hash_tag_buckets=64)) as tier:
            keys = [_key(i) for i in range(150)]
            index = {k: i for i, k in enumerate(keys)}
            await tier.put_many([(k, payload(index[k], 1, SIZE)) for k in keys])
            victim = c.servers[1]
            topo = _topology(c.servers[0].port)
            dead = set(_on(victim.port, topo, tier, keys))
            live = [k for k in keys if k not in dead]
            assert dead and live
            victim.kill()
            served = 0
            t_end = time.monotonic() + 3.0  # past node_timeout: the survivors mark the master failed
            while True:
                got = await tier.get_many(live)
                for k, g in zip(live, got):
                    assert g is not None, "a key on a live master was not served"
                    check_payload(index[k], g)
                served += len(live)
                if time.monotonic() > t_end:
                    break
                await asyncio.sleep(0.5)
            # Writes to live slots keep working too.
            fresh = [k for k in (_key(i) for i in range(1000, 1100)) if k not in set(_on(victim.port, topo, tier, [k]))]
            await tier.put_many([(k, b"after the kill") for k in fresh])
            assert await tier.get_many(fresh[:5]) == [b"after the kill"] * 5
            return {"keys": len(keys), "on_dead_master": len(dead), "live_keys_served": served}

    with _cluster() as c:
        counts = asyncio.run(run(c))
    report("redis-cluster-master-kill", **counts)


def test_cluster_mixed_batch_serves_live_slots_when_a_master_is_down() -> None:
    async def run(c: RedisCluster) -> None:
        async with RedisTier(_redis_cfg(c.url, cluster=True, hash_tag_buckets=64)) as tier:
            keys = [_key(i) for i in range(60)]
            await tier.put_many([(k, b"v") for k in keys])
            victim = c.servers[1]
            dead = set(_on(victim.port, _topology(c.servers[0].port), tier, keys))
            victim.kill()
            got = await tier.get_many(keys)  # raises TierUnavailableError today
            assert [g is None for g in got] == [k in dead for k in keys]

    with _cluster() as c:
        asyncio.run(run(c))


def test_cluster_failover_to_replica_is_picked_up() -> None:
    async def run(c: _ReplicatedCluster) -> dict[str, Any]:
        async with RedisTier(_redis_cfg(c.url, cluster=True, hash_tag_buckets=64)) as tier:
            keys = [_key(i) for i in range(120)]
            index = {k: i for i, k in enumerate(keys)}
            await tier.put_many([(k, payload(index[k], 1, SIZE)) for k in keys])
            topo = _topology(c.servers[0].port)
            masters = {p: n for p, n in topo.items() if n["role"] == "master" and n["slots"]}
            victim_port = next(p for p in masters if p != c.servers[0].port)
            replica_port = next(p for p, n in topo.items() if n["master_id"] == masters[victim_port]["id"])
            dead = _on(victim_port, topo, tier, keys)
            # Wait until the replica holds every key of its master (async replication).
            deadline = time.monotonic() + 10
            while redis_command(replica_port, "DBSIZE") != redis_command(victim_port, "DBSIZE"):
                assert time.monotonic() < deadline, "replica never caught up"
                await asyncio.sleep(0.05)
            victim = next(s for s in c.servers if s.port == victim_port)
            victim.kill()
            t0 = time.monotonic()
            errors = 0
            while True:
                try:
                    got = await tier.get_many(dead)
                    if all(g is not None for g in got):
                        break
                except TierUnavailableError:
                    errors += 1
                assert time.monotonic() - t0 < 30, "failover was not picked up within 30 s"
                await asyncio.sleep(0.2)
            failover_s = time.monotonic() - t0
            for k, g in zip(dead, got):
                assert g is not None and check_payload(index[k], g) == 1
            got_all = await tier.get_many(keys)
            assert all(g is not None and check_payload(index[k], g) == 1 for k, g in zip(keys, got_all))
            await tier.put_many([(dead[0], b"written to the promoted replica")])
            assert await tier.get_many([dead[0]]) == [b"written to the promoted replica"]
            # The client found the promoted replica; the first node's own view follows by gossip.
            while _topology(c.servers[0].port)[replica_port]["role"] != "master":
                assert time.monotonic() - t0 < 30, "the first node never saw the replica promoted"
                await asyncio.sleep(0.1)
            return {
                "keys_on_failed_master": len(dead),
                "failover_s": round(failover_s, 2),
                "errors_during_failover": errors,
                "served_after": len(keys),
            }

    with _cluster(replicas=True) as c:
        counts = asyncio.run(run(c))  # type: ignore[arg-type]
    report("redis-cluster-failover", **counts)

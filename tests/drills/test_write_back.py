"""Write-back routes (CPU first, acknowledged there) over a real Redis that stops taking writes:
every acknowledged chunk that no tier ends up holding is counted in ``write_back_lost``, whatever
the path (refused when the CPU tier evicted it, dropped by an open breaker, or past the close
deadline), and ``close(timeout=T)`` returns within T plus a small constant.

The chunks are put through the pipeline in many small jobs into a CPU tier that holds a third of
them, so most reach Redis as eviction write-backs, the rest at close. What is "served" afterwards
is read from Redis by a fresh tier (the CPU tier is gone with the process's pipeline).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from typing import Any

import pytest

from tests.drills._util import NS, block_hash, check_payload, payload, report, wait_jobs
from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import CPUTierConfig, PipelineConfig, PolicyRule, RedisTierConfig
from tieredkv.pipeline import Pipeline
from tieredkv.pipeline.core import CLOSE_GRACE_S
from tieredkv.policy import TierPolicy
from tieredkv.testing.faulty import FaultyTier
from tieredkv.testing.servers import RedisServer

pytestmark = [pytest.mark.timeout(120)]

SIZE = 16 << 10
GROUP = 3
CHUNKS = 96  # the CPU tier holds 32 of them


def _key(i: int) -> bytes:
    return NS.key(block_hash(i), GROUP)


def _redis_cfg(url: str, prefix: str, timeout_s: float = 0.3) -> RedisTierConfig:
    return RedisTierConfig(
        url=url,
        key_prefix=prefix,
        socket_timeout_s=timeout_s,
        connect_timeout_s=0.2,
        op_timeout_s=max(1.0, timeout_s),
        native_io=True,
    )


def _pipeline(lower: Any, job_timeout_s: float = 5.0) -> Pipeline:
    cpu = CPUTier(CPUTierConfig(capacity_bytes=32 * SIZE, segment_bytes=SIZE))
    pol = TierPolicy([PolicyRule(tiers=["cpu", lower.name], write="back")], ["cpu", lower.name])
    pol.route(GROUP, SIZE, "full")
    cfg = PipelineConfig(breaker_failures=2, breaker_reset_s=0.2, job_timeout_s=job_timeout_s)
    return Pipeline([cpu, lower], pol, cfg)


def _put_all(p: Pipeline, first: int, last: int) -> list[int]:
    """Put chunks ``first..last-1``, 4 a job; the acknowledged ones."""
    acked: list[int] = []
    for start in range(first, last, 4):
        ids = list(range(start, min(start + 4, last)))
        assert p.submit_put(start + 1, [(_key(i), payload(i, 0, SIZE)) for i in ids])
        res = wait_jobs(p, {start + 1})[start + 1]
        acked += [i for i in ids if _key(i) in set(res.done)]
    return acked


def _served(url: str, prefix: str, acked: list[int]) -> tuple[int, int]:
    """(chunks Redis serves with the right bytes, chunks it serves with wrong bytes)."""

    async def read() -> list[bytes | None]:
        async with RedisTier(_redis_cfg(url, prefix)) as red:
            return await red.get_many([_key(i) for i in acked])

    good = wrong = 0
    for i, got in zip(acked, asyncio.run(read()), strict=True):
        if got is None:
            continue
        try:
            check_payload(i, got)
            good += 1
        except AssertionError:
            wrong += 1
    return good, wrong


def test_every_acknowledged_chunk_no_tier_holds_is_counted_lost() -> None:
    """Redis takes the first 40 chunks' write-backs, then refuses every write (a fault wrapper
    around the real tier): evictions and the close flush both lose chunks. The count equals the
    acknowledged chunks Redis does not serve, exactly."""
    prefix = f"wb{uuid.uuid4().hex[:8]}"
    with RedisServer() as srv:
        red = FaultyTier(RedisTier(_redis_cfg(srv.url, prefix)), ops={"put_many"})
        p = _pipeline(red).start()
        try:
            acked = _put_all(p, 0, 40)
            assert p.drain(60)
            red.fail_with = ConnectionError("writes refused (injected)")
            acked += _put_all(p, 40, CHUNKS)
        finally:
            p.close(timeout=5)
        c = p.stats().counters
        good, wrong = _served(srv.url, prefix, acked)
    not_served = len(acked) - good
    report("write-back-lost", acked=len(acked), served=good, lost=c["write_back_lost"], flushed=c["write_back_flushed"])
    assert len(acked) == CHUNKS and wrong == 0
    assert not_served > 32, "the fault never cost an eviction write-back: nothing tested"
    assert c["write_back_lost"] == not_served, (c, not_served)


def test_close_with_the_lower_redis_frozen_returns_in_time_and_counts_what_it_lost() -> None:
    """Redis is stopped (SIGSTOP) mid-run, and its timeouts are long (30 s): every write-back
    hangs, so the drain and the flush both use all the time they are given. close(timeout=3)
    returns within 3 s plus the grace (it took 2T before the two shared a deadline); afterwards
    (Redis resumed) no acknowledged chunk is missing without being counted. A write sent into the
    stopped server lands once it resumes, after it was counted: so lost >= not served."""
    prefix = f"wbf{uuid.uuid4().hex[:8]}"
    with RedisServer() as srv:
        red = RedisTier(_redis_cfg(srv.url, prefix, timeout_s=30.0))
        p = _pipeline(red, job_timeout_s=30.0).start()
        pid = srv.pid
        assert pid is not None
        try:
            acked = _put_all(p, 0, 40)
            assert p.drain(60)
            os.kill(pid, signal.SIGSTOP)
            try:
                acked += _put_all(p, 40, CHUNKS)
                t0 = time.monotonic()
                p.close(timeout=3)
                took = time.monotonic() - t0
            finally:
                os.kill(pid, signal.SIGCONT)
        finally:
            p.close()
        c = p.stats().counters
        good, wrong = _served(srv.url, prefix, acked)
    not_served = len(acked) - good
    report("write-back-frozen", acked=len(acked), served=good, lost=c["write_back_lost"], close_s=round(took, 2))
    assert wrong == 0 and len(acked) == CHUNKS
    assert took < 3 + CLOSE_GRACE_S + 0.75, took
    assert not_served > 0, "Redis took every write while stopped: nothing tested"
    assert c["write_back_lost"] >= not_served, (c, not_served)

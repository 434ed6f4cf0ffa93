"""A Redis route answers vLLM's lookups in the step they are asked: tieredkv's manager (vLLM's real
scheduler side, built by vLLM's factory) sends a request's whole prefix as one pipelined
``EXISTS`` when its first unknown key is asked (``AsyncLookups``' in-step batch over
``TieredStore.probe_many``), and answers from it; a server that stalls, or none at all, costs at
most the budget and the lookup goes the asynchronous way (RETRY), as before.

Against a real redis-server of the test's own (it is stopped with SIGSTOP and killed here).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from tests.vllm.engine import Engine, run_engine
from tests.vllm.test_engine_loop import _tiers_file, spec_extra
from tieredkv.integrations.vllm.lookups import request_offload_keys
from tieredkv.testing.servers import RedisServer

pytestmark = pytest.mark.vllm

HYBRID = ("full", "swa", "mamba")
#: What a lookup may take beyond the tier's budget on this shared box (a thread waiting for a core).
SLACK_S = 0.25


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _engine(tmp_path: Path, url: str, budget_ms: float, bpc: int = 2) -> Engine:
    tiers = _tiers_file(tmp_path / uuid.uuid4().hex[:6], "redis", url, lookup_budget_ms=budget_ms)
    return Engine(spec_extra(bpc, tiers), groups=HYBRID, blocks_per_chunk=bpc, settle=True)


def _request(n: int, groups: int = 3) -> tuple[ReqContext, list[bytes]]:
    """A request's context with ``n`` chunk keys per group recorded on it, as vLLM records them
    (``set_offload_key_position``) before it asks the first; its group-0 keys."""
    ctx = ReqContext(req_id=f"r-{uuid.uuid4().hex[:8]}")
    hashes = [os.urandom(32) for _ in range(n)]
    for g in range(groups):
        for i, h in enumerate(hashes):
            ctx.set_offload_key_position(make_offload_key(h, g), (i + 1) * 16)
    return ctx, [make_offload_key(h, 0) for h in hashes]


def _write(manager: Any, keys: list[bytes]) -> None:
    """Records under the manager's stored keys, straight into its Redis tier."""
    tier = manager.store.pipeline.tiers["redis"]
    manager.store.run(tier.put_many([(manager._sh.skeys[k], b"v" * 64) for k in keys]))


def _bounded(manager: Any) -> dict[str, int]:
    c = manager.store.pipeline.tiers["redis"].counters_snapshot()
    return {k: v for k, v in c.items() if k.startswith("bounded_")}


def test_request_offload_keys_are_the_keys_vllm_records_on_the_request() -> None:
    ctx, keys = _request(4, groups=2)
    got = list(request_offload_keys(ctx))
    assert got[:4] == keys and len(got) == 8
    assert list(request_offload_keys(ReqContext(req_id="empty"))) == []
    assert list(request_offload_keys(object())) == []  # a stand-in without it: nothing to batch


def test_every_key_vllm_asks_was_recorded_on_its_request_before(tmp_path: Path, redis_server: Any) -> None:
    """What the in-step batch relies on, on the engine loop (hybrid, ``blocks_per_chunk`` 2,
    vLLM's real scheduler): every key the scheduler asks the manager about is among the keys
    vLLM recorded on the request's context by then."""
    from tieredkv.integrations.vllm.spec import TieredKVManager

    asked: list[tuple[bool, bytes]] = []
    orig = TieredKVManager.lookup

    def lookup(self: Any, key: Any, ctx: Any) -> Any:
        asked.append((bytes(key) in set(request_offload_keys(ctx)), bytes(key)))
        return orig(self, key, ctx)

    TieredKVManager.lookup = lookup  # type: ignore[method-assign]
    try:
        tiers = _tiers_file(tmp_path / "t", "redis", redis_server.url, lookup_budget_ms=1000)
        r = run_engine(spec_extra(2, tiers), groups=HYBRID, blocks_per_chunk=2, settle=True)
    finally:
        TieredKVManager.lookup = orig  # type: ignore[method-assign]
    assert r.error is None and r.wrong_bytes == 0, r.error
    assert len(asked) > 100
    assert all(ok for ok, _ in asked), [k.hex() for ok, k in asked if not ok][:5]


def test_a_new_request_is_answered_in_the_step(tmp_path: Path, server: RedisServer) -> None:
    """Its first key asked: one batch for every key recorded on the request (all groups); that key
    and every later one answered at once, hits and misses, no RETRY, no asynchronous lookup."""
    eng = _engine(tmp_path, server.url, budget_ms=250)
    try:
        m = eng.connector_scheduler.manager
        ctx, keys = _request(10)
        _write(m, keys[:5])
        t = time.perf_counter()
        assert m.lookup(keys[0], ctx) is LookupResult.HIT
        assert time.perf_counter() - t < 0.25 + SLACK_S
        assert [m.lookup(k, ctx) for k in keys[1:]] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 5
        c = _bounded(m)
        assert c["bounded_lookups"] == 1 and c["bounded_lookup_keys"] >= 30, c  # 10 keys x 3 groups (+ candidates)
        lk = m._lookups
        assert lk.step_batches == 1 and lk.queries == 0 and m.counters.get("lookup_retry", 0) == 0
        # TieredKVConnector's scan of a group (lookup_prefix): answered the same way
        ctx2, keys2 = _request(6)
        _write(m, keys2[:3])
        assert m.lookup_prefix(keys2, ctx2) == [LookupResult.HIT] * 3 + [LookupResult.MISS]
        assert lk.step_batches == 2 and lk.queries == 0
    finally:
        eng.shutdown()


def test_budget_zero_is_the_asynchronous_path(tmp_path: Path, server: RedisServer) -> None:
    """With ``lookup_budget_ms: 0`` nothing is asked in the step: RETRY, then the batched
    asynchronous lookup answers a later step (the behaviour before in-step lookups)."""
    eng = _engine(tmp_path, server.url, budget_ms=0)
    try:
        m = eng.connector_scheduler.manager
        ctx, keys = _request(4)
        _write(m, keys[:2])
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 4  # vLLM scans on past a RETRY
        m.on_schedule_end(None)
        assert m.wait_idle(10)
        assert [m.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2
        assert m._lookups.queries >= 1 and m._lookups.step_answered == 0
    finally:
        eng.shutdown()


def test_a_stalled_server_costs_at_most_the_budget_then_the_asynchronous_path_answers(
    tmp_path: Path, server: RedisServer
) -> None:
    """The server stopped (SIGSTOP) after the engine connected: the first lookup of a new request
    waits at most the budget (plus a small bound) and answers RETRY, counted as a timeout; the
    request's other keys answer RETRY at once (one batch per request per step); once the server
    runs again the asynchronous lookup answers."""
    budget = 0.05
    eng = _engine(tmp_path, server.url, budget_ms=budget * 1000)
    try:
        m = eng.connector_scheduler.manager
        ctx, keys = _request(8)
        _write(m, keys[:4])
        assert m.lookup(keys[0], ctx) is LookupResult.HIT  # connected, answered in the step
        ctx2, keys2 = _request(8)
        _write(m, keys2[:4])
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t = time.perf_counter()
            assert m.lookup(keys2[0], ctx2) is LookupResult.RETRY
            took = time.perf_counter() - t
            assert took < budget + SLACK_S, took
            t = time.perf_counter()
            assert all(m.lookup(k, ctx2) is LookupResult.RETRY for k in keys2[1:])
            assert time.perf_counter() - t < budget / 2
            assert _bounded(m)["bounded_lookup_timeouts"] == 1
            m.on_schedule_end(None)  # the queued keys go out asynchronously (they wait for the server)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert m.wait_idle(20)
        assert [m.lookup(k, ctx2) for k in keys2] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 4
    finally:
        eng.shutdown()


def test_a_dead_server_never_holds_the_scheduler(tmp_path: Path) -> None:
    """The server killed under a running manager: a new request's lookup fails fast (well within
    the budget: the connection is gone, then nothing listens), counted; RETRY, never a hang."""
    with RedisServer() as srv:
        eng = _engine(tmp_path, srv.url, budget_ms=500)
        try:
            m = eng.connector_scheduler.manager
            ctx, keys = _request(4)
            assert m.lookup(keys[0], ctx) is LookupResult.MISS
            srv.kill()
            ctx2, keys2 = _request(4)
            t = time.perf_counter()
            assert m.lookup(keys2[0], ctx2) is LookupResult.RETRY
            assert time.perf_counter() - t < 0.25
            c = _bounded(m)
            assert c["bounded_lookup_errors"] == 1, c
        finally:
            eng.shutdown()

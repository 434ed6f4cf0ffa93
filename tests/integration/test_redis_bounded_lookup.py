"""Lookups a Redis tier answers in the step (``probe_batch``: one pipelined ``EXISTS`` within
``lookup_budget_ms``, :mod:`tieredkv.backends.redis.probe`) against real redis-server processes,
a real Redis Cluster, and hostile servers on loopback sockets: answered within the budget; a
stalled, trickling, lying or dead server answers None within the budget plus a small bound, is
counted, and pauses the path; answers resume once the server does, never mixed with a late reply.

Budgets: the answered cases use a generous budget (this box's two cores are shared with other
test runs, and a loopback round trip of 50-100 µs can take milliseconds when the server waits for
a core); the bound tests measure against the budget they set.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tieredkv.backends.redis import RedisTier
from tieredkv.backends.redis.probe import PAUSE_FIRST_S, BoundedExists, command
from tieredkv.config import RedisTierConfig, TieredKVConfig
from tieredkv.keys import Namespace
from tieredkv.pipeline import KeyState
from tieredkv.store import TieredStore
from tieredkv.testing.servers import RedisServer

pytestmark = [pytest.mark.timeout(120)]

#: What a call may take beyond its budget on this shared box (a thread waiting for a core);
#: far below what a stall costs without the bound (``socket_timeout_s``: 2 s; the stalls: 5 s+).
SLACK_S = 0.25


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A server of this module's own: a test here stops it (SIGSTOP), which the session's
    server (``redis_server``) must never be."""
    with RedisServer() as srv:
        yield srv


def _keys(n: int, groups: int = 1) -> list[bytes]:
    ns = Namespace(model=f"bounded/{uuid.uuid4().hex[:8]}")
    return [ns.key(os.urandom(32), g) for _ in range(n) for g in range(groups)]


def _tier(url: str, **kw: Any) -> RedisTier:
    kw.setdefault("key_prefix", f"b{uuid.uuid4().hex[:8]}")
    return RedisTier(RedisTierConfig(url=url, **kw))


def _counts(tier: RedisTier) -> dict[str, int]:
    return {k: v for k, v in tier.counters_snapshot().items() if k.startswith("bounded_")}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    got = fn()
    return got, time.perf_counter() - t


async def _until_answered(tier: RedisTier, keys: list[bytes], timeout: float = 20.0) -> list[bool]:
    """``probe_batch(keys)`` asked until it answers (past the pauses a failure started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = tier.probe_batch(keys)
        if got is not None:
            return got
        await asyncio.sleep(PAUSE_FIRST_S / 4)
    why = tier._bounded and tier._bounded.last_failure
    raise AssertionError(f"no answer within {timeout} s: {_counts(tier)} {why}")


async def _until_tried(tier: RedisTier, keys: list[bytes], timeout: float = 20.0) -> tuple[Any, float]:
    """The first ``probe_batch(keys)`` that is tried (the pause a failure started is over: not
    counted skipped), and how long it took."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        skipped = _counts(tier).get("bounded_lookup_skipped", 0)
        got, took = _timed(lambda: tier.probe_batch(keys))
        if _counts(tier).get("bounded_lookup_skipped", 0) == skipped:
            return got, took
        await asyncio.sleep(PAUSE_FIRST_S / 4)
    raise AssertionError(f"never tried within {timeout} s: {_counts(tier)}")


# ---- answered -------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["single", "cluster"])
async def test_a_batch_is_answered_within_its_budget(where: str, request: pytest.FixtureRequest) -> None:
    """Half the keys written: one call answers each, within the budget, counted; the connection
    (one per cluster node) is kept for the next batch."""
    srv = request.getfixturevalue("server" if where == "single" else "redis_cluster")  # the session's
    budget_ms = 250.0
    tier = _tier(srv.url, cluster=where == "cluster", lookup_budget_ms=budget_ms)
    await tier.open()
    try:
        keys = _keys(200, groups=3)
        await tier.put_many([(k, b"v" * 64) for k in keys[::2]])
        want = [i % 2 == 0 for i in range(len(keys))]
        got, took = _timed(lambda: tier.probe_batch(keys))
        assert got == want
        assert took < budget_ms / 1000
        c = _counts(tier)
        assert c["bounded_lookups"] == 1 and c["bounded_lookup_keys"] == len(keys), c
        assert 0 < c["bounded_lookup_us"] <= budget_ms * 1000
        bounded = tier._bounded
        assert bounded is not None
        socks = {w: n.sock for w, n in bounded._nodes.items()}
        assert len(socks) == (1 if where == "single" else 3) and all(socks.values())
        assert tier.probe_batch(keys[:5]) == want[:5] and tier.probe_batch([]) == []
        assert {w: n.sock for w, n in bounded._nodes.items()} == socks  # the same connections
        assert tier.probe((keys[0],)) is None and tier.probe_key(keys[0]) is None  # no waiting there
    finally:
        await tier.close()
    assert tier.probe_batch(keys) is None  # closed: nothing asked


@pytest.mark.asyncio
async def test_the_default_budget_answers_on_loopback(server: RedisServer) -> None:
    """At the default 1 ms a loopback round trip answers: asked until one batch does (a batch this
    box's load delays past the budget is a fallback, counted, never a wrong answer)."""
    tier = _tier(server.url)
    assert tier.config.lookup_budget_ms == 1.0
    await tier.open()
    try:
        keys = _keys(64)
        await tier.put_many([(k, b"v") for k in keys[:10]])
        assert await _until_answered(tier, keys) == [i < 10 for i in range(64)]
        c = _counts(tier)
        assert c["bounded_lookups"] >= 1
        # answered batches averaged within the budget plus what a late last read may add
        assert c["bounded_lookup_us"] / c["bounded_lookups"] < 1000 + SLACK_S * 1e6
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_auth_and_db_go_out_with_the_first_batch() -> None:
    """A password and a database in the URL: the new connection's AUTH and SELECT are sent with
    its first batch; keys written to db 3 are found (in db 0 they would not be)."""
    with RedisServer(requirepass="s3cret pw") as srv:
        url = f"redis://:s3cret%20pw@127.0.0.1:{srv.port}/3"
        tier = _tier(url, lookup_budget_ms=250)
        await tier.open()
        try:
            keys = _keys(20)
            await tier.put_many([(k, b"v") for k in keys[:7]])
            assert tier.probe_batch(keys) == [i < 7 for i in range(20)]
        finally:
            await tier.close()
        # A wrong password: refused within the budget, counted, the connection closed.
        bad = BoundedExists(
            budget_s=0.25,
            route=lambda _k: (socket.AF_INET, ("127.0.0.1", srv.port)),
            hello=[command(b"AUTH", b"wrong")],
            count=lambda *_: None,
            name="bad",
        )
        assert bad.exists([b"k"]) is None
        assert bad.last_failure is not None and "WRONGPASS" in bad.last_failure
        assert all(n.sock is None for n in bad._nodes.values())
        bad.close()


@pytest.mark.asyncio
async def test_budget_zero_turns_it_off(server: RedisServer) -> None:
    tier = _tier(server.url, lookup_budget_ms=0)
    await tier.open()
    try:
        assert tier._bounded is None and tier.probe_batch(_keys(3)) is None
    finally:
        await tier.close()


# ---- a server that stalls, dies, or lies --------------------------------------------------------


@pytest.mark.asyncio
async def test_a_stalled_server_costs_one_budget_then_none_and_answers_resume_unmixed(server: RedisServer) -> None:
    """The server process stopped (SIGSTOP: connections are accepted by the kernel, nothing is
    answered): the batch answers None within its budget plus a small bound, counted as a timeout,
    and the next calls answer None at once while the path is paused. Once the server runs again
    the answers are right: the late replies of the batch that timed out (all misses) are never
    read as a later batch's (all hits)."""
    budget = 0.05
    tier = _tier(server.url, lookup_budget_ms=budget * 1000)
    await tier.open()
    held = _keys(30)
    await tier.put_many([(k, b"v") for k in held])
    missing = _keys(40)
    assert tier.probe_batch(held) == [True] * 30  # a connection is up
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        got, took = _timed(lambda: tier.probe_batch(missing))
        assert got is None
        assert budget * 0.9 <= took < budget + SLACK_S, took
        assert _counts(tier)["bounded_lookup_timeouts"] == 1
        got, took = _timed(lambda: tier.probe_batch(held))
        assert got is None and took < budget / 2  # paused: not tried
        assert _counts(tier)["bounded_lookup_skipped"] == 1
        got, took = await _until_tried(tier, held)  # past the pause: a new connection, stalled too
        assert got is None and took < budget + SLACK_S
        assert _counts(tier)["bounded_lookup_timeouts"] == 2
    finally:
        os.kill(server.pid, signal.SIGCONT)
    try:
        assert await _until_answered(tier, held) == [True] * 30
        assert tier.probe_batch(missing) == [False] * 40
        assert tier.probe_batch(held + missing) == [True] * 30 + [False] * 40
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_dead_server_fails_fast_is_counted_and_answers_resume_after_a_restart() -> None:
    budget = 0.5  # what a hang would cost: the failures below take far less
    with RedisServer() as srv:
        tier = _tier(srv.url, lookup_budget_ms=budget * 1000)
        await tier.open()
        try:
            keys = _keys(10)
            assert tier.probe_batch(keys) == [False] * 10
            srv.stop()
            got, took = _timed(lambda: tier.probe_batch(keys))  # the connection is gone
            assert got is None and took < budget / 2, took
            assert _counts(tier)["bounded_lookup_errors"] == 1
            got, took = await _until_tried(tier, keys)  # nothing listens: refused at once
            assert got is None and took < budget / 2, took
            assert _counts(tier)["bounded_lookup_errors"] == 2
            assert "ConnectionRefused" in str(tier._bounded and tier._bounded.last_failure)
            skipped = _counts(tier).get("bounded_lookup_skipped", 0)
            got, took = _timed(lambda: tier.probe_batch(keys))  # paused (100 ms now): not tried
            assert got is None and took < budget / 10
            assert _counts(tier)["bounded_lookup_skipped"] == skipped + 1
            srv.start()  # the same port
            assert await _until_answered(tier, keys) == [False] * 10
        finally:
            await tier.close()


class _Hostile:
    """A loopback server that reads whatever comes and answers each EXISTS with ``reply(n)``
    (``n``: the EXISTS commands read so far), written at ``bytes_per_s`` (None: at once)."""

    def __init__(self, reply: Callable[[int], bytes], bytes_per_s: float | None = None) -> None:
        self.reply = reply
        self.rate = bytes_per_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(0.1)
                seen = 0
                while not self.stop.is_set():
                    try:
                        data = conn.recv(1 << 16)
                    except TimeoutError:
                        continue
                    except OSError:  # the client closed it (reset)
                        break
                    if not data:
                        break
                    n = data.count(b"EXISTS")
                    out = b"".join(self.reply(seen + i) for i in range(n))
                    seen += n
                    try:
                        if self.rate is None:
                            conn.sendall(out)
                        else:
                            for b in out:
                                if self.stop.is_set():
                                    break
                                conn.sendall(bytes([b]))
                                time.sleep(1 / self.rate)
                    except OSError:
                        break

    def bounded(self, budget_s: float, counts: dict[str, int]) -> BoundedExists:
        def count(name: str, n: int) -> None:
            counts[name] = counts.get(name, 0) + n

        return BoundedExists(
            budget_s=budget_s, route=lambda _k: (socket.AF_INET, ("127.0.0.1", self.port)), count=count, name="h"
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.parametrize(
    ("case", "reply", "rate", "why"),
    [
        ("trickle", lambda i: b":1\r\n", 200.0, "timeouts"),  # right answers, 5 ms a byte
        ("bulk", lambda i: b"$1\r\n1\r\n", None, "errors"),  # a type EXISTS cannot get
        ("big-int", lambda i: b":7\r\n", None, "errors"),  # a count one key cannot have
        ("endless-line", lambda i: b"-" + b"E" * 20000, None, "errors"),  # no CRLF: bounded read
        ("extra", lambda i: b":0\r\n:0\r\n", None, "errors"),  # replies no command asked for
        ("moved", lambda i: b"-MOVED 12 10.0.0.1:7000\r\n" if i == 3 else b":0\r\n", None, "errors"),
    ],
)
def test_a_hostile_server_never_holds_a_batch_past_its_budget(
    case: str, reply: Callable[[int], bytes], rate: float | None, why: str
) -> None:
    host = _Hostile(reply, rate)
    counts: dict[str, int] = {}
    bounded = host.bounded(0.05, counts)
    try:
        got, took = _timed(lambda: bounded.exists([b"k%d" % i for i in range(20)]))
        assert got is None, case
        assert took < 0.05 + SLACK_S, (case, took)
        assert counts == {f"bounded_lookup_{why}": 1}, (case, counts, bounded.last_failure)
        if why == "errors" and case != "moved":
            assert all(n.sock is None for n in bounded._nodes.values())  # closed, never reused
    finally:
        bounded.close()
        host.close()


def test_one_batch_at_a_time_a_second_thread_is_turned_away() -> None:
    """While one thread's batch waits on a slow server, another thread's call answers None at
    once (counted skipped), never waiting behind it."""
    host = _Hostile(lambda i: b":0\r\n", bytes_per_s=100.0)  # 20 replies: 0.8 s
    counts: dict[str, int] = {}
    bounded = host.bounded(0.5, counts)
    try:
        started = threading.Event()
        out: list[Any] = []

        def first() -> None:
            started.set()
            out.append(bounded.exists([b"k%d" % i for i in range(20)]))

        t = threading.Thread(target=first)
        t.start()
        started.wait()
        deadline = time.monotonic() + 5
        while not bounded._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.001)
        got, took = _timed(lambda: bounded.exists([b"x"]))
        assert got is None and took < 0.05 and counts.get("bounded_lookup_skipped") == 1
        t.join(5)
        assert out == [None] and counts.get("bounded_lookup_timeouts") == 1
    finally:
        bounded.close()
        host.close()


# ---- through the pipeline ----------------------------------------------------------------------


def test_probe_many_walks_cpu_then_redis_and_asks_redis_once(server: RedisServer) -> None:
    """``TieredStore.probe_many`` over a CPU + Redis route: a key the CPU tier holds is a hit
    without asking Redis, the rest go to Redis in one batch (hits and misses), a key in flight is
    pending; ``probe`` alone still cannot answer a Redis key (no waiting there); the answers are
    counted as lookups."""
    cfg = TieredKVConfig.model_validate(
        {
            "namespace": {"model": f"pm-{uuid.uuid4().hex[:6]}"},
            "tiers": [
                {"kind": "cpu", "name": "cpu", "capacity_bytes": "16MiB"},
                {"kind": "redis", "name": "redis", "url": server.url, "key_prefix": f"pm{uuid.uuid4().hex[:6]}",
                 "lookup_budget_ms": 250},
            ],
        }
    )  # fmt: skip
    with TieredStore(cfg).start() as store:
        keys = [store.key(os.urandom(32), 0) for _ in range(6)]
        payload = bytes(256)
        cpu, redis = store.pipeline.tiers["cpu"], store.pipeline.tiers["redis"]
        store.run(cpu.put_many([(keys[0], payload)]))
        store.run(redis.put_many([(keys[1], payload), (keys[2], payload)]))
        before = redis.counters_snapshot().get("bounded_lookup_keys", 0)
        states = store.probe_many(keys[:5])
        assert states == [KeyState.HIT, KeyState.HIT, KeyState.HIT, KeyState.MISS, KeyState.MISS]
        assert redis.counters_snapshot()["bounded_lookup_keys"] - before == 4  # keys[1:5], one batch
        assert store.probe(keys[1]) is None  # the per-key probe never waits on the server
        stats = store.stats()
        assert stats.groups[0].hits >= 3 and stats.groups[0].misses >= 2
        store.pipeline.inflight.pending[keys[5]] = 1  # a store of it in flight
        try:
            assert store.probe_many([keys[5]]) == [KeyState.PENDING]
        finally:
            del store.pipeline.inflight.pending[keys[5]]

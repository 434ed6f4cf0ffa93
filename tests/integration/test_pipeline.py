"""The store/load pipeline with real tiers: bytes, pending, write-back, breaker, back-pressure, close."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tieredkv.backends.cpu import CPUTier
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import CPUTierConfig, LMDBTierConfig, PipelineConfig, PolicyRule, RedisTierConfig
from tieredkv.keys import Namespace
from tieredkv.pipeline import ChunkRef, KeyState, LoadJob, Pipeline, StoreJob
from tieredkv.policy import TierPolicy
from tieredkv.staging import StagingPool
from tieredkv.testing.faulty import FaultyTier
from tieredkv.testing.servers import RedisServer

NS = Namespace(model="pipeline-test")
BLOCKS, BPC = 64, 4  # blocks per group, blocks per chunk
LAYER_SHAPE = (BLOCKS, 2, 16, 4, 32)  # 4 KiB per block per layer, uint8


def kv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, LAYER_SHAPE, dtype=torch.uint8, generator=g) for _ in range(2)]


def chunks(n: int, group: int = 0, start: int = 0) -> tuple[ChunkRef, ...]:
    return tuple(
        ChunkRef(NS.key((start + i).to_bytes(32, "big"), group), tuple(range(BPC * i, BPC * i + BPC))) for i in range(n)
    )


def make(tiers: list[Any], rules: list[PolicyRule] | None = None, **cfg: Any) -> Pipeline:
    pcfg = PipelineConfig(**{"uvloop": True, **cfg})
    pol = TierPolicy(rules or [PolicyRule()], [t.name for t in tiers])
    return Pipeline(tiers, pol, pcfg, staging=StagingPool(int(cfg.get("staging_bytes", 64 << 20))))


def cpu(**kw: Any) -> CPUTier:
    return CPUTier(CPUTierConfig(**{"capacity_bytes": 32 << 20, "segment_bytes": 1 << 20, **kw}))


def lmdb(path: Path, **kw: Any) -> LMDBTier:
    return LMDBTier(
        LMDBTierConfig(**{"path": str(path), "map_size_bytes": 256 << 20, "size_cap_bytes": 128 << 20, **kw})
    )


def wait_results(p: Pipeline, n: int, timeout: float = 20.0) -> dict[int, Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < n:
        for r in p.poll_finished():
            got[r.job_id] = r
        assert time.monotonic() < deadline, f"only {len(got)} of {n} results"
        time.sleep(0.002)
    return got


def wait_until(cond: Any, what: str, limit: float = 120.0) -> None:
    """Wait for ``cond()``, bounded by a generous limit (a busy machine is slow, never wrong)."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_store_lookup_load_round_trip_with_partial_first_chunk(tmp_path: Path) -> None:
    src, dst = kv(1), kv(2)
    with make([cpu(), lmdb(tmp_path)]) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.register_group(1, dst, blocks_per_chunk=BPC)
        cs = chunks(8)
        t0 = time.perf_counter()
        p.submit_store(StoreJob(1, 0, cs))
        assert time.perf_counter() - t0 < 0.05, "submit must return at once"
        (res,) = wait_results(p, 1).values()
        assert res.ok and res.done == tuple(c.key for c in cs) and res.tiers == {"cpu": 8, "lmdb": 8}
        assert p.lookup([cs[0].key, NS.key(b"x" * 32, 0)]) == [(KeyState.HIT, "cpu"), (KeyState.MISS, None)]
        # Load group-0 chunks into group-1's tensors (same geometry), the first one from block 2 on.
        load = (ChunkRef(cs[0].key, (40, 41)), ChunkRef(cs[1].key, (44, 45, 46, 47)))
        p.submit_load(LoadJob(2, 1, load, skip_blocks=2))
        (res,) = wait_results(p, 1).values()
        assert res.ok and res.tiers == {"cpu": 2}
        for s, d in zip(src, dst):
            assert torch.equal(d[40:42], s[2:4]) and torch.equal(d[44:48], s[4:8])
            assert not torch.equal(d[42], s[2])  # untouched neighbour


def test_lower_tier_hit_is_promoted(tmp_path: Path) -> None:
    src = kv(3)
    low = lmdb(tmp_path)
    rules = [PolicyRule(tiers=["lmdb"])]
    with make([cpu(), low], rules) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.submit_store(StoreJob(1, 0, chunks(2)))
        wait_results(p, 1)
    top = cpu()
    with make([top, lmdb(tmp_path)], [PolicyRule(tiers=["cpu", "lmdb"])]) as p:
        p.register_group(0, kv(4), blocks_per_chunk=BPC)
        assert p.lookup([chunks(1)[0].key]) == [(KeyState.HIT, "lmdb")]
        p.submit_load(LoadJob(2, 0, chunks(2)))
        (res,) = wait_results(p, 1).values()
        assert res.ok and res.tiers == {"lmdb": 2}
        assert p.lookup([c.key for c in chunks(2)]) == [(KeyState.HIT, "cpu")] * 2
        assert p.stats().counters["promotions"] == 2


def test_write_back_demotes_on_cpu_eviction(tmp_path: Path) -> None:
    src = kv(5)
    chunk_bytes = BPC * 2 * 4096
    with make(
        [cpu(capacity_bytes=4 * chunk_bytes, segment_bytes=chunk_bytes), lmdb(tmp_path)],
        [PolicyRule(tiers=["cpu", "lmdb"], write="back")],
    ) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        cs = chunks(8)
        for i, c in enumerate(cs):
            p.submit_store(StoreJob(i, 0, (c,)))
            wait_results(p, 1)
        assert p.drain(120)  # write-backs are in flight for drain() too
        wait_until(lambda: not any(p.is_pending(c.key) for c in cs), "write-backs still pending")
        states = p.lookup([c.key for c in cs])
        assert [s for s, _ in states] == [KeyState.HIT] * 8
        assert {t for _, t in states[:4]} == {"lmdb"} and {t for _, t in states[4:]} == {"cpu"}
        assert p.stats().counters["write_backs"] == 4
        dst = kv(6)
        p.register_group(1, dst, blocks_per_chunk=BPC)
        p.submit_load(LoadJob(99, 0, (cs[0],)))
        assert next(iter(wait_results(p, 1).values())).ok


def test_only_a_write_back_routes_first_tier_hands_its_evictions_on(tmp_path: Path) -> None:
    """A tier's evictions go to write-back only where some rule writes back with that tier first:
    elsewhere the tier evicts without passing each record's bytes to a listener that would drop
    them (a full CPU tier evicts a record per store)."""
    chunk_bytes = BPC * 2 * 4096
    first, second, top = (
        CPUTier(CPUTierConfig(capacity_bytes=4 << 20, segment_bytes=1 << 20), name=n)
        for n in ("first", "second", "top")
    )
    rules = [
        PolicyRule(tiers=["first", "lmdb"], write="back", max_chunk_bytes=chunk_bytes),
        PolicyRule(tiers=["second", "lmdb"], write="through"),
    ]
    with make([first, second, top, lmdb(tmp_path)], rules):
        assert first._evict_listener is not None
        assert second._evict_listener is None and top._evict_listener is None
    through = cpu(capacity_bytes=4 * chunk_bytes, segment_bytes=chunk_bytes)
    src = kv(7)
    with make([through, lmdb(tmp_path / "t")], [PolicyRule(tiers=["cpu", "lmdb"])]) as p:
        assert through._evict_listener is None
        p.register_group(0, src, blocks_per_chunk=BPC)
        cs = chunks(8)
        assert p.submit_store(StoreJob(1, 0, tuple(cs[:4])))
        assert wait_results(p, 1)[1].ok
        assert p.submit_store(StoreJob(2, 0, tuple(cs[4:])))
        assert wait_results(p, 1)[2].ok
        assert through.counters["evictions"] == 4
        assert p.stats().counters.get("write_backs", 0) == 0
        assert [t for _, t in p.lookup([c.key for c in cs])] == ["lmdb"] * 4 + ["cpu"] * 4


def test_probe_answers_in_process_routes_at_once_and_counts_each_answer(tmp_path: Path) -> None:
    """The scheduler's per-key probe on a CPU + LMDB route: hit (from either tier), miss and
    pending from the calling thread, each hit and miss counted once in the group's lookups, also
    with threads probing the same keys at once; None (ask the asynchronous lookup) while a tier's
    breaker is not closed, for a tier that cannot answer without waiting, and once closed."""
    top, low = cpu(), lmdb(tmp_path)
    with make([top, low], [PolicyRule(tiers=["cpu", "lmdb"])]) as p:
        p.register_group(0, kv(8), blocks_per_chunk=BPC)
        cs = chunks(3)
        keys = [c.key for c in cs]
        p.submit_store(StoreJob(1, 0, cs[:2]))
        assert wait_results(p, 1)[1].ok
        assert [p.probe(k) for k in keys] == [KeyState.HIT, KeyState.HIT, KeyState.MISS]
        assert (p.group_stats[0].hits, p.group_stats[0].misses) == (2, 1)
        assert p.run(top.delete_many([keys[0]]), timeout=30) == 1
        assert p.probe(keys[0]) is KeyState.HIT  # the CPU tier says no, LMDB holds it

        rounds, n_threads = 2000, 4
        before = p.group_stats[0].hits, p.group_stats[0].misses
        answers: list[list[KeyState | None]] = [[] for _ in range(n_threads)]
        go = threading.Barrier(n_threads)

        def prober(out: list[KeyState | None]) -> None:
            go.wait()
            for _ in range(rounds):
                out.extend(p.probe(k) for k in keys)

        threads = [threading.Thread(target=prober, args=(a,)) for a in answers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a in answers:
            assert a == [KeyState.HIT, KeyState.HIT, KeyState.MISS] * rounds
        hits, misses = p.group_stats[0].hits - before[0], p.group_stats[0].misses - before[1]
        assert (hits, misses) == (2 * rounds * n_threads, rounds * n_threads), "a count was lost"

        lane = p._lanes["cpu"]  # fault injection: the CPU tier's breaker opens
        lane.breaker.trip()
        assert p.probe(keys[1]) is None and p.probe(keys[2]) is None
        lane.breaker.success()
        assert p.probe(keys[1]) is KeyState.HIT

        p.register_group(1, kv(9), blocks_per_chunk=BPC)
        c1 = chunks(1, group=1)
        p.inflight.begin([c1[0].key])  # a store of it in flight (what submit_store does first)
        assert p.probe(c1[0].key) is KeyState.PENDING
        p.inflight.unpend([c1[0].key])
        p.inflight.end()
        assert p.probe(c1[0].key) is KeyState.MISS
    assert p.probe(keys[1]) is None  # closed: the asynchronous path answers (a miss)

    slow = FaultyTier(lmdb(tmp_path / "faulty"))  # a wrapper cannot be probed without waiting
    with make([slow], [PolicyRule()]) as p:
        p.register_group(0, kv(10), blocks_per_chunk=BPC)
        assert p.probe(keys[2]) is None
        assert p.lookup([keys[2]]) == [(KeyState.MISS, None)]


def test_probe_prefix_answers_as_probe_does_key_by_key(tmp_path: Path) -> None:
    """``probe_prefix`` (a scheduler's prefix scan in one call) gives ``probe``'s answer for each
    key from ``start``, in order, stopping after the first answer that is neither HIT nor PENDING;
    keys the caller is writing are PENDING; hits and misses land in each key's own group, exactly
    as many as key-by-key probes count (also from threads scanning at once); nothing after a stop
    is probed or counted."""
    H, P, M = KeyState.HIT, KeyState.PENDING, KeyState.MISS
    with make([cpu(), lmdb(tmp_path)], [PolicyRule(tiers=["cpu", "lmdb"])]) as p:
        p.register_group(0, kv(11), blocks_per_chunk=BPC)
        p.register_group(1, kv(12), blocks_per_chunk=BPC)
        g0, g1 = [c.key for c in chunks(8)], [c.key for c in chunks(4, group=1)]
        p.submit_store(StoreJob(1, 0, tuple(chunks(8)[i] for i in (0, 1, 3, 5, 6))))
        p.submit_store(StoreJob(2, 1, chunks(2, group=1)))
        assert all(r.ok for r in wait_results(p, 2).values())
        p.inflight.begin([g0[4]])  # a store of it in flight here
        writing = {g0[2], g1[3]}  # the caller's own, not submitted yet

        def counts() -> tuple[int, int, int, int]:
            s0, s1 = p.group_stats[0], p.group_stats[1]
            return s0.hits, s0.misses, s1.hits, s1.misses

        def one_by_one(keys: list[bytes], start: int) -> list[KeyState | None]:
            out: list[KeyState | None] = []
            for k in keys[start:]:
                out.append(P if k in writing else p.probe(k))
                if out[-1] not in (H, P):
                    break
            return out

        mixed = [g0[0], g1[0], g0[1], g1[1], g1[3], g0[2], g0[4], g1[2], g0[7]]
        for keys, start in [(g0, 0), (g0, 3), (g0, 7), (g0, 8), (g1, 0), (mixed, 0), (mixed, 2), (g0[::-1], 0)]:
            before = counts()
            expect = one_by_one(keys, start)
            by_key = [a - b for a, b in zip(counts(), before)]
            before = counts()
            assert p.probe_prefix(keys, start, writing) == expect, (keys, start)
            assert [a - b for a, b in zip(counts(), before)] == by_key, "counted unlike probe"
        assert p.probe_prefix(g0, 0, writing) == [H, H, P, H, P, H, H, M]
        assert p.probe_prefix(mixed, 0, writing) == [H, H, H, H, P, P, P, M]
        assert p.probe_prefix(g0, 0) == [H, H, M]  # not the caller's: a miss here

        rounds, n_threads = 500, 4
        before = counts()
        answers: list[list[list[KeyState | None]]] = [[] for _ in range(n_threads)]
        go = threading.Barrier(n_threads)

        def scanner(out: list[list[KeyState | None]]) -> None:
            go.wait()
            for _ in range(rounds):
                out.append(p.probe_prefix(mixed, 0, writing))

        threads = [threading.Thread(target=scanner, args=(a,)) for a in answers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(a == [[H, H, H, H, P, P, P, M]] * rounds for a in answers)
        n = rounds * n_threads
        assert [a - b for a, b in zip(counts(), before)] == [2 * n, 0, 2 * n, n], "a count was lost"

        # Keys the CPU tier holds while an overwrite of them is in flight, or the caller writes
        # them again, are PENDING however the run of held keys is found.
        p.inflight.begin([g0[1]])
        before = counts()
        assert p.probe_prefix(g0, 0, {g0[5]}) == [H, P, M]
        assert p.probe_prefix(g0, 3, {g0[5]}) == [H, P, P, H, M]
        assert p.probe_prefix(g0[5:7], 0, {g0[6]}) == [H, P]
        assert [a - b for a, b in zip(counts(), before)] == [4, 2, 0, 0]
        p.inflight.unpend([g0[1]])
        p.inflight.end()

        lane = p._lanes["cpu"]  # fault injection: the CPU tier's breaker opens
        lane.breaker.trip()
        before = counts()
        assert p.probe_prefix(g0, 0, writing) == [None]  # nothing after it probed
        assert counts() == before
        lane.breaker.success()
        assert p.probe_prefix(g0, 5) == [H, H, M]
    assert p.probe_prefix(g0, 0) == [None]  # closed: the asynchronous path answers

    slow = FaultyTier(lmdb(tmp_path / "faulty"))  # a wrapper cannot be probed without waiting
    with make([slow], [PolicyRule()]) as p:
        p.register_group(0, kv(13), blocks_per_chunk=BPC)
        assert p.probe_prefix(g0, 0, {g0[0]}) == [P, None]


def test_probe_prefix_while_the_loop_stores_and_overwrites_the_same_keys() -> None:
    """Scans from three threads while the loop thread stores a group's chunks one after another
    and overwrites stored ones: a key once stored never reads as missing again (a scan's run of
    HIT / PENDING answers only grows), a MISS is only ever the last answer, nothing is None, and
    the group's counts are exactly the HITs and MISSes the scans returned."""
    H, P, M = KeyState.HIT, KeyState.PENDING, KeyState.MISS
    refs = chunks(16)
    keys = [c.key for c in refs]
    with make([cpu()], [PolicyRule()]) as p:
        p.register_group(0, kv(21), blocks_per_chunk=BPC)
        stats = p.group_stats[0]
        before = (stats.hits, stats.misses)
        done = threading.Event()
        answers: list[list[list[KeyState | None]]] = [[] for _ in range(3)]

        def scanner(out: list[list[KeyState | None]]) -> None:
            while not done.is_set():
                out.append(p.probe_prefix(keys, 0))

        threads = [threading.Thread(target=scanner, args=(a,)) for a in answers]
        for t in threads:
            t.start()
        order = [i for n in range(len(refs)) for i in ((n, n // 2) if n % 2 else (n,))]  # new, then an overwrite
        try:
            for job_id, i in enumerate(order, 1):
                assert p.submit_store(StoreJob(job_id, 0, (refs[i],)))
                assert wait_results(p, 1)[job_id].ok
            wait_until(lambda: all(len(a) >= 3 for a in answers), "every scanner scanned")
        finally:
            done.set()
            for t in threads:
                t.join()
        assert p.probe_prefix(keys, 0) == [H] * len(keys)
        for out in answers:
            reach = 0
            for ans in out:
                assert None not in ans and M not in ans[:-1], ans
                run = len(ans) - (ans[-1] is M)
                assert set(ans[:run]) <= {H, P}, ans
                assert run >= reach, (run, reach, "a stored key read as missing")
                reach = run
        scanned = [a for out in answers for a in out] + [[H] * len(keys)]
        hits = sum(a.count(H) for a in scanned)
        misses = sum(a.count(M) for a in scanned)
        assert (stats.hits - before[0], stats.misses - before[1]) == (hits, misses), "counted unlike answered"


def test_lookup_says_pending_until_bytes_are_written(tmp_path: Path) -> None:
    slow = FaultyTier(lmdb(tmp_path), delay_s=0.5, ops={"put_many"})
    with make([slow], [PolicyRule()]) as p:
        p.register_group(0, kv(7), blocks_per_chunk=BPC)
        c = chunks(1)
        p.submit_store(StoreJob(1, 0, c))
        assert p.lookup([c[0].key]) == [(KeyState.PENDING, None)]
        wait_results(p, 1)
        assert p.lookup([c[0].key]) == [(KeyState.HIT, slow.name)]


def test_staging_exhausted_means_back_pressure_not_deadlock(tmp_path: Path) -> None:
    chunk_bytes = BPC * 2 * 4096
    slow = FaultyTier(lmdb(tmp_path), delay_s=0.3, ops={"put_many"})
    with make([slow], staging_bytes=2 * chunk_bytes) as p:
        p.register_group(0, kv(8), blocks_per_chunk=BPC)
        t0 = time.perf_counter()
        admitted = [p.submit_store(StoreJob(i, 0, chunks(1, start=i))) for i in range(6)]
        assert time.perf_counter() - t0 < 0.1, "a full staging pool must not block the caller"
        assert admitted == [True, True, False, False, False, False]
        res = wait_results(p, 2)
        assert set(res) == {0, 1} and all(r.ok for r in res.values())
        assert p.stats().counters["store_backpressure"] == 4
        p.submit_store(StoreJob(10, 0, chunks(1, start=10)))  # room again once the first two finished
        assert wait_results(p, 1)[10].ok


def test_close_with_jobs_in_flight_is_clean(tmp_path: Path) -> None:
    stuck = FaultyTier(lmdb(tmp_path), delay_s=30, ops={"put_many"})
    p = make([stuck], job_timeout_s=60).start()
    p.register_group(0, kv(9), blocks_per_chunk=BPC)
    for i in range(3):
        p.submit_store(StoreJob(i, 0, chunks(1, start=i)))
    t0 = time.perf_counter()
    p.close(timeout=0.5)
    assert time.perf_counter() - t0 < 5
    res = {r.job_id: r for r in p.poll_finished()}
    assert set(res) == {0, 1, 2} and all(not r.ok and "cancelled" in (r.error or "") for r in res.values())
    names = [t.name for t in threading.enumerate()]
    assert not any(n.startswith(("tieredkv-pipeline", "tieredkv-lmdb")) for n in names), names
    assert p.submit_store(StoreJob(5, 0, chunks(1))) is False  # after close: refused, no exception
    assert p.poll_finished() == [] and p.stats().counters["store_refused_closed"] == 1
    p.close()  # idempotent


def test_redis_killed_mid_run_drops_counted_then_heals() -> None:
    with RedisServer() as srv:
        red = RedisTier(RedisTierConfig(url=srv.url, socket_timeout_s=0.5, connect_timeout_s=0.2))
        with make([cpu(), red], breaker_failures=2, breaker_reset_s=0.3, max_batch_items=1) as p:
            p.register_group(0, kv(10), blocks_per_chunk=BPC)
            p.submit_store(StoreJob(0, 0, chunks(1)))
            assert wait_results(p, 1)[0].tiers == {"cpu": 1, "redis": 1}
            srv.kill()
            for i in range(1, 7):
                p.submit_store(StoreJob(i, 0, chunks(1, start=i)))
            res = wait_results(p, 6)
            assert all(r.ok and r.tiers["cpu"] == 1 and r.tiers["redis"] == 0 for r in res.values())
            st = p.stats()
            assert st.dropped["redis"] == 6 and st.breakers["redis"] == "open"
            # Loads of a key only Redis held are misses, not exceptions.
            p.submit_load(LoadJob(50, 0, chunks(1, start=500)))
            assert not wait_results(p, 1)[50].ok
            srv.restart()
            t_restart = time.monotonic()
            healed = False
            i = 100
            while time.monotonic() - t_restart < 5:
                p.submit_store(StoreJob(i, 0, chunks(1, start=i)))
                if wait_results(p, 1)[i].tiers.get("redis") == 1:
                    healed = True
                    break
                i += 1
                time.sleep(0.05)
            assert healed, "breaker did not heal within 5 s of the restart"
            assert p.stats().breakers["redis"] == "closed"
            assert time.monotonic() - t_restart < 5


def test_load_with_null_placeholders_inside_a_chunk(tmp_path: Path) -> None:
    src, dst = kv(11), kv(12)
    with make([cpu()]) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.register_group(1, dst, blocks_per_chunk=BPC, null_block=0)
        c = chunks(1)[0]
        assert p.submit_store(StoreJob(1, 0, (c,)))
        wait_results(p, 1)
        # sliding-window style: only positions 1 and 3 of the chunk are wanted.
        assert p.submit_load(LoadJob(2, 1, (ChunkRef(c.key, (0, 21, 0, 23)),)))
        assert wait_results(p, 1)[2].ok
        for s, d in zip(src, dst):
            assert torch.equal(d[21], s[1]) and torch.equal(d[23], s[3])
        assert not torch.equal(dst[0][20], src[0][0]) and not torch.equal(dst[0][0], src[0][0])
        bad = LoadJob(3, 1, (ChunkRef(c.key, (5, 6)),))  # 2 ids, no skip: malformed
        p.submit_load(bad)
        res = wait_results(p, 1)[3]
        assert not res.ok and "block ids" in (res.error or "")


def test_host_buffer_put_get_route_by_group_and_promote(tmp_path: Path) -> None:
    rules = [PolicyRule(max_chunk_bytes=4096, tiers=["cpu"]), PolicyRule(tiers=["cpu", "lmdb"])]
    with make([cpu(), lmdb(tmp_path)], rules) as p:
        p.policy.route(0, 1024)  # small chunks: cpu only
        p.policy.route(1, 65536)  # large chunks: cpu + lmdb
        small = [(NS.key(bytes([i]) * 32, 0), bytes([i]) * 1024) for i in range(3)]
        large = [(NS.key(bytes([i]) * 32, 1), bytes([i]) * 65536) for i in range(2)]
        assert p.submit_put(1, small + large)
        res = wait_results(p, 1)[1]
        assert res.kind == "put" and res.ok and res.tiers == {"cpu": 5, "lmdb": 2}
        fut = p.lookup_future([k for k, _ in large])
        assert fut.result(5) == [(KeyState.HIT, "cpu")] * 2
        dst = [bytearray(65536) for _ in large] + [bytearray(1024)]
        missing = NS.key(b"\xee" * 32, 0)
        assert p.submit_get(2, [(large[0][0], dst[0]), (large[1][0], dst[1]), (missing, dst[2])])
        res = wait_results(p, 1)[2]
        assert not res.ok and res.failed == (missing,) and res.done == (large[0][0], large[1][0])
        assert bytes(dst[0]) == large[0][1] and bytes(dst[1]) == large[1][1]
    # a new pipeline over the same LMDB: large items come back from LMDB and are promoted
    with make([cpu(), lmdb(tmp_path)], rules) as p:
        p.policy.route(1, 65536)
        out = bytearray(65536)
        assert p.submit_get(3, [(large[1][0], out)])
        res = wait_results(p, 1)[3]
        assert res.ok and res.tiers == {"lmdb": 1} and bytes(out) == large[1][1]
        assert p.lookup([large[1][0]]) == [(KeyState.HIT, "cpu")]


def test_cpu_only_route_copies_straight_into_and_out_of_slots(tmp_path: Path) -> None:
    src, dst = kv(13), kv(14)
    top = cpu()
    with make([top, lmdb(tmp_path)], [PolicyRule(tiers=["cpu"])]) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.register_group(1, dst, blocks_per_chunk=BPC)
        cs = chunks(6)
        assert p.submit_store(StoreJob(1, 0, cs))
        res = wait_results(p, 1)[1]
        assert res.ok and res.tiers == {"cpu": 6} and p.staging.in_use == 0
        assert top.counters["puts"] == 6
        moved = tuple(ChunkRef(c.key, tuple(b + 32 for b in c.block_ids)) for c in cs)
        assert p.submit_load(LoadJob(2, 1, moved))
        res = wait_results(p, 1)[2]
        assert res.ok and res.tiers == {"cpu": 6}
        for s, d in zip(src, dst):
            assert torch.equal(d[32:56], s[0:24])
        assert top.counters["hits"] == 6 and not any(top.is_pinned(c.key) for c in cs)


def test_single_tensor_cpu_group_moves_chunks_without_staging(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(15)
    src = torch.randint(0, 256, (33, 4096), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    with make([lmdb(tmp_path)]) as p:
        p.register_group(0, [src], blocks_per_chunk=2)
        p.register_group(1, [dst], blocks_per_chunk=2)
        cs = tuple(ChunkRef(NS.key(bytes([i]) * 32, 0), (1 + 2 * i, 2 + 2 * i)) for i in range(8))
        assert p.submit_store(StoreJob(1, 0, cs))
        assert wait_results(p, 1)[1].ok
        # contiguous destinations read straight into the tensor; a scattered one goes via staging
        loads = cs[:7] + (ChunkRef(cs[7].key, (30, 17)),)
        assert p.submit_load(LoadJob(2, 1, loads))
        assert wait_results(p, 1)[2].ok
        assert torch.equal(dst[1:15], src[1:15])
        assert torch.equal(dst[30], src[15]) and torch.equal(dst[17], src[16])


def test_tier_dead_at_start_is_an_open_breaker_that_heals() -> None:
    srv = RedisServer().start()
    try:
        srv.stop()
        red = RedisTier(RedisTierConfig(url=srv.url, socket_timeout_s=0.5, connect_timeout_s=0.2))
        with make([cpu(), red], breaker_reset_s=0.2) as p:  # starting must not raise
            assert p.stats().breakers["redis"] == "open"
            p.register_group(0, kv(16), blocks_per_chunk=BPC)
            assert p.submit_store(StoreJob(1, 0, chunks(1)))
            r = wait_results(p, 1)[1]
            assert r.ok and r.tiers == {"cpu": 1, "redis": 0}
            srv.restart()
            deadline = time.monotonic() + 5
            i = 2
            while time.monotonic() < deadline:
                time.sleep(0.25)
                p.submit_store(StoreJob(i, 0, chunks(1, start=i)))
                if wait_results(p, 1)[i].tiers.get("redis") == 1:
                    break
                i += 1
            assert p.stats().breakers["redis"] == "closed"
    finally:
        srv.stop()


def test_job_larger_than_staging_moves_in_parts_and_a_missing_chunk_fails_the_load(tmp_path: Path) -> None:
    chunk_bytes = BPC * 2 * 4096
    src, dst = kv(17), kv(18)
    with make([lmdb(tmp_path)], staging_bytes=2 * chunk_bytes) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.register_group(1, dst, blocks_per_chunk=BPC)
        cs = chunks(7)
        assert p.submit_store(StoreJob(1, 0, cs))  # 7 chunks through room for 2
        res = wait_results(p, 1)[1]
        assert res.ok and res.done == tuple(c.key for c in cs) and res.tiers == {"lmdb": 7}
        moved = tuple(ChunkRef(c.key, tuple(b + 32 for b in c.block_ids)) for c in cs)
        assert p.submit_load(LoadJob(2, 1, moved))
        assert wait_results(p, 1)[2].ok
        for s, d in zip(src, dst):
            assert torch.equal(d[32:60], s[0:28])
        gone = NS.key(b"never stored".ljust(32, b"-"), 0)
        with_miss = moved[:5] + (ChunkRef(gone, moved[5].block_ids),) + moved[6:]
        assert p.submit_load(LoadJob(3, 1, with_miss))
        res = wait_results(p, 1)[3]
        assert not res.ok and res.failed == (gone,) and res.done == ()
        assert "1 of 7 chunks not found" in (res.error or "")
        assert p.stats().counters["store_in_parts"] == 1 and p.stats().counters["load_in_parts"] == 2
        assert p.staging.in_use == 0
        # With most of the pool busy, such a job goes through the room that is free.
        held = p.staging.try_acquire(chunk_bytes)
        assert held is not None
        assert p.submit_store(StoreJob(4, 0, chunks(3)))
        assert wait_results(p, 1)[4].ok
        p.staging.release(held)
        assert p.stats().counters["store_in_parts"] == 2 and p.stats().staging.in_use == 0


class GatedTier(FaultyTier):
    """Fault injection only: the real tier, with ``get_many`` held at a gate until it opens."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, ops={"get_many"})
        self.gate = threading.Event()
        self.entered = threading.Event()

    async def _fault(self, op: str) -> None:
        await super()._fault(op)
        if op == "get_many" and not self.gate.is_set():
            self.entered.set()
            while not self.gate.is_set():
                await asyncio.sleep(0.001)


def test_overwrite_of_a_borrowed_cpu_slot_never_hands_the_load_other_bytes(tmp_path: Path) -> None:
    """A load borrows K's CPU slot and waits (its other chunk is read from LMDB, held at a gate);
    K is overwritten and new keys are stored meanwhile. The load still copies K's old bytes."""
    src = kv(21)
    dst = [torch.zeros_like(t) for t in src]
    top = cpu()
    low = GatedTier(lmdb(tmp_path))
    low.gate.set()
    with make([top, low], [PolicyRule(tiers=["cpu", low.name])]) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.register_group(1, dst, blocks_per_chunk=BPC)
        k, m = chunks(2)
        assert p.submit_store(StoreJob(1, 0, (k, m)))
        assert wait_results(p, 1)[1].ok
        assert p.run(top.delete_many([m.key]), timeout=10) == 1  # m now only in LMDB
        low.gate.clear()
        assert p.submit_load(LoadJob(2, 1, (ChunkRef(k.key, (40, 41, 42, 43)), ChunkRef(m.key, (44, 45, 46, 47)))))
        assert low.entered.wait(60), "the load never reached the lower tier"
        # overwrite k with other bytes, then store other keys into whatever slots are free
        assert p.submit_store(StoreJob(3, 0, (ChunkRef(k.key, (8, 9, 10, 11)),)))
        assert wait_results(p, 1)[3].ok
        others = tuple(ChunkRef(NS.key(bytes([200 + i]) * 32, 0), (12, 13, 14, 15)) for i in range(4))
        assert p.submit_store(StoreJob(4, 0, others))
        assert wait_results(p, 1)[4].ok
        low.gate.set()
        res = wait_results(p, 1)[2]
        if res.ok:
            for s, d in zip(src, dst):
                assert torch.equal(d[40:44], s[0:4]), "the load copied bytes that are not k's old value"
                assert torch.equal(d[44:48], s[4:8])
        else:
            assert k.key in res.failed or not res.done
        # the borrowed slot is back and free once the load is over: k reads its new value
        assert p.submit_load(LoadJob(5, 1, (ChunkRef(k.key, (48, 49, 50, 51)),)))
        assert wait_results(p, 1)[5].ok
        for s, d in zip(src, dst):
            assert torch.equal(d[48:52], s[8:12])
        assert not top.is_pinned(k.key)


async def test_cpu_slot_lent_to_a_reader_is_not_reused_until_given_back() -> None:
    seg = 64 << 10
    async with CPUTier(CPUTierConfig(capacity_bytes=2 * seg, segment_bytes=seg, min_slot_bytes=seg // 2)) as tier:
        key = [NS.key(bytes([i]) * 32, 0) for i in range(8)]
        old, new = b"\x01" * (seg // 2), b"\x02" * (seg // 2)
        await tier.put_many([(key[0], old)])
        (slot,) = tier.borrow([key[0]])
        assert slot is not None
        await tier.put_many([(key[0], new)])  # overwrite: a new slot; the lent one stays as it is
        for i in range(1, 4):  # fill, evict and reclaim everything that can be
            await tier.put_many([(key[i], bytes([16 + i]) * (seg // 2))])
        await tier.put_many([(key[4], b"\x05" * seg)])
        assert bytes(tier.slot_view(slot).numpy()) == old
        assert (await tier.get_many([key[0]]))[0] in (new, None)
        tier.give_back([key[0]], [slot])
        assert not tier.is_pinned(key[0])
        await tier.put_many([(key[5], b"\x06" * (seg // 2)), (key[6], b"\x07" * (seg // 2))])
        await tier.put_many([(key[7], b"\x08" * seg)])  # the freed slot is usable again
        assert (await tier.get_many([key[7]]))[0] == b"\x08" * seg


def wb_items(n: int) -> list[tuple[bytes, bytes]]:
    """``n`` write-back chunks whose bytes name their key."""
    out = []
    for i in range(n):
        key = NS.key(i.to_bytes(32, "big"), 7)
        out.append((key, (key + i.to_bytes(4, "big")) * 64))
    return out


def test_write_back_chunks_acknowledged_in_cpu_survive_a_clean_close(tmp_path: Path) -> None:
    items = wb_items(100)
    p = make([cpu(), lmdb(tmp_path)], [PolicyRule(tiers=["cpu", "lmdb"], write="back")]).start()
    try:
        assert p.policy.route(7, len(items[0][1])).write == "back"
        assert p.submit_put(1, items)
        res = wait_results(p, 1)[1]
        assert res.ok and res.tiers == {"cpu": 100}
        assert {t for _, t in p.lookup([k for k, _ in items])} == {"cpu"}  # nothing written down yet
    finally:
        p.close()
    assert p.stats().counters["write_back_flushed"] == 100
    assert p.stats().counters.get("write_back_lost", 0) == 0

    async def read_back() -> list[bytes | None]:
        async with lmdb(tmp_path) as low:
            return await low.get_many([k for k, _ in items])

    assert asyncio.run(read_back()) == [v for _, v in items]


def test_write_back_flush_at_close_with_the_lower_tier_down_counts_the_loss_and_returns(tmp_path: Path) -> None:
    for fault in ({"fail_with": OSError("disk gone")}, {"delay_s": 60.0}):
        items = wb_items(20)
        down = FaultyTier(lmdb(tmp_path / str(len(fault))), ops={"put_many"}, **fault)  # type: ignore[arg-type]
        p = make([cpu(), down], [PolicyRule(tiers=["cpu", down.name], write="back")]).start()
        p.policy.route(7, len(items[0][1]))
        assert p.submit_put(1, items)
        assert wait_results(p, 1)[1].ok
        p.close(timeout=0.5)  # bounded: a dead or hanging tier never holds close() up
        c = p.stats().counters
        assert c["write_back_lost"] == 20 and c.get("write_back_flushed", 0) == 0, c
        names = [t.name for t in threading.enumerate()]
        assert not any(n.startswith("tieredkv-pipeline") for n in names), names


async def test_a_tier_writer_batches_whole_slices_of_jobs_within_its_limits(tmp_path: Path) -> None:
    """Jobs reach a tier's writer as slices (no future per chunk): a slice never exceeds
    max_batch_items, slices of several jobs share a batch while they fit, every key gets its own
    batch's outcome, and the bytes land. A dead tier drops every item of the batch, counted."""
    from tieredkv.pipeline.lanes import Outcome, TierLane

    tier = FaultyTier(lmdb(tmp_path), delay_s=0.05, ops={"put_many"})
    async with tier:
        lane = TierLane(tier, PipelineConfig(max_batch_items=8, max_batch_bytes=1 << 20))
        lane.task = asyncio.get_running_loop().create_task(lane.run())
        try:
            jobs = [[NS.key(f"{j}:{i}".encode(), 0) for i in range(n)] for j, n in enumerate((5, 3, 9))]
            data = {k: bytes([len(k) % 251, i % 251]) * 512 for ks in jobs for i, k in enumerate(ks)}
            queued = [lane.write_many(ks, [data[k] for k in ks]) for ks in jobs]
            assert [[c for c, _ in parts] for parts in queued] == [[5], [3], [8, 1]]
            for parts in queued:
                assert [await f for _, f in parts] == [Outcome.OK] * len(parts)
            assert tier.put_sizes == [8, 8, 1]  # 5 + 3 together, the 9 as 8 + 1: never above 8
            keys = list(data)
            got = await tier.get_many(keys)
            assert [bytes(g) for g in got] == [data[k] for k in keys]

            # By bytes: 1 KiB items under a 3 KiB batch limit go three to a slice.
            lane.max_bytes = 3 * 1024
            ks = [NS.key(f"b:{i}".encode(), 0) for i in range(7)]
            parts = lane.write_many(ks, [data[keys[0]]] * 7)
            assert [c for c, _ in parts] == [3, 3, 1]
            assert [await f for _, f in parts] == [Outcome.OK] * 3

            tier.fail_with = OSError("disk gone")
            ks = [NS.key(f"dead:{i}".encode(), 0) for i in range(10)]
            parts = lane.write_many(ks, [data[keys[0]]] * 10)
            assert [await f for _, f in parts] == [Outcome.DROPPED] * len(parts)
            assert lane.dropped == 10
        finally:
            lane.task.cancel()
            await asyncio.gather(lane.task, return_exceptions=True)


async def test_a_writer_batch_that_fails_with_a_bug_is_answered_and_the_lane_goes_on(tmp_path: Path) -> None:
    """An exception that is not a tier's failure (here a NotImplementedError, which the tier's
    guard lets through) drops that batch, counted and answered, and the lane writes the next
    one: no job is left waiting on a batch nobody answers. The lane keeps two batches in flight
    on the LMDB tier underneath, and both are answered."""
    from tieredkv.pipeline.lanes import Outcome, TierLane

    tier = FaultyTier(lmdb(tmp_path), fail_with=NotImplementedError("a bug"), ops={"put_many"})
    async with tier:
        assert tier.capabilities.writes_in_flight == 2
        lane = TierLane(tier, PipelineConfig(max_batch_items=2))
        lane.task = asyncio.get_running_loop().create_task(lane.run())
        try:
            ks = [NS.key(f"bug:{i}".encode(), 0) for i in range(4)]
            parts = lane.write_many(ks, [memoryview(bytes([i]) * 100) for i in range(4)])
            assert [await f for _, f in parts] == [Outcome.DROPPED, Outcome.DROPPED]
            assert lane.dropped == 4 and not lane.task.done()
            tier.fail_with = None
            parts = lane.write_many(ks[:2], [memoryview(b"ok" * 50)] * 2)
            assert [await f for _, f in parts] == [Outcome.OK]
            assert [bytes(g or b"") for g in await tier.get_many(ks)] == [b"ok" * 50] * 2 + [b""] * 2
        finally:
            lane.task.cancel()
            await asyncio.gather(lane.task, return_exceptions=True)


def test_a_record_of_another_length_leaves_none_of_its_bytes_in_the_blocks(tmp_path: Path) -> None:
    """A verified record under a chunk's key whose payload is not the chunk's size (a foreign
    writer's geometry) is a miss, and what of it landed in the engine's blocks (read straight
    into them) is zeroed: a failed load leaves no byte that is not the chunk's."""
    from tieredkv.format import encode_record

    src, dst = kv(21), kv(22)
    low = lmdb(tmp_path)
    with make([low]) as p:
        p.register_group(0, src, blocks_per_chunk=BPC)
        p.register_group(1, [dst[0]], blocks_per_chunk=BPC)  # one tensor: loads go straight into it
        key = NS.key((77).to_bytes(32, "big"), 1)
        short = bytes([0x55]) * (2 * 4096)  # half a chunk (4 blocks of 4 KiB)
        p.run(low.raw_put_many([(key, encode_record(key, short))]), 30)
        dst[0][8:12] = 0xAA
        assert p.submit_load(LoadJob(5, 1, (ChunkRef(key, (8, 9, 10, 11)),)))
        res = wait_results(p, 1)[5]
        assert not res.ok and res.failed == (key,)
        landed = dst[0][8:12].flatten()
        assert not (landed == 0x55).any(), "the foreign record's bytes stayed in the engine's blocks"

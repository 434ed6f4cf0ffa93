"""Tenant isolation through the library API: a tenant per record, quotas per tenant in the CPU
tier (its own records evicted first), usage reported, one tenant's flood never costing another
tenant a record within its quota."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tieredkv
from tieredkv.backends.cpu import CPUTier
from tieredkv.config import CPUTierConfig, PipelineConfig, load_config
from tieredkv.errors import TierFullError
from tieredkv.format import decode_header
from tieredkv.keys import Namespace, tenant_id
from tieredkv.pipeline import KeyState
from tieredkv.pipeline.lanes import Outcome, TierLane
from tieredkv.tenants import TenantQuotas

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 16 * KiB  # one slot of the 16 KiB class: a tenant's bytes are its chunks' bytes
NS = Namespace(model="test/tenants")
A, B, C = tenant_id("acme"), tenant_id("bravo"), tenant_id("charlie")


def cfg(**extra: Any) -> dict[str, Any]:
    """One CPU tier of 4 MiB (256 chunks); acme may hold 1 MiB, bravo 1 MiB, charlie 512 KiB,
    every other tenant 256 KiB; records without a tenant have no quota."""
    return {
        "namespace": {"model": "tenants-test"},
        "tiers": [{"kind": "cpu", "capacity_bytes": "4MiB", "segment_bytes": "1MiB", "min_slot_bytes": "16KiB"}],
        "tenants": {"default_quota": "256KiB", "quotas": {"acme": "1MiB", "bravo": "25%", "charlie": "512KiB"}},
        **extra,
    }


def metric_samples(store: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    store.run(store.metrics.refresh_stats())
    text = generate_latest(store.metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


class Device:
    """A CPU stand-in for engine KV blocks: one block per chunk, every block's bytes distinct."""

    def __init__(self, store: Any, blocks: int) -> None:
        self.kv = torch.randint(0, 256, (blocks, CHUNK), dtype=torch.uint8)
        self.store = store
        store.register_group(0, [self.kv])

    def store_chunks(self, keys: list[bytes], first_block: int, tenant: Any) -> Any:
        job = self.store.store(0, [(k, (first_block + i,)) for i, k in enumerate(keys)], tenant=tenant)
        assert job is not None
        return self.store.wait([job])[job]


def keys_of(store: Any, name: str, n: int) -> list[bytes]:
    return [store.key(name.encode().ljust(8, b".") + i.to_bytes(24, "big"), 0) for i in range(n)]


def test_one_tenant_floods_the_others_keep_every_record_within_their_quota() -> None:
    with tieredkv.open_store(cfg()) as store:
        dev = Device(store, 640)
        bravo, charlie = keys_of(store, "bravo", 48), keys_of(store, "charlie", 24)  # 768 KiB, 384 KiB
        plain = keys_of(store, "plain", 16)  # 256 KiB without a tenant
        acme = keys_of(store, "acme", 400)  # 6.25 MiB: six times its quota, more than the whole tier
        assert dev.store_chunks(bravo[:24], 0, "bravo").ok
        assert dev.store_chunks(plain, 100, None).ok
        for i in range(0, 200, 20):  # acme floods in jobs of 20 chunks, between the others' stores
            assert dev.store_chunks(acme[i : i + 20], 200 + i, "acme").ok
        assert dev.store_chunks(bravo[24:], 24, "bravo").ok
        assert dev.store_chunks(charlie, 72, b"charlie").ok
        for i in range(200, 400, 20):
            assert dev.store_chunks(acme[i : i + 20], 200 + i, "acme").ok

        states = store.lookup(bravo + charlie + plain + acme)
        held = [s is KeyState.HIT for s, _ in states]
        assert all(held[: 48 + 24 + 16]), "a tenant within its quota lost records to acme's flood"
        kept_acme = held[48 + 24 + 16 :]
        assert sum(kept_acme) == MiB // CHUNK  # acme keeps what its quota holds: its newest chunks
        assert kept_acme == [False] * (400 - 64) + [True] * 64

        # every surviving record loads byte-exact (into fresh blocks), under the loader's tenant
        for name, keys, first in (("bravo", bravo, 0), ("charlie", charlie, 72), (None, plain, 100)):
            job = store.load(0, [(k, (600 + i % 40,)) for i, k in enumerate(keys[:40])], tenant=name)
            assert job is not None and store.wait([job])[job].ok
            assert torch.equal(dev.kv[600 : 600 + min(40, len(keys))], dev.kv[first : first + min(40, len(keys))])

        usage = store.tenant_usage()["cpu"]
        assert usage is not None
        assert usage[A] == MiB  # at its quota, never over
        assert usage[B] == 48 * CHUNK and usage[C] == 24 * CHUNK and usage[0] == 16 * CHUNK
        cpu = store.tiers[0]
        assert cpu.counters["tenant_evictions"] == 400 - 64
        assert cpu.counters["evictions"] == 400 - 64  # every eviction was acme's own record

        m = metric_samples(store)
        assert m[("tieredkv_tenant_used_bytes", (("tenant", "acme"), ("tier", "cpu")))] == MiB
        assert m[("tieredkv_tenant_used_bytes", (("tenant", "bravo"), ("tier", "cpu")))] == 48 * CHUNK
        assert m[("tieredkv_tenant_used_bytes", (("tenant", "charlie"), ("tier", "cpu")))] == 24 * CHUNK
        assert m[("tieredkv_tenant_used_bytes", (("tenant", "-"), ("tier", "cpu")))] == 16 * CHUNK
        assert m[("tieredkv_tenant_quota_bytes", (("tenant", "bravo"), ("tier", "cpu")))] == MiB  # 25% of 4 MiB
        assert m[("tieredkv_tier_tenant_evictions_total", (("tier", "cpu"),))] == 400 - 64


def test_a_store_larger_than_the_tenants_whole_quota_is_refused_and_counted() -> None:
    with tieredkv.open_store(cfg()) as store:
        dev = Device(store, 128)
        own = keys_of(store, "delta", 8)  # delta: the default quota, 256 KiB = 16 chunks
        assert dev.store_chunks(own, 0, "delta").ok
        other = keys_of(store, "bravo", 8)
        assert dev.store_chunks(other, 8, "bravo").ok
        big = keys_of(store, "delta-big", 17)  # one chunk over delta's whole quota
        res = dev.store_chunks(big, 16, "delta")
        assert not res.ok and set(res.failed) == set(big)
        # nothing of anyone's was evicted for it, delta's own records included
        assert [s for s, _ in store.lookup(own + other + big)] == [KeyState.HIT] * 16 + [KeyState.MISS] * 17
        cpu = store.tiers[0]
        assert cpu.counters["tenant_refusals"] == 1 and cpu.counters["evictions"] == 0
        m = metric_samples(store)
        assert m[("tieredkv_tier_tenant_refusals_total", (("tier", "cpu"),))] == 1
        assert m[("tieredkv_tenant_used_bytes", (("tenant", f"{tenant_id('delta'):016x}"), ("tier", "cpu")))] == (
            8 * CHUNK
        )
        # host-buffer records take the same path (the tier's put_many with tenants)
        job = store.put_records([(k, bytes(CHUNK)) for k in keys_of(store, "delta-rec", 17)], tenant="delta")
        assert job is not None and not store.wait([job])[job].ok
        assert cpu.counters["tenant_refusals"] == 2


def test_two_threads_storing_for_two_tenants_each_stay_within_their_quota() -> None:
    """Two engine threads flood at once, each for its tenant: each keeps exactly its newest
    quota's worth (its own oldest records went first), none of the other's was taken for it."""
    config = cfg(tenants={"quotas": {"acme": "1MiB", "bravo": "512KiB"}})
    with tieredkv.open_store(config) as store:
        dev = Device(store, 512 + 64)
        keys = {"acme": keys_of(store, "acme", 256), "bravo": keys_of(store, "bravo", 256)}
        first = {"acme": 0, "bravo": 256}
        go = threading.Barrier(2)
        errors: list[BaseException] = []

        def flood(name: str) -> None:
            try:
                go.wait(timeout=30)
                for i in range(0, 256, 8):  # jobs of 8 chunks, each admitted before the next is sent
                    chunks = [(k, (first[name] + i + j,)) for j, k in enumerate(keys[name][i : i + 8])]
                    while store.store(0, chunks, tenant=name) is None:  # back-pressure: offer it again
                        store.drain(1.0)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=flood, args=(n,)) for n in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert store.drain(30)
        assert all(r.ok for r in store.poll())
        usage = store.tenant_usage()["cpu"]
        assert usage is not None and usage[A] == MiB and usage[B] == 512 * KiB
        for name, quota in (("acme", MiB), ("bravo", 512 * KiB)):
            n = quota // CHUNK
            held = [s is KeyState.HIT for s, _ in store.lookup(keys[name])]
            assert held == [False] * (256 - n) + [True] * n, name
            job = store.load(0, [(k, (512 + i,)) for i, k in enumerate(keys[name][-n:])], tenant=name)
            assert job is not None and store.wait([job])[job].ok
            src = first[name] + 256 - n
            assert torch.equal(dev.kv[512 : 512 + n], dev.kv[src : src + n])
        assert store.tiers[0].counters["evictions"] == (256 - 64) + (256 - 32)


def test_two_threads_storing_for_two_tenants_into_a_full_tier_evict_their_oldest_and_keep_the_books() -> None:
    """Two engine threads store for two tenants at once, twice what the tier holds, no quota in
    the way: once the slab is full every batch evicts its room in one walk (tenants' batches
    too). Each tenant keeps a run of its newest chunks, the books add up to what is held, and
    every record still held loads byte-exact."""
    config = cfg(tenants={"quotas": {"acme": "8MiB", "bravo": "8MiB"}})
    with tieredkv.open_store(config) as store:
        dev = Device(store, 512 + 256)
        keys = {"acme": keys_of(store, "acme", 256), "bravo": keys_of(store, "bravo", 256)}
        first = {"acme": 0, "bravo": 256}
        go = threading.Barrier(2)
        errors: list[BaseException] = []

        def flood(name: str) -> None:
            try:
                go.wait(timeout=30)
                for i in range(0, 256, 16):
                    chunks = [(k, (first[name] + i + j,)) for j, k in enumerate(keys[name][i : i + 16])]
                    while store.store(0, chunks, tenant=name) is None:  # back-pressure: offer it again
                        store.drain(1.0)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=flood, args=(n,)) for n in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert store.drain(30)
        assert all(r.ok for r in store.poll())
        cpu = store.tiers[0]
        assert cpu.counters["evictions"] == 512 - 256 and cpu.counters.get("tenant_evictions", 0) == 0
        usage = store.tenant_usage()["cpu"]
        assert usage is not None
        kept = {}
        for name, tid in (("acme", A), ("bravo", B)):
            held = [s is KeyState.HIT for s, _ in store.lookup(keys[name])]
            n = sum(held)
            assert held == [False] * (256 - n) + [True] * n, name  # its oldest went first
            assert usage.get(tid, 0) == n * CHUNK, (name, n, usage)
            kept[name] = n
        assert sum(kept.values()) == 256  # the whole slab, nothing lost or counted twice
        for name, n in kept.items():
            if not n:
                continue
            job = store.load(0, [(k, (512 + i,)) for i, k in enumerate(keys[name][-n:])], tenant=name)
            assert job is not None and store.wait([job])[job].ok
            src = first[name] + 256 - n
            assert torch.equal(dev.kv[512 : 512 + n], dev.kv[src : src + n])


class _HeldMove:
    """Fault injection around a real queued host move (``move_pieces_async``'s ticket): it
    reports itself not over until the test opens the gate, so the slot store that made it stays
    in flight, holding its reserved slots against its tenant's quota."""

    def __init__(self, real: Any, gate: threading.Event) -> None:
        self.real, self.gate = real, gate

    def query(self) -> bool:
        return self.gate.is_set() and bool(self.real.query())

    def cancel(self) -> bool:
        return bool(self.real.cancel())

    def synchronize(self) -> None:
        self.real.synchronize()


class _HeldSlotStores:
    """Slot stores held in flight on a real store: every host copy is queued for real but
    reported not over (:class:`_HeldMove`) until :meth:`release`, and the CPU tier's reserves
    are logged (``("reserved" | "refused", first key)``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tieredkv import staging
        from tieredkv.backends.cpu.slab import SlabTier

        real_async = staging._move_pieces_async
        assert real_async is not None, "the C helper is not built"  # the test command builds it
        self.gate = threading.Event()
        self.fds: set[int] = set()
        self.log: list[tuple[str, bytes]] = []

        def held(*a: Any) -> _HeldMove:
            self.fds.add(a[-1])
            return _HeldMove(real_async(*a), self.gate)

        real_reserve = SlabTier.reserve

        def reserve(tier: Any, items: list[tuple[bytes, int]], tenant: Any = 0) -> Any:
            try:
                slots = real_reserve(tier, items, tenant)
            except TierFullError:
                self.log.append(("refused", items[0][0]))
                raise
            self.log.append(("reserved", items[0][0]))
            return slots

        monkeypatch.setattr(staging, "_move_pieces_async", held)
        monkeypatch.setattr(SlabTier, "reserve", reserve)

    def until(self, what: tuple[str, bytes]) -> None:
        deadline = time.monotonic() + 60  # a bound for a broken build, not a wait for work
        while what not in self.log:
            assert time.monotonic() < deadline, self.log
            time.sleep(0.001)

    def hold_then_refuse(self, store: Any, held: list[bytes], refused: list[bytes], tenant: str) -> list[Any]:
        """Store ``held`` (blocks from 0) until its slots are reserved and its copies held, then
        ``refused`` (the blocks after) until the tier has refused it once; their job ids."""
        jobs = [_send(store, held, 0, tenant)]
        self.until(("reserved", held[0]))
        jobs.append(_send(store, refused, len(held), tenant))
        self.until(("refused", refused[0]))
        return jobs

    def release(self) -> None:
        self.gate.set()
        for fd in self.fds:  # the held moves are over: wake the loop's watch of the mover's pipe
            os.write(fd, b"w")


def _send(store: Any, keys: list[bytes], first: int, tenant: str) -> Any:
    job = store.store(0, [(k, (first + i,)) for i, k in enumerate(keys)], tenant=tenant)
    assert job is not None
    return job


def test_stores_waiting_for_their_tenants_room_take_it_in_the_order_they_came(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """acme (4 chunks of quota) has 3 chunks in flight (X, their copies held); Y (2 chunks) is
    refused and waits; Z (1 chunk) comes after it and would fit at once. Z waits behind Y: a
    tenant's stores take their slots, and so their places in its eviction order, in the order
    they came (Z first would outlive Y's newer chunks). bravo's store is in no one's line."""
    held = _HeldSlotStores(monkeypatch)
    config = cfg(tenants={"quotas": {"acme": "64KiB", "bravo": "64KiB"}})
    with tieredkv.open_store(config) as store:
        dev = Device(store, 16)
        acme, bravo = keys_of(store, "acme", 6), keys_of(store, "bravo", 1)
        x, y, z = acme[:3], acme[3:5], acme[5:]
        jobs = held.hold_then_refuse(store, x, y, "acme")
        jobs.append(_send(store, z, 5, "acme"))
        jobs.append(_send(store, bravo, 6, "bravo"))
        held.until(("reserved", bravo[0]))  # another tenant's store is held up by no line
        assert ("reserved", z[0]) not in held.log, "a later store overtook one waiting for its tenant's room"
        held.release()
        results = store.wait(jobs, timeout=60)
        assert all(r.ok for r in results.values()), results
        order = [k for what, k in held.log if what == "reserved" and k in (x[0], y[0], z[0])]
        assert order == [x[0], y[0], z[0]]
        # acme's eviction order is the stores' order: its quota keeps X's newest chunk, Y and Z
        kept = [s is KeyState.HIT for s, _ in store.lookup(acme)]
        assert kept == [False, False, True, True, True, True]
        job = store.load(0, [(k, (8 + i,)) for i, k in enumerate(acme[2:])], tenant="acme")
        assert job is not None and store.wait([job])[job].ok
        assert torch.equal(dev.kv[8:12], dev.kv[2:6])


def test_a_store_refused_for_good_at_the_head_of_its_line_lets_the_next_one_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Y (5 chunks, more than acme's whole 4-chunk quota) is refused while X is in flight, so it
    waits in acme's line, and Z (1 chunk) queues behind it. When X ends, Y is refused again with
    nothing in flight (for good: its keys fail, counted) and Z tries at once: no slot store is
    left to end and wake it, so waiting for one would hang it."""
    held = _HeldSlotStores(monkeypatch)
    config = cfg(tenants={"quotas": {"acme": "64KiB"}})
    with tieredkv.open_store(config) as store:
        dev = Device(store, 16)
        acme = keys_of(store, "acme", 9)
        x, y, z = acme[:3], acme[3:8], acme[8:]
        jobs = held.hold_then_refuse(store, x, y, "acme")
        jobs.append(_send(store, z, 8, "acme"))
        held.release()
        results = store.wait(jobs, timeout=60)
        assert len(results) == 3, results
        rx, ry, rz = (results[j] for j in jobs)
        assert rx.ok and rz.ok, results
        assert not ry.ok and set(ry.failed) == set(y)
        assert [what for what, k in held.log if k == y[0]] == ["refused", "refused"]
        assert [s is KeyState.HIT for s, _ in store.lookup(acme)] == [True] * 3 + [False] * 5 + [True]
        job = store.load(0, [(z[0], (12,))], tenant="acme")
        assert job is not None and store.wait([job])[job].ok
        assert torch.equal(dev.kv[12], dev.kv[8])


async def test_a_refused_tenant_in_a_shared_batch_leaves_the_others_stored() -> None:
    """A writer lane batches items of several callers; one tenant's refusal (its store larger than
    its quota) must not refuse another tenant's items of the same batch."""
    tier = CPUTier(CPUTierConfig(capacity_bytes="2MiB", segment_bytes="1MiB", min_slot_bytes="16KiB"))
    tier.set_quotas(TenantQuotas.from_config(load_config({"tenants": {"quotas": {"acme": "64KiB"}}}).tenants))
    async with tier:
        lane = TierLane(tier, PipelineConfig())
        lane.task = asyncio.get_running_loop().create_task(lane.run())
        try:
            big = [NS.key(b"acme" + i.to_bytes(28, "big"), 0) for i in range(5)]  # 80 KiB > 64 KiB
            fine = [NS.key(b"bravo" + i.to_bytes(27, "big"), 0) for i in range(3)]
            parts_a = lane.write_many(big, [memoryview(bytes(CHUNK))] * 5, A)  # queued in the same tick:
            parts_b = lane.write_many(fine, [memoryview(bytes([7]) * CHUNK)] * 3, B)  # one batch
            assert [await f for _, f in parts_a] == [Outcome.FULL]
            assert [await f for _, f in parts_b] == [Outcome.OK]
        finally:
            lane.task.cancel()
        assert await tier.contains_many(big + fine) == [False] * 5 + [True] * 3
        assert await tier.tenant_usage() == {0: 0, B: 3 * CHUNK}
        # the records carry their tenant when they leave the process (raw: migrate, tools)
        (raw,) = await tier.raw_get_many(fine[:1])
        assert raw is not None and decode_header(raw).tenant == B


async def test_cpu_tier_full_slab_takes_a_tenant_over_its_quota_first_and_raw_records_keep_theirs() -> None:
    """Records that came raw (migrated) carry their tenant; a tenant over its quota (here: quotas
    lowered after its records were stored) loses its records first when the slab is full."""
    tier = CPUTier(CPUTierConfig(capacity_bytes="1MiB", segment_bytes="1MiB", min_slot_bytes="16KiB"))
    async with tier:
        old = [NS.key(b"plain" + i.to_bytes(27, "big"), 0) for i in range(32)]
        acme = [NS.key(b"acme" + i.to_bytes(28, "big"), 0) for i in range(32)]
        await tier.put_many([(k, bytes(CHUNK)) for k in old])  # the oldest: first in plain LRU order
        await tier.put_many([(k, bytes(CHUNK)) for k in acme], tenants=[A] * 32)
        raws = await tier.raw_get_many(acme)
        assert all(r is not None and decode_header(r).tenant == A for r in raws)
        tier.set_quotas(TenantQuotas.from_config(load_config({"tenants": {"quotas": {"acme": "256KiB"}}}).tenants))
        # the slab is full (64 x 16 KiB); 16 more records of the default tenant need 16 slots
        await tier.put_many([(NS.key(b"new" + i.to_bytes(29, "big"), 0), bytes(CHUNK)) for i in range(16)])
        assert all(await tier.contains_many(old))  # the least recently used, yet kept
        assert sum(await tier.contains_many(acme)) == 16  # acme, over its quota, paid for the room
        assert (await tier.tenant_usage())[A] == 256 * KiB
        # raw records keep the tenant their header names (and are bounded by its quota)
        await tier.delete_many(acme)
        await tier.raw_put_many([(k, r) for k, r in zip(acme, raws) if r is not None])
        assert (await tier.tenant_usage())[A] == 256 * KiB
        assert await tier.get_many(acme[-1:]) == [bytes(CHUNK)]  # verified with its tenant


def test_write_back_and_promotion_keep_the_tenant() -> None:
    """A record evicted for its tenant's quota goes down as that tenant's record (write-back), and
    one a load finds below comes back up as the loader's (promotion), within its quota there. The
    lower tier is a second CPU tier: one that keeps tenants, whatever the other tiers do."""
    slab = {"kind": "cpu", "capacity_bytes": "1MiB", "segment_bytes": "1MiB", "min_slot_bytes": "16KiB"}
    config = {
        "namespace": {"model": "tenants-wb"},
        "tiers": [{**slab, "name": "hot"}, {**slab, "name": "warm"}],
        "policy": [{"tiers": ["hot", "warm"], "write": "back"}],
        "tenants": {"quotas": {"acme": "128KiB"}, "default_quota": "512KiB"},
    }
    with tieredkv.open_store(config) as store:
        dev = Device(store, 64)
        keys = keys_of(store, "acme", 16)
        for i in range(0, 16, 4):  # 256 KiB in all: the first 8 go down as acme evicts them for its quota
            assert dev.store_chunks(keys[i : i + 4], i, "acme").ok
        assert store.drain(30)
        warm = store.tiers[1]
        assert [t for _, t in store.lookup(keys)] == ["warm"] * 8 + ["hot"] * 8
        raws = store.run(warm.raw_get_many(keys[:8]))
        assert all(r is not None and decode_header(r).tenant == A for r in raws)
        assert store.tenant_usage() == {"hot": {0: 0, A: 128 * KiB}, "warm": {0: 0, A: 128 * KiB}}
        # a load of them promotes them back into the first tier: acme's records there, so acme's
        # others make room (and go down in turn)
        job = store.load(0, [(k, (32 + i,)) for i, k in enumerate(keys[:8])], tenant="acme")
        assert job is not None and store.wait([job])[job].ok
        assert torch.equal(dev.kv[32:40], dev.kv[0:8])
        assert store.drain(30)
        assert [t for _, t in store.lookup(keys)] == ["hot"] * 8 + ["warm"] * 8
        assert store.tenant_usage()["hot"] == {0: 0, A: 128 * KiB}


def test_a_tenant_is_a_name_an_id_or_none() -> None:
    with tieredkv.open_store(cfg()) as store:
        dev = Device(store, 8)
        k = keys_of(store, "x", 2)
        assert dev.store_chunks(k[:1], 0, A).ok  # an id tenant_id made: the same tenant as "acme"
        assert dev.store_chunks(k[1:], 1, "").ok  # empty: the default tenant
        usage = store.tenant_usage()["cpu"]
        assert usage == {0: CHUNK, A: CHUNK}
        for bad in (True, -1, 2**64, 1.5, object()):
            with pytest.raises(TypeError, match="is not a tenant"):
                store.store(0, [(k[0], (0,))], tenant=bad)


async def test_cpu_tier_at_quota_an_overwrite_fits_and_pinned_records_refuse_the_store() -> None:
    tier = CPUTier(CPUTierConfig(capacity_bytes="1MiB", segment_bytes="1MiB", min_slot_bytes="16KiB"))
    tier.set_quotas(TenantQuotas.from_config(load_config({"tenants": {"quotas": {"acme": "64KiB"}}}).tenants))
    async with tier:
        keys = [NS.key(b"acme" + i.to_bytes(28, "big"), 0) for i in range(5)]
        await tier.put_many([(k, bytes([i]) * CHUNK) for i, k in enumerate(keys[:4])], tenants=[A] * 4)
        await tier.put_many([(keys[3], b"\x09" * CHUNK)], tenants=[A])  # at its quota: its own key again
        assert await tier.contains_many(keys) == [True] * 4 + [False]
        assert tier.counters["evictions"] == 0 and (await tier.tenant_usage())[A] == 64 * KiB
        tier.pin_many(keys[:4])  # being read: none of its records may go
        with pytest.raises(TierFullError, match="acme"):
            await tier.put_many([(keys[4], bytes(CHUNK))], tenants=[A])
        assert tier.counters["tenant_refusals"] == 1
        assert await tier.get_many(keys[:4]) == [bytes([i]) * CHUNK for i in range(3)] + [b"\x09" * CHUNK]
        tier.unpin_many(keys[:4])
        await tier.put_many([(keys[4], bytes(CHUNK))], tenants=[A])
        assert await tier.contains_many(keys) == [False] + [True] * 4  # its least recently used went


def test_the_documented_tenants_example_is_a_valid_config() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "sharing.md").read_text(encoding="utf-8")
    section = text[text.index("## Tenants") :]
    block = section[section.index("```yaml\n") + 8 : section.index("```\n", section.index("```yaml"))]
    quotas = TenantQuotas.from_config(load_config(yaml.safe_load(block), env={}).tenants)
    assert quotas.limit(tenant_id("acme"), None) == 8 << 30
    assert quotas.limit(tenant_id("globex"), 1000) == 250
    assert quotas.limit(tenant_id("anyone"), None) == 2 << 30 and quotas.report_top == 20


async def test_cpu_tier_room_a_tenant_makes_comes_back_in_slab_order() -> None:
    """The slots a tenant's own evictions free go to its batch in the order they lie in the slab,
    so a job's chunks stay back to back and move with one copy (``span_view``), as they do when
    the slab evicts by itself."""
    tier = CPUTier(CPUTierConfig(capacity_bytes="1MiB", segment_bytes="1MiB", min_slot_bytes="16KiB"))
    tier.set_quotas(TenantQuotas.from_config(load_config({"tenants": {"quotas": {"acme": "128KiB"}}}).tenants))
    async with tier:
        for r in range(4):  # each job takes the whole quota: acme's previous job makes the room
            keys = [NS.key(bytes([r]) * 4 + i.to_bytes(28, "big"), 0) for i in range(8)]
            slots = tier.reserve([(k, CHUNK) for k in keys], A)
            assert tier.span_view(slots) is not None, [s.offset for s in slots]
            tier.commit(list(zip(keys, slots)))
        assert tier.counters["tenant_evictions"] == 24


async def test_cpu_tier_a_tenants_batch_into_a_full_tier_evicts_its_room_in_one_walk() -> None:
    """A tenant's batch into a full tier (every record the default tenant's, no quota in the way)
    finds its room as the default tenant's does: the oldest records that are neither pinned nor
    read since, exactly as many as it needs, in one walk of the policy (one removal notice for
    the batch, not one per record), and their slots come back in slab order (one copy)."""
    tier = CPUTier(CPUTierConfig(capacity_bytes="1MiB", segment_bytes="1MiB", min_slot_bytes="16KiB"))
    heard: list[list[bytes]] = []
    tier.set_removal_listener(heard.append)
    async with tier:
        old = [NS.key(b"old" + i.to_bytes(29, "big"), 0) for i in range(64)]  # the whole slab
        tier.commit(list(zip(old, tier.reserve([(k, CHUNK) for k in old]))))
        tier.pin_many([old[1]])
        (lent,) = tier.borrow([old[2]])  # read: the newest now (and pinned while lent)
        tier.give_back([old[2]], [lent])
        keys = [NS.key(b"new" + i.to_bytes(29, "big"), 0) for i in range(4)]
        slots = tier.reserve([(k, CHUNK) for k in keys], A)
        assert tier.span_view(slots) is None  # 0, 3, 4, 5: not back to back around the pinned one
        assert [s.offset for s in slots] == sorted(s.offset for s in slots)
        tier.commit(list(zip(keys, slots)))
        assert len(heard) == 1 and sorted(heard[0]) == sorted([old[0], old[3], old[4], old[5]])  # one notice
        assert tier.counters["evictions"] == 4 and tier.counters.get("tenant_evictions", 0) == 0
        held = await tier.contains_many(old + keys)
        assert [o for o, h in zip(old, held) if not h] == [old[0], old[3], old[4], old[5]]
        assert all(held[len(old) :])

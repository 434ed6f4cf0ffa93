"""KV events from tieredkv's tiers, read where a KV-aware router reads them: vLLM's own publisher.

Each row runs the engine-loop workload (``tests/vllm/engine.py``: vLLM 0.33's real scheduler and
offloading connector, the emulated model runner) with vLLM's KV cache events on and its real
``ZmqEventPublisher`` (an ``inproc://`` endpoint and its replay socket), so every event goes the
path vLLM's own CPU tier's go: the manager's / secondary tier's ``take_events`` → the connector's
events tracker → ``KVEventBatch`` → the publisher's thread → msgpack on the socket. The test reads
every batch back from the replay socket, decodes it as ``KVEventBatch``, replays tieredkv's
``BlockStored`` / ``BlockRemoved`` per (medium, ownership) and checks the result is exactly what
each tier holds at the end (its records of the engine's namespace, as vLLM's (group, block hash)),
with tiers small enough that every one of them evicts, and removal events for each.

Rows: the whole spec over a CPU tier written back to LMDB (vLLM's connector; and tieredkv's
connector on the hybrid full + sliding-window + Mamba schedule with ``blocks_per_chunk`` 2 —
partial records — and async scheduling without settling); the spec over the fs tier; the
secondary tier under vLLM's tiering spec over a CPU tier written back to fs, over Redis with
``maxmemory`` (keyspace notifications) and over Redis as an ACL user without ``CONFIG`` (the
bounded scan).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import Locality, Medium

import tests.vllm.engine as harness
from tests.vllm.engine import (
    Engine,
    build_workload,
    cpu_workers,
    lmdb_tier,
    secondary_extra,
    spec_extra,
    write_config,
)
from tieredkv.integrations.vllm.events import KVEvents, tier_event_fields
from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, PARTIAL_MARK, key_group
from tieredkv.store import TieredStore
from tieredkv.testing.servers import RedisServer

pytestmark = pytest.mark.vllm

Residency = dict[tuple[str, str | None], set[tuple[int, Any]]]


# ---- vLLM's publisher, read back -----------------------------------------------------------------


class Publisher:
    """vLLM's ``ZmqEventPublisher`` on in-process endpoints, and its batches read back."""

    def __init__(self) -> None:
        name = f"inproc://tieredkv-kv-events-{uuid.uuid4().hex}"
        self.config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=name, replay_endpoint=f"{name}-replay"
        )
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def batches(self, eng: Engine, timeout: float = 30.0) -> list[KVEventBatch]:
        """Every batch the engine's scheduler published, in order (from the replay socket, once
        the publisher's thread has sent everything queued)."""
        pub = eng.scheduler.kv_event_publisher
        deadline = time.monotonic() + timeout
        while pub._event_queue.unfinished_tasks:  # vLLM's queue: the thread marks each batch sent
            assert time.monotonic() < deadline, "vLLM's publisher did not send its queue"
            time.sleep(0.005)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(self.config.replay_endpoint)
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            out: list[KVEventBatch] = []
            seqs: list[int] = []
            while True:
                assert sock.poll(int(timeout * 1000)), "no answer from vLLM's replay socket"
                _, _topic, seq, payload = sock.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                seqs.append(int.from_bytes(seq, "big"))
                out.append(self._decoder.decode(payload))
        finally:
            sock.close(linger=0)
        assert seqs == list(range(len(seqs))), "batches missing from the replay"
        return out


def replay(batches: list[KVEventBatch], ours: Any) -> tuple[Residency, dict[tuple[str, str | None], int]]:
    """tieredkv's events (``ours(medium, ownership)``) replayed: per (medium, ownership) the
    (group, block hash) held, and how many hashes were announced removed."""
    held: Residency = defaultdict(set)
    removed: dict[tuple[str, str | None], int] = defaultdict(int)
    for batch in batches:
        for ev in batch.events:
            if not isinstance(ev, (BlockStored, BlockRemoved)) or not ours(ev.medium, ev.ownership):
                continue
            where = (ev.medium, ev.ownership)
            keys = {(ev.group_idx, h) for h in ev.block_hashes}
            if isinstance(ev, BlockStored):
                assert ev.block_size == 0 and ev.token_ids == [], "tieredkv's chunks are placeholders"
                held[where] |= keys
            else:
                held[where] -= keys
                removed[where] += len(keys)
    return held, removed


# ---- what the tiers hold ---------------------------------------------------------------------------


async def _scan(tier: Any, fp: bytes) -> list[bytes]:
    return [info.key async for info in tier.scan(fp)]


def holdings(store: TieredStore, fp: bytes, key_len: int, *, primary: bool) -> Residency:
    """Per tier's (medium, ownership) as vLLM publishes it: its records of namespace ``fp`` as
    (group, block hash), a partial record as its chunk's."""
    out: Residency = {}
    for tier in store.tiers:
        f = tier_event_fields(store.tier_medium(tier.name), tier.name, primary=primary)
        where = (f["medium"].value, f["ownership"])
        got: set[tuple[int, Any]] = set()
        for k in store.run(_scan(tier, fp), 60):
            chunk = k[FINGERPRINT_BYTES:]
            if len(chunk) == key_len + 3 and chunk[-GROUP_BYTES - 3 : -GROUP_BYTES - 1] == PARTIAL_MARK:
                chunk = chunk[: -GROUP_BYTES - 3] + chunk[-GROUP_BYTES:]
            elif len(chunk) != key_len:
                continue  # the namespace catalog's record
            got.add((key_group(chunk), maybe_convert_block_hash(BlockHash(chunk[:-GROUP_BYTES]))))
        assert where not in out, f"two tiers publish as {where}"
        out[where] = got
    return out


# ---- one run ---------------------------------------------------------------------------------------


def _idle_step(eng: Engine) -> None:
    """One engine step with nothing scheduled (an engine with connector work in flight keeps
    stepping so): vLLM's scheduler collects and publishes the connector's events."""
    eng.drain_batch_queue()
    so = eng.scheduler.schedule()
    eng.scheduler.update_from_output(so, eng._execute(so))


def run_row(
    extra: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    secondary: bool,
    groups: tuple[str, ...] = ("full",),
    bpc: int = 2,
    before: Any = None,
    **engine_kw: Any,
) -> dict[str, Any]:
    pub = Publisher()
    real = harness.VllmConfig
    monkeypatch.setattr(harness, "VllmConfig", lambda **kw: real(kv_events_config=pub.config, **kw))
    with cpu_workers(extra, secondary):
        eng = Engine(extra, groups=groups, blocks_per_chunk=bpc, **engine_kw)
        try:
            mgr = eng.connector_scheduler.manager
            owner = mgr.secondary_tiers[0] if secondary else mgr
            if before is not None:
                before(owner)
            harness._drive(eng, build_workload(0), 3000, 200, 0.001, 200, secondary)
            res = eng.result
            assert res.error is None and res.stalled is None and res.idle_reached, (res.error, res.stalled)
            assert res.wrong_bytes == 0 and not res.wrong_outputs and not res.unfinished_requests
            fp = owner._fp
            events: KVEvents = owner._events
            assert events is not None and owner.store.pipeline.events is not None
            assert owner.wait_idle(60)
            ours = (
                (lambda m, o: o is not None and o.startswith("tieredkv:")) if secondary else (lambda m, o: m != "GPU")
            )
            deadline = time.monotonic() + 60
            while True:  # what a tier removes by itself may be heard after the last store (Redis)
                _idle_step(eng)
                held, removed = replay(pub.batches(eng), ours)
                tiers = holdings(owner.store, fp, events.key_len, primary=not secondary)
                if {w: held.get(w, set()) for w in tiers} == tiers or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            return {
                "held": held,
                "removed": removed,
                "tiers": tiers,
                "evictions": {
                    (
                        tier_event_fields(owner.store.tier_medium(t.name), t.name, primary=not secondary)[
                            "medium"
                        ].value,
                        tier_event_fields(owner.store.tier_medium(t.name), t.name, primary=not secondary)["ownership"],
                    ): t.counters["evictions"]
                    for t in owner.store.tiers
                },
                "counters": {**events.counters, **{f"owner.{k}": v for k, v in owner.counters.items()}},
                "hits": dict(res.hit_tokens),
            }
        finally:
            eng.shutdown()


def check(out: dict[str, Any], *, evicting_by_server: tuple[tuple[str, str], ...] = ()) -> None:
    held, tiers, removed = out["held"], out["tiers"], out["removed"]
    print({"tiers": {w: len(v) for w, v in tiers.items()}, "removed": dict(removed), **out["counters"]})
    assert set(held) <= set(tiers), f"events for a medium no tier has: {set(held) - set(tiers)}"
    for where, keys in tiers.items():
        assert keys, f"{where}: the tier holds nothing: the row tests nothing"
        extra, missing = held.get(where, set()) - keys, keys - held.get(where, set())
        assert not extra and not missing, (
            f"{where}: {len(extra)} announced but not held, {len(missing)} held unannounced"
        )
        evicted = out["evictions"].get(where, 0) or where in evicting_by_server
        assert evicted, f"{where}: the tier never evicted (make it smaller)"
        assert removed.get(where, 0) > 0, f"{where}: no removal published"
    assert sum(out["hits"].values()) > 0


def _write(path: Path, tiers: list[dict[str, Any]], policy: list[dict[str, Any]] | None = None) -> Path:
    return write_config(path / "tiers.json", tiers, model="kv-events", **({"policy": policy} if policy else {}))


def _fs(tmp_path: Path) -> dict[str, Any]:
    return {
        "kind": "fs",
        "name": "shared",
        "path": str(tmp_path / "fs"),
        "size_cap_bytes": "96KiB",
        "touch_interval_s": 0,
    }


def _cpu_then(lower: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cpu = {"kind": "cpu", "name": "cpu", "capacity_bytes": "64KiB", "segment_bytes": "16KiB"}
    return [cpu, lower], [{"tiers": ["cpu", lower["name"]], "write": "back"}]


# ---- rows ------------------------------------------------------------------------------------------


def test_spec_cpu_written_back_to_lmdb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lmdb = lmdb_tier(tmp_path, "96KiB", map_size="16MiB")
    out = run_row(
        spec_extra(1, _write(tmp_path, *_cpu_then(lmdb))), tmp_path, monkeypatch, secondary=False, settle=True
    )
    assert set(out["tiers"]) == {("CPU", None), ("STORAGE", "tieredkv:nvme")}
    check(out)


def test_spec_hybrid_partial_records_behind_tieredkv_connector_async(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lmdb = lmdb_tier(tmp_path, "64KiB", map_size="16MiB")
    out = run_row(
        spec_extra(1, _write(tmp_path, *_cpu_then(lmdb))),
        tmp_path,
        monkeypatch,
        secondary=False,
        groups=("full", "swa", "mamba"),
        kv_connector="TieredKVConnector",
        kv_connector_module_path="tieredkv.integrations.vllm",
        async_scheduling=True,
    )
    check(out)
    assert {g for keys in out["tiers"].values() for g, _ in keys} == {0, 1, 2}, "every group's chunks were stored"


def test_spec_fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = [_fs(tmp_path)]
    out = run_row(spec_extra(1, _write(tmp_path, fs)), tmp_path, monkeypatch, secondary=False, settle=True)
    assert set(out["tiers"]) == {("STORAGE", "tieredkv:shared")}
    check(out)


def test_secondary_cpu_written_back_to_fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = _fs(tmp_path)
    out = run_row(
        secondary_extra(1, _write(tmp_path, *_cpu_then(fs))), tmp_path, monkeypatch, secondary=True, settle=True
    )
    assert set(out["tiers"]) == {("CPU", "tieredkv:cpu"), ("STORAGE", "tieredkv:shared")}
    check(out)


def _tight_redis(srv: RedisServer, record_bytes: int, fit: int = 60) -> None:
    """maxmemory (allkeys-lru) = what the server uses now + about ``fit`` records of
    ``record_bytes``, measured on this server: about what the workload stores, so with the
    buffers of its reads and writes on top the server evicts, and still holds some at the end."""
    import redis

    c = redis.Redis(host=srv.host, port=srv.port)
    base = int(c.info("memory")["used_memory"])
    c.mset({f"calibrate:{i}": b"x" * record_bytes for i in range(64)})
    per = (int(c.info("memory")["used_memory"]) - base) / 64
    c.delete(*(f"calibrate:{i}" for i in range(64)))
    c.config_set("maxmemory", int(c.info("memory")["used_memory"] + per * fit))
    c.config_set("maxmemory-policy", "allkeys-lru")
    c.close()


@pytest.mark.parametrize("how", ["notify", "scan"])
def test_secondary_redis_maxmemory(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    acl = ["--user", "app", "on", ">pw", "~*", "&*", "+@all", "-config"] if how == "scan" else []
    with RedisServer(extra_args=acl) as srv:
        tier: dict[str, Any] = {"kind": "redis", "name": "redis", "url": srv.url, "key_prefix": f"ev{how}"}
        if how == "scan":
            tier.update(username="app", password="pw", removal_scan_interval_s=0.05, removal_scan_keys=256)
        out = run_row(
            secondary_extra(1, _write(tmp_path, [tier])),
            tmp_path,
            monkeypatch,
            secondary=True,
            settle=True,
            before=lambda owner: _tight_redis(srv, owner.block_size_bytes + 64),  # its connections open
        )
    assert set(out["tiers"]) == {("STORAGE", "tieredkv:redis")}
    check(out, evicting_by_server=(("STORAGE", "tieredkv:redis"),))


def test_no_events_unless_vllm_asks(tmp_path: Path) -> None:
    lmdb = lmdb_tier(tmp_path, "96KiB", map_size="16MiB")
    eng = Engine(spec_extra(1, _write(tmp_path, *_cpu_then(lmdb))), blocks_per_chunk=2, settle=True)
    try:
        harness._drive(eng, build_workload(0)[:1], 3000, 200, 0.001, 200, False)
        mgr = eng.connector_scheduler.manager
        assert mgr._events is None and mgr.store.pipeline.events is None
        assert list(mgr.take_events()) == [] and mgr.store.tiers[0].counters["evictions"] > 0
        assert all(t._removal_listener is None for t in mgr.store.tiers)
    finally:
        eng.shutdown()


# ---- the translation itself, on a real store ----------------------------------------------------


def _small_store() -> TieredStore:
    from tieredkv.store import open_store

    seg = 16 << 10
    return open_store(
        {
            "namespace": {"model": f"kv-events-{uuid.uuid4().hex[:6]}"},
            "tiers": [{"kind": "cpu", "name": "cpu", "capacity_bytes": 4 * seg, "segment_bytes": seg}],
        }
    )


def _put(store: TieredStore, skeys: list[bytes]) -> None:
    """One record per segment of the 4-segment slab (the fifth evicts the oldest)."""
    for k in skeys:
        store.wait([store.put_records([(k, bytearray(15 << 10))])])


def _flat(events: list[Any]) -> list[tuple[str, bool, set[bytes]]]:
    return [(e.medium.value, e.removed, set(e.keys)) for e in events]


def test_a_store_is_announced_once_vllm_completed_it_and_never_if_evicted_before() -> None:
    from tieredkv.keys import group_suffix

    with _small_store() as store:
        fp = store.namespace.fingerprint
        writing: set[bytes] = set()
        ev = KVEvents(store, writing, primary=True)
        ev.key_len = 36
        a, b = (os.urandom(32) + group_suffix(0) for _ in range(2))
        writing.update({fp + a, fp + b})
        _put(store, [fp + a, fp + b])
        assert ev.take(fp) == []  # written, but vLLM has not completed either store
        writing.discard(fp + a)
        assert _flat(ev.take(fp)) == [("CPU", False, {a})]
        _put(store, [fp + os.urandom(32) + group_suffix(0) for _ in range(4)])  # evicts a, then b
        got = _flat(ev.take(fp))
        assert {a, b} <= set().union(*(keys for _, removed, keys in got if removed))
        writing.discard(fp + b)  # vLLM completes b's store now: it was evicted before, never announced
        got += _flat(ev.take(fp))
        assert b not in set().union(*(keys for _, removed, keys in got if not removed))
        assert ev.counters["held_keys"] == 2


def test_a_chunk_is_announced_removed_when_none_of_its_records_is_left() -> None:
    from tieredkv.keys import group_suffix, partial_chunk_key

    with _small_store() as store:
        fp = store.namespace.fingerprint
        ev = KVEvents(store, set(), primary=True, partial_groups={group_suffix(1)}, blocks_per_chunk=2)
        ev.key_len = 36
        k = os.urandom(32) + group_suffix(1)
        fillers = [fp + os.urandom(32) + group_suffix(0) for _ in range(4)]
        _put(store, [fp + partial_chunk_key(k, 1), fp + k])  # a partial record, then the whole one
        assert _flat(ev.take(fp)) == [("CPU", False, {k})]  # (announced as the chunk, twice)
        _put(store, fillers[:3])  # evicts the partial record: the whole one is still held
        assert all(k not in e.keys for e in ev.take(fp))
        _put(store, fillers[3:])  # evicts the whole one
        assert [e for e in ev.take(fp) if k in e.keys and e.removed]


def test_event_fields_per_medium() -> None:
    f = tier_event_fields
    assert f("host", "cpu", primary=True) == {
        "medium": Medium.CPU,
        "locality": None,
        "ownership": None,
        "removal_expected": False,
    }
    assert f("host", "cpu", primary=False)["ownership"] == "tieredkv:cpu"
    assert f("disk", "nvme", primary=True) == {
        "medium": Medium.STORAGE,
        "locality": None,
        "ownership": "tieredkv:nvme",
        "removal_expected": True,
    }
    assert f("remote", "redis", primary=False)["locality"] is Locality.REMOTE
    assert f("unspecified", "x", primary=True)["medium"] is Medium.STORAGE

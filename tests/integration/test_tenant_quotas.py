"""Tenant quotas in the persistent tiers (issue 42): one tenant floods, the others' records survive
within their quota, every usage figure agrees — through ``tieredkv.open_store`` over a real LMDB
directory, a real redis-server and a real 3-master Redis Cluster, and through ``tieredkv status``.

Each test prints its figures (``-s`` shows them)."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
import yaml

import tieredkv
from tests.integration.test_cli_admin import run_json
from tieredkv.errors import TierFullError
from tieredkv.format import HEADER_SIZE
from tieredkv.keys import Namespace, tenant_id
from tieredkv.store import TieredStore
from tieredkv.testing.servers import RedisCluster, RedisServer

KiB, MiB = 1024, 1024 * 1024
NS = Namespace(model="test/tenants")
CHUNK = 64 * KiB
REC = CHUNK + HEADER_SIZE
QUOTA = 1 * MiB  # tenant "b" and every unnamed tenant ("a", the flood)
QUOTAS = {"default_quota": "1MiB", "quotas": {"b": "1MiB", "c": "25%"}}
A, B, C = tenant_id("a"), tenant_id("b"), tenant_id("c")


def key(tenant: str, i: int) -> bytes:
    return NS.key(f"{tenant}/{i}".encode().ljust(24, b"."), 0)


def data(tenant: str, i: int, n: int = CHUNK) -> bytes:
    seed = f"{tenant}:{i}:".encode()
    return (seed * (n // len(seed) + 1))[:n]


@pytest.fixture(params=["lmdb-apart", "lmdb-files", "redis", "redis-cluster"])
def tier_cfg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One persistent tier: LMDB (records stored apart, or in record files), a redis-server with
    maxmemory 64 MiB (so "25%" is 16 MiB), the session's Redis Cluster (no maxmemory: "25%" is
    unbounded there)."""
    kind = request.param
    if kind.startswith("lmdb"):
        yield {
            "kind": "lmdb",
            "name": "disk",
            "path": str(tmp_path / "lmdb"),
            "size_cap_bytes": "8MiB",
            "map_size_bytes": "64MiB",
            "file_batch_bytes": "128KiB" if kind == "lmdb-files" else None,
        }
    elif kind == "redis":
        with RedisServer(maxmemory="64mb", maxmemory_policy="noeviction") as srv:
            yield {"kind": "redis", "name": "shared", "url": srv.url, "key_prefix": "q" + uuid.uuid4().hex[:8]}
    else:
        cl: RedisCluster = request.getfixturevalue("redis_cluster")
        yield {
            "kind": "redis",
            "name": "cluster",
            "url": cl.url,
            "cluster": True,
            "key_prefix": "q" + uuid.uuid4().hex[:8],
        }


def open_tenant_store(tmp_path: Path, tier: dict[str, Any]) -> tuple[TieredStore, Path]:
    doc = {"namespace": {"model": NS.model}, "tiers": [tier], "tenants": QUOTAS}
    path = tmp_path / "tieredkv.yaml"
    path.write_text(yaml.safe_dump(doc))
    return tieredkv.open_store(path, namespace=NS), path


def put(store: TieredStore, tenant: str, first: int, n: int) -> None:
    tier = store.tiers[0]
    items = [(key(tenant, i), data(tenant, i)) for i in range(first, first + n)]
    store.run(tier.put_many(items, tenants=[tenant_id(tenant)] * n))


def loaded(store: TieredStore, tenant: str, ids: range) -> list[bool]:
    """Whether each record loads back byte-exact."""
    got = store.run(store.tiers[0].get_many([key(tenant, i) for i in ids]))
    return [g == data(tenant, i) for g, i in zip(got, ids, strict=True)]


def test_a_flooding_tenant_keeps_to_its_quota_and_the_others_survive(tmp_path: Path, tier_cfg: dict[str, Any]) -> None:
    """Tenant "a" (the default quota, 1 MiB) writes 200 records (13 MiB, past the LMDB tier's
    8 MiB cap) after "b" (1 MiB) and "c" (25%) stored 12 each and the default tenant 8: every
    record of b, c and the default tenant loads byte-exact, a holds at most its quota and keeps
    its newest, and tenant_usage() and `tieredkv status` say so (before: the flood evicted b's
    and c's records from LMDB, and a held 13 MiB of Redis)."""
    store, cfg = open_tenant_store(tmp_path, tier_cfg)
    try:
        tier = store.tiers[0]
        put(store, "b", 0, 12)
        put(store, "c", 0, 12)
        plain = [(key("-", i), data("-", i)) for i in range(8)]
        store.run(tier.put_many(plain))
        flood = 200
        for first in range(0, flood, 4):
            put(store, "a", first, 4)
        usage = store.run(tier.tenant_usage()) or {}
        b_ok, c_ok = loaded(store, "b", range(12)), loaded(store, "c", range(12))
        plain_ok = store.run(tier.get_many([k for k, _ in plain])) == [p for _, p in plain]
        a_kept = loaded(store, "a", range(flood))
        print(
            f"\n[{tier_cfg['name']}] a wrote {flood} x {REC} B: kept {sum(a_kept)} ({usage.get(A)} B, quota {QUOTA});"
            f" b kept {sum(b_ok)}/12, c kept {sum(c_ok)}/12, default tenant {plain_ok}; usage {usage};"
            f" counters {dict(tier.counters)}"
        )
        assert all(b_ok) and all(c_ok) and plain_ok, "the flood took records of other tenants"
        assert usage[B] == 12 * REC and usage[C] == 12 * REC
        assert QUOTA - 4 * REC < usage[A] <= QUOTA  # at its quota, never past it
        assert usage[A] == sum(a_kept) * REC and all(a_kept[-4:])  # its newest batch is there
        assert not any(a_kept[:100])  # its oldest went first
    finally:
        store.close()

    st = run_json("status", "-c", str(cfg))
    (row,) = st["tiers"]
    shown = {t["tenant"]: t for t in row["tenants"]}
    assert shown["b"]["used_bytes"] == 12 * REC and shown["b"]["quota_bytes"] == QUOTA
    assert shown[f"{A:016x}"]["used_bytes"] == usage[A] and shown[f"{A:016x}"]["quota_bytes"] == QUOTA
    if tier_cfg["kind"] == "lmdb":
        assert shown["c"]["quota_bytes"] == 2 * MiB and shown["-"]["used_bytes"] >= 8 * REC
    elif tier_cfg.get("cluster"):  # no maxmemory: a share of an unknown capacity is unbounded, and says so
        assert shown["c"]["quota_bytes"] is None and "unbounded" in row["tenants_note"]
    else:
        assert shown["c"]["quota_bytes"] == 16 * MiB


def test_a_tenant_batch_larger_than_its_quota_is_refused_and_nothing_is_lost(
    tmp_path: Path, tier_cfg: dict[str, Any]
) -> None:
    """A single batch of tenant b larger than its quota raises TierFullError: none of it is
    stored and none of b's records already there is lost (before: LMDB stored it, evicting)."""
    store, _ = open_tenant_store(tmp_path, tier_cfg)
    try:
        tier = store.tiers[0]
        put(store, "b", 0, 10)
        before = store.run(tier.tenant_usage())
        with pytest.raises(TierFullError, match="exceeds its quota"):
            put(store, "b", 100, 17)  # 17 x 65600 B > 1 MiB
        assert all(loaded(store, "b", range(10)))
        assert store.run(tier.contains_many([key("b", i) for i in range(100, 117)])) == [False] * 17
        assert store.run(tier.tenant_usage()) == before
    finally:
        store.close()


def test_a_record_written_again_by_another_tenant_is_not_the_first_ones_to_evict(
    tmp_path: Path, tier_cfg: dict[str, Any]
) -> None:
    """a writes 4 records, then b writes one of those keys again as its own; a's flood then never
    takes that record (it is b's now: Redis's books still list it under a, and the deletion checks
    the header's tenant first), and it counts for b, not a."""
    store, _ = open_tenant_store(tmp_path, tier_cfg)
    try:
        tier = store.tiers[0]
        put(store, "a", 0, 4)
        shared = key("a", 1)
        store.run(tier.put_many([(shared, data("b", 99))], tenants=[B]))
        for first in range(4, 60, 4):
            put(store, "a", first, 4)
        usage = store.run(tier.tenant_usage())
        assert store.run(tier.get_many([shared])) == [data("b", 99)]
        assert usage[B] == REC and usage[A] <= QUOTA
    finally:
        store.close()


# ---- LMDB specifics ------------------------------------------------------------------------------


def lmdb_cfg(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {
        "kind": "lmdb",
        "name": "disk",
        "path": str(tmp_path / "lmdb"),
        "size_cap_bytes": "4MiB",
        "map_size_bytes": "64MiB",
        "file_batch_bytes": None,
        **kw,
    }


def scan_counts(path: Path) -> dict[int, int]:
    """Each tenant's record bytes by reading every record's header (what the counters must say)."""
    from tieredkv.backends.lmdb.tenants import count_tenants

    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=True)
    try:
        rec, acc = env.open_db(b"records", create=False), env.open_db(b"access", create=False)
        with env.begin() as txn:
            return {t: c[0] for t, c in count_tenants(txn, acc, rec).items()}
    finally:
        env.close()


def test_lmdb_over_its_cap_evicts_the_tenants_over_their_quota_first(tmp_path: Path) -> None:
    """With no quotas b writes 4 records and a 32 (2 MiB); then the quotas come (a: 1 MiB) and the
    default tenant writes 40 more, past the 4 MiB cap: only a's records go, though b's are the
    least recently used (before: b's went first)."""
    doc = {"namespace": {"model": NS.model}, "tiers": [lmdb_cfg(tmp_path)]}
    store = tieredkv.open_store(doc, namespace=NS)
    try:
        put(store, "b", 0, 4)
        put(store, "a", 0, 32)  # no quotas yet: 2 MiB
    finally:
        store.close()
    store = tieredkv.open_store({**doc, "tenants": QUOTAS}, namespace=NS)
    try:
        tier = store.tiers[0]
        for first in range(0, 40, 4):
            store.run(tier.put_many([(key("-", i), data("-", i)) for i in range(first, first + 4)]))
        usage = store.run(tier.tenant_usage())
        a_kept = loaded(store, "a", range(32))
        print(f"\n[over cap] usage {usage}, a kept {sum(a_kept)}/32, evictions {tier.counters['evictions']}")
        assert all(loaded(store, "b", range(4))) and all(loaded(store, "-", range(40)))
        assert usage[A] == sum(a_kept) * REC < 32 * REC and usage[B] == 4 * REC
        assert sum(usage.values()) <= 4 * MiB < sum(usage.values()) + REC  # a lost only what the cap needed
    finally:
        store.close()
    assert usage == scan_counts(tmp_path / "lmdb") | {0: usage[0]}


def test_lmdb_counters_left_behind_by_another_writer_are_rebuilt(tmp_path: Path) -> None:
    """An environment whose tenant counters are missing (written before tenants) or stale (a
    writer that does not keep them: here raw LMDB deletes a record of a) is counted again by a
    scan: usage stays exact and the quota holds (before: tenant_usage was not there)."""
    path = tmp_path / "lmdb"
    doc = {"namespace": {"model": NS.model}, "tiers": [lmdb_cfg(tmp_path)], "tenants": QUOTAS}
    store = tieredkv.open_store(doc, namespace=NS)
    try:
        put(store, "a", 0, 8)
        put(store, "b", 0, 4)
    finally:
        store.close()
    env = lmdb.open(str(path), max_dbs=4)
    try:
        rec, acc, tdb = (env.open_db(n, create=False) for n in (b"records", b"access", b"tenants"))
        with env.begin(write=True) as txn:  # what a version before tenants would leave
            txn.drop(tdb, delete=True)
            txn.delete(b"tieredkv:tenants-at")
        with env.begin(write=True) as txn:  # an older writer deletes one of a's records
            (size,) = struct.unpack_from("<Q", txn.get(key("a", 0), db=acc), 8)
            txn.delete(key("a", 0), db=rec)
            txn.delete(key("a", 0), db=acc)
            (used,) = struct.unpack("<Q", txn.get(b"tieredkv:used-bytes"))
            txn.put(b"tieredkv:used-bytes", struct.pack("<Q", used - size))
    finally:
        env.close()
    store = tieredkv.open_store(doc, namespace=NS)
    try:
        tier = store.tiers[0]
        assert store.run(tier.tenant_usage()) == {A: 7 * REC, B: 4 * REC}
        for first in range(8, 40, 4):
            put(store, "a", first, 4)
        usage = store.run(tier.tenant_usage())
        assert QUOTA - 4 * REC < usage[A] <= QUOTA and usage[B] == 4 * REC
    finally:
        store.close()
    assert usage == scan_counts(path)


@pytest.mark.parametrize("kind", ["redis", "lmdb"])
def test_sealed_records_are_bounded_by_their_tenants_quota(
    kind: str, tmp_path: Path, redis_server: RedisServer, sealed_keys_file: str
) -> None:
    """The whole path at once: engine blocks stored with ``store(..., tenant=)`` through the
    pipeline into a tier with ``encryption`` (sealed per tenant, the inner tier accounting each
    sealed record under the tenant in its header): the flooding tenant stays within its quota,
    the other tenant's records all load back byte-exact, and no payload byte is in clear."""
    tier: dict[str, Any] = (
        {"kind": "redis", "name": "shared", "url": redis_server.url, "key_prefix": "qs" + uuid.uuid4().hex[:8]}
        if kind == "redis"
        else {"kind": "lmdb", "name": "disk", "path": str(tmp_path / "lmdb"), "size_cap_bytes": "8MiB"}
    )
    tier["encryption"] = {"keys_file": sealed_keys_file}
    doc = {
        "namespace": {"model": NS.model},
        "tiers": [tier],
        "tenants": {"quotas": {"a": "512KiB", "b": "1MiB"}},
        "pipeline": {"staging_bytes": "8MiB"},
    }
    blocks = torch.zeros(1 + 64 + 16, CHUNK, dtype=torch.uint8)
    for i in range(blocks.shape[0]):
        blocks[i] = i % 251
    with tieredkv.open_store(doc) as store:
        store.register_group(0, [blocks])
        kb = [store.key(f"b/{i}".encode().ljust(24, b"."), 0) for i in range(8)]
        job = store.store(0, [(k, (65 + i,)) for i, k in enumerate(kb)], tenant="b")
        assert job is not None and store.wait([job])[job].ok
        ka = [store.key(f"a/{i}".encode().ljust(24, b"."), 0) for i in range(64)]
        for first in range(0, 64, 4):  # 4 MiB for a quota of 512 KiB
            job = store.store(0, [(ka[i], (1 + i,)) for i in range(first, first + 4)], tenant="a")
            assert job is not None
            store.wait([job])
        usage = store.tenant_usage()[tier["name"]] or {}
        assert 0 < usage[A] <= 512 * KiB, usage
        got = store.run(store.tiers[0].get_many(kb))
        assert got == [blocks[65 + i].numpy().tobytes() for i in range(8)], "the flood took b's records"
        raw = store.run(store.tiers[0].raw_get_many(kb[:1]))[0]
        assert raw is not None and blocks[65].numpy().tobytes()[:4096] not in raw  # sealed

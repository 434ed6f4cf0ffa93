"""The admin CLI's view of tenants and namespaces, driven as a user would (real `tieredkv`
processes): ``status`` per-tenant usage and quotas, the ``ls`` tenant column, ``inspect``'s
tenant and the namespace's weights fingerprint (from the namespace catalog), ``evict --tenant``.
Over a real LMDB directory, a real redis-server and a real Redis Cluster."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tieredkv
from tests.integration.test_cli_admin import run, run_json
from tieredkv.backends.redis.keys import redis_key
from tieredkv.catalog import catalog_key
from tieredkv.format import HEADER_SIZE
from tieredkv.keys import Namespace, tenant_id
from tieredkv.store import TieredStore
from tieredkv.testing.servers import RedisCluster, RedisServer, redis_command

KiB = 1024
WEIGHTS = "3f" * 16  # a weights fingerprint (what tieredkv.weights computes from a checkpoint)
NS = Namespace(model="test/cli-tenants", revision="r7", weights=WEIGHTS)
SIZE = 20 * KiB
REC = SIZE + HEADER_SIZE
ALICE, BOB = tenant_id("alice"), tenant_id("bob")
WAIT_S = 60.0


def wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def key(name: str, i: int) -> bytes:
    return NS.key(f"{name}/{i}".encode().ljust(20, b"."), 0)


def write_cfg(tmp_path: Path, tier: dict[str, Any]) -> Path:
    doc = {
        "namespace": {"model": NS.model, "revision": NS.revision},
        "tiers": [tier],
        "tenants": {"default_quota": "1MiB", "quotas": {"alice": "256KiB"}},
    }
    path = tmp_path / "tieredkv.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def seed(cfg: Path) -> TieredStore:
    """An engine's store: one chunk stored through the pipeline (which writes the namespace's
    catalog record), then 8 records of alice and 6 of bob; returns it closed."""
    store = tieredkv.open_store(cfg, namespace=NS)
    try:
        blocks = torch.arange(4 * SIZE, dtype=torch.int32).to(torch.uint8).reshape(4, SIZE)
        store.register_group(0, [blocks])
        store.wait([store.store(0, [(key("engine", 0), (1,))])])
        tier = store.tiers[0]
        wait_for(lambda: store.run(tier.contains_many([catalog_key(NS.fingerprint)])) == [True], "the catalog")
        for name, n in (("alice", 8), ("bob", 6)):
            items = [(key(name, i), bytes([i]) * SIZE) for i in range(n)]
            store.run(tier.put_many(items, tenants=[tenant_id(name)] * n))
    finally:
        store.close()
    return store


@pytest.fixture(params=["lmdb", "redis", "cluster"])
def cfg(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "lmdb":
        tier: dict[str, Any] = {
            "kind": "lmdb",
            "name": "nvme",
            "path": str(tmp_path / "lmdb"),
            "map_size_bytes": "64MiB",
            "size_cap_bytes": "32MiB",
        }
    elif request.param == "redis":
        srv: RedisServer = request.getfixturevalue("redis_server")
        tier = {"kind": "redis", "name": "shared", "url": srv.url, "key_prefix": "ct" + uuid.uuid4().hex[:8]}
    else:
        cl: RedisCluster = request.getfixturevalue("redis_cluster")
        tier = {
            "kind": "redis",
            "name": "cluster",
            "url": cl.url,
            "cluster": True,
            "key_prefix": "ct" + uuid.uuid4().hex[:8],
        }
    return write_cfg(tmp_path, tier)


def test_status_ls_inspect_and_evict_by_tenant(cfg: Path) -> None:
    """alice (quota 256 KiB) wrote 8 records of 20 KiB, bob (the default 1 MiB) 6, the engine one
    chunk of the default tenant: `status` shows each tenant's usage against its quota and counts
    14 + 1 records (not the catalog's), `ls` names each record's tenant and hides the catalog
    record, `inspect` shows a record's tenant and its namespace's model, revision and weights
    fingerprint, and `evict --tenant` deletes one tenant's records only, `--dry-run` none
    (before: none of these existed)."""
    seed(cfg)
    c = str(cfg)

    (row,) = run_json("status", "-c", c)["tiers"]
    assert row["records"] == 15
    shown = {t["tenant"]: t for t in row["tenants"]}
    assert shown["alice"]["used_bytes"] == 8 * REC and shown["alice"]["quota_bytes"] == 256 * KiB
    assert shown["alice"]["quota"] == str(256 * KiB) and shown["alice"]["id"] == f"{ALICE:016x}"
    assert shown[f"{BOB:016x}"]["used_bytes"] == 6 * REC and shown[f"{BOB:016x}"]["quota_bytes"] == 1024 * KiB
    human = run("status", "-c", c)
    assert human.returncode == 0 and f"{row['tier']}: tenants" in human.stdout and "alice" in human.stdout

    page = run_json("ls", "-c", c, "--limit", "100")
    tenants = {r["key"]: r["tenant"] for r in page["records"]}
    assert page["total"] == 15 and catalog_key(NS.fingerprint).hex() not in tenants
    assert {tenants[key("alice", i).hex()] for i in range(8)} == {"alice"}
    assert {tenants[key("bob", i).hex()] for i in range(6)} == {f"{BOB:016x}"}
    assert tenants[key("engine", 0).hex()] == "-"
    listed = run("ls", "-c", c, "--limit", "100")
    assert listed.stdout.splitlines()[0].split("\t")[-1] == "tenant"

    got = run_json("inspect", key("alice", 3).hex(), "-c", c)
    (entry,) = got["tiers"]
    assert entry["verified"] is True and entry["header"]["version"] == 2
    assert entry["header"]["tenant"] == "alice" and entry["header"]["tenant_id"] == f"{ALICE:016x}"
    info = got["namespace_info"]
    assert (info["model"], info["revision"], info["weights"]) == (NS.model, NS.revision, WEIGHTS)
    human = run("inspect", key("alice", 3).hex(), "-c", c)
    assert f"weights    {WEIGHTS}" in human.stdout and "tenant        alice" in human.stdout

    dry = run_json("evict", "-c", c, "--tenant", "bob", "--dry-run")
    assert dry["tenant"] == f"{BOB:016x}" and dry["tiers"][0]["selected"] == 6 and dry["tiers"][0]["evicted"] == 0
    (size,) = {r["size"] for r in page["records"] if r["tenant"] == "alice"}  # (on Redis: an upper bound)
    kept = run_json("evict", "-c", c, "--tenant", "alice", "--to-size", str(5 * (HEADER_SIZE + size)))
    assert kept["tiers"][0]["evicted"] == 3
    gone = run_json("evict", "-c", c, "--tenant-id", f"{BOB:016x}")
    assert gone["tiers"][0]["evicted"] == 6
    after = {r["key"]: r["tenant"] for r in run_json("ls", "-c", c, "--limit", "100")["records"]}
    assert sorted(after.values()) == ["-"] + ["alice"] * 5
    (row,) = run_json("status", "-c", c)["tiers"]
    usage = {t["tenant"]: t["used_bytes"] for t in row["tenants"]}
    assert usage["alice"] == 5 * REC and usage.get(f"{BOB:016x}", 0) == 0  # the books followed the deletions
    bad = run("evict", "-c", c, "--tenant", "bob", "--tenant-id", f"{BOB:016x}")
    assert bad.returncode == 2 and "not both" in bad.stderr


def test_ls_on_redis_reads_tenants_without_touching_a_record(tmp_path: Path, redis_server: RedisServer) -> None:
    """On Redis, reading a record's header to learn its tenant would reset its idle time (the age
    `evict --older-than` reads); `ls` finds tenants in the quota books instead: a tenant record's
    idle time keeps growing across an `ls` that names its tenant."""
    prefix = "ci" + uuid.uuid4().hex[:8]
    cfg = write_cfg(tmp_path, {"kind": "redis", "name": "shared", "url": redis_server.url, "key_prefix": prefix})
    seed(cfg)
    rk = redis_key(prefix.encode(), key("alice", 0), 16)

    def idle() -> int:
        return int(redis_command(redis_server.port, "OBJECT", "IDLETIME", rk)[1:])

    wait_for(lambda: idle() >= 2, "the record to idle 2 s")
    before = idle()
    rows = {r["key"]: r for r in run_json("ls", "-c", str(cfg), "--limit", "100")["records"]}
    assert rows[key("alice", 0).hex()]["tenant"] == "alice"
    assert idle() >= before, "ls touched the record"

"""Sealed records end to end: a store over a real redis-server, a real 3-master Redis Cluster and a
real LMDB directory with ``encryption``, engine blocks in real torch tensors.

What the issue asks: Redis values hold no plaintext payload bytes; a forged, tampered or other-key
record is a miss (counted, never bytes, deleted only by compare-and-delete); rotation keeps old
records readable; the admin CLI judges sealed records by opening them.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis.cluster import RedisCluster as SyncRedisCluster

import tieredkv
from tieredkv.backends._sealed import SealedTier
from tieredkv.backends.registry import build_tier
from tieredkv.catalog import catalog_key
from tieredkv.config import LMDBTierConfig, RedisTierConfig
from tieredkv.format import FLAG_SEALED, HEADER_SIZE, SEAL_KEY_ID_AT, TENANT_AT, encode_record
from tieredkv.keys import Namespace, tenant_id
from tieredkv.sealing import Keyring, key_id
from tieredkv.testing.servers import RedisCluster, RedisServer

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10
N = 6
#: A run of bytes no record may show in clear (it is in every payload).
MARK = b"SECRET-PROMPT-TOKENS:"

K1, K2, K3 = (os.urandom(32) for _ in range(3))


def key_file(path: Path, *keys: bytes) -> str:
    path.write_text("# tieredkv master keys, newest first\n" + "".join(k.hex() + "\n" for k in keys))
    path.chmod(0o600)
    return str(path)


def payloads(n: int = N, size: int = CHUNK, seed: int = 0) -> torch.Tensor:
    """``n`` distinctive chunks: random bytes with :data:`MARK` every 4 KiB."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)
    mark = torch.frombuffer(bytearray(MARK), dtype=torch.uint8)
    for at in range(0, size - len(MARK), 4096):
        t[:, at : at + len(MARK)] = mark
    return t


def windows(t: torch.Tensor) -> list[bytes]:
    """Byte runs of each chunk (random ones: in no record by chance) that a record holding the
    chunk in clear would contain."""
    out = []
    for row in t:
        b = row.numpy().tobytes()
        out += [b[at : at + 24] for at in (100, 5000, len(b) // 2 + 7, len(b) - 30)]
    return out


# ---- where the records live ------------------------------------------------------------------


class Medium:
    """A sealed tier's medium, seen from outside tieredkv (an attacker with write access)."""

    def __init__(self, kind: str, tier_cfg: dict[str, Any], client: Any = None, path: Path | None = None) -> None:
        self.kind = kind
        self.tier_cfg = tier_cfg
        self.client = client
        self.path = path

    def config(self, keys_file: str, ns: Namespace) -> dict[str, Any]:
        return {
            "namespace": {"model": ns.model, "tenant_salt": ns.tenant_salt},
            "tiers": [{**self.tier_cfg, "encryption": {"keys_file": keys_file}}],
        }

    def values(self) -> list[bytes]:
        """Every value the medium holds for the tier, as stored."""
        if self.client is not None:
            prefix = self.tier_cfg["key_prefix"]
            return [self.client.get(k) for k in self.client.scan_iter(match=f"{prefix}:*", count=1000)]
        assert self.path is not None
        return [p.read_bytes() for p in self.path.rglob("*") if p.is_file()]


@pytest.fixture(params=["node", "node-redis-py", "cluster", "lmdb"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Medium]:
    prefix = "sealed" + uuid.uuid4().hex[:8]
    if request.param == "lmdb":
        path = tmp_path / "lmdb"
        yield Medium(
            "lmdb", {"kind": "lmdb", "path": str(path), "map_size_bytes": "64MiB", "size_cap_bytes": "32MiB"}, path=path
        )
        return
    if request.param == "cluster":
        cl: RedisCluster = request.getfixturevalue("redis_cluster")
        client: Any = SyncRedisCluster.from_url(cl.url)
        cfg = {"kind": "redis", "url": cl.url, "cluster": True, "key_prefix": prefix}
    else:
        srv: RedisServer = request.getfixturevalue("redis_server")
        client = redis.Redis(host="127.0.0.1", port=srv.port)
        cfg = {"kind": "redis", "url": srv.url, "key_prefix": prefix, "native_io": request.param == "node"}
    try:
        yield Medium("redis", cfg, client=client)
    finally:
        for k in list(client.scan_iter(match=f"{prefix}:*", count=1000)):
            client.delete(k)
        client.close()


def ns_new() -> Namespace:
    return Namespace(model="sealed/e2e", tenant_salt=uuid.uuid4().hex)


def store_chunks(store: Any, data: torch.Tensor, keys: list[bytes], blocks: torch.Tensor) -> None:
    """Store ``data`` (rows) under ``keys`` through the store's pipeline (blocks 1..n)."""
    blocks[1 : 1 + len(keys)] = data
    job = store.store(0, [(k, (1 + i,)) for i, k in enumerate(keys)])
    assert job is not None
    res = store.wait([job], timeout=60)[job]
    assert res.ok and len(res.done) == len(keys), res


def load_chunks(store: Any, keys: list[bytes], blocks: torch.Tensor) -> tuple[list[bytes], torch.Tensor]:
    """Load ``keys`` (one job: it fails as a whole if one is missing) into fresh (zeroed) blocks;
    the keys loaded, and the blocks' bytes."""
    at = 1 + N
    blocks[at : at + len(keys)] = 0
    job = store.load(0, [(k, (at + i,)) for i, k in enumerate(keys)])
    assert job is not None
    res = store.wait([job], timeout=60)[job]
    assert res.ok == (len(res.failed) == 0)
    return list(res.done), blocks[at : at + len(keys)].clone()


def open_store(medium: Medium, keys_file: str, ns: Namespace) -> tuple[Any, torch.Tensor]:
    store = tieredkv.open_store(medium.config(keys_file, ns), namespace=ns)
    blocks = torch.zeros(1 + 2 * N, CHUNK, dtype=torch.uint8)
    store.register_group(0, [blocks])
    return store, blocks


def sealed_tier(store: Any) -> SealedTier:
    (tier,) = store.tiers
    assert isinstance(tier, SealedTier)
    return tier


# ---- the acceptance ----------------------------------------------------------------------------


def test_values_hold_no_plaintext_and_round_trip_byte_exact(medium: Medium, tmp_path: Path) -> None:
    ns = ns_new()
    data = payloads()
    keys = [ns.key(bytes([i]) * 32, 0) for i in range(N)]
    store, blocks = open_store(medium, key_file(tmp_path / "keys", K1), ns)
    with store:
        store_chunks(store, data, keys, blocks)
        found, got = load_chunks(store, keys, blocks)
        assert found == keys and torch.equal(got, data)
        # the store writes its namespace's catalog record in the background: sealed like the rest
        ckey = catalog_key(ns.fingerprint)
        deadline = time.monotonic() + 60
        while store.run(sealed_tier(store).contains_many([ckey])) != [True]:
            assert time.monotonic() < deadline, "the namespace catalog record was never written"
            time.sleep(0.01)
        raws = store.run(sealed_tier(store).raw_get_many([*keys, ckey]))
    values = medium.values()
    assert values, "the medium holds the records"
    for v in values:
        assert MARK not in v
        assert b"tieredkv_catalog" not in v  # the catalog's JSON is sealed too
        for w in windows(data):
            assert w not in v
    for raw in raws:  # each record stored sealed, under K1
        assert raw is not None and raw[28] & FLAG_SEALED
        assert struct.unpack_from("<I", raw, SEAL_KEY_ID_AT)[0] == key_id(K1)
    if medium.kind == "redis":
        assert len(values) == N + 1 and sorted(map(len, values)) == sorted(map(len, raws))


def forge(case: str, ring: Keyring, key: bytes, good: bytes, other_key: bytes, chunk: bytes) -> bytes:
    """What an attacker with write access to the keyspace (and the format) puts under ``key``."""
    b = bytearray(good)
    if case == "forged-plain":  # a valid record as an unencrypted tier writes it
        return bytes(encode_record(key, chunk))
    if case == "forged-plain-v2":
        return bytes(encode_record(key, chunk, tenant=tenant_id("mallory")))
    if case == "ciphertext-bit":
        b[HEADER_SIZE + 1000] ^= 0x10
    elif case == "tag-bit":
        b[-1] ^= 0x80
    elif case == "header-bit":
        b[42] ^= 0x01  # the nonce
    elif case == "other-tenant":
        b[TENANT_AT : TENANT_AT + 8] = tenant_id("another tenant").to_bytes(8, "little")
    elif case == "other-namespace":
        return bytes(ring.seal(other_key, chunk))  # a good record of another namespace's key
    elif case == "other-key":
        return bytes(Keyring([K3]).seal(key, chunk))  # sealed by someone with another key
    elif case == "truncated":
        return bytes(b[: len(b) // 2])
    else:
        raise AssertionError(case)
    return bytes(b)


CASES = [
    "forged-plain",
    "forged-plain-v2",
    "ciphertext-bit",
    "tag-bit",
    "header-bit",
    "other-tenant",
    "other-namespace",
    "other-key",
    "truncated",
]


@pytest.mark.parametrize("case", CASES)
def test_a_forged_tampered_or_other_key_record_is_a_counted_miss_never_bytes(
    medium: Medium, tmp_path: Path, case: str
) -> None:
    ns, other = ns_new(), ns_new()
    data = payloads()
    keys = [ns.key(bytes([i]) * 32, 0) for i in range(N)]
    store, blocks = open_store(medium, key_file(tmp_path / "keys", K1), ns)
    with store:
        tier = sealed_tier(store)
        store_chunks(store, data, keys, blocks)
        victim = keys[2]
        (good,) = store.run(tier.raw_get_many([victim]))
        assert good is not None
        bad = forge(case, tier.keyring, victim, good, other.key(bytes([2]) * 32, 0), data[2].numpy().tobytes())
        store.run(tier.raw_put_many([(victim, bad)]))  # the attacker's write
        before = tier.counters["corrupt"]
        found, got = load_chunks(store, [victim], blocks)
        assert found == [] and not got.any(), "none of the record's bytes reached the engine's blocks"
        assert tier.counters["corrupt"] == before + 1
        rest = [k for k in keys if k != victim]
        found, got = load_chunks(store, rest, blocks)
        assert found == rest and torch.equal(got, data[[0, 1, 3, 4, 5]])
        assert store.run(tier.contains_many([victim])) == [False], "deleted"
        assert store.run(tier.get_many([victim])) == [None]


def test_a_bad_record_rewritten_before_its_deletion_is_kept(medium: Medium, tmp_path: Path) -> None:
    """Deletion is compare-and-delete: a good record sealed under the key after the bad one was read
    (another engine, here injected just before the deletion runs) stays."""
    ns = ns_new()
    data = payloads()
    keys = [ns.key(bytes([i]) * 32, 0) for i in range(N)]
    store, blocks = open_store(medium, key_file(tmp_path / "keys", K1), ns)
    with store:
        tier = sealed_tier(store)
        store_chunks(store, data, keys, blocks)
        victim = keys[4]
        store.run(tier.raw_put_many([(victim, encode_record(victim, data[4]))]))
        fresh = tier.keyring.seal(victim, data[4])
        inner: Any = tier.inner
        name = "_del_if_same" if medium.kind == "redis" else "_delete_if_same"
        real = getattr(inner, name)

        async def rewrite_first(*args: Any) -> Any:  # a writer slips in between the read and the deletion
            await inner._raw_put_many([(victim, memoryview(fresh))])
            return await real(*args)

        setattr(inner, name, rewrite_first)
        found, got = load_chunks(store, [victim], blocks)
        assert found == [] and not got.any() and tier.counters["corrupt"] == 1
        setattr(inner, name, real)
        assert store.run(tier.raw_get_many([victim])) == [bytes(fresh)]
        found, got = load_chunks(store, keys, blocks)
        assert found == keys and torch.equal(got, data)


def test_rotation_keeps_old_records_readable_and_seals_with_the_newest(medium: Medium, tmp_path: Path) -> None:
    ns = ns_new()
    old, new = payloads(seed=1), payloads(seed=2)
    old_keys = [ns.key(b"old" + bytes([i]) * 29, 0) for i in range(N)]
    new_keys = [ns.key(b"new" + bytes([i]) * 29, 0) for i in range(N)]

    store, blocks = open_store(medium, key_file(tmp_path / "k1", K1), ns)
    with store:
        store_chunks(store, old, old_keys, blocks)

    store, blocks = open_store(medium, key_file(tmp_path / "k21", K2, K1), ns)  # K2 added, newest
    with store:
        found, got = load_chunks(store, old_keys, blocks)
        assert found == old_keys and torch.equal(got, old)
        store_chunks(store, new, new_keys, blocks)
        tier = sealed_tier(store)
        for raw in store.run(tier.raw_get_many(new_keys)):
            assert raw is not None and struct.unpack_from("<I", raw, SEAL_KEY_ID_AT)[0] == key_id(K2)
        assert tier.counters["corrupt"] == 0

    store, blocks = open_store(medium, key_file(tmp_path / "k2", K2), ns)  # K1 dropped
    with store:
        tier = sealed_tier(store)
        found, got = load_chunks(store, new_keys, blocks)
        assert found == new_keys and torch.equal(got, new)
        found, got = load_chunks(store, old_keys, blocks)
        assert found == [] and not got.any()
        assert tier.counters["corrupt"] == N


def test_records_of_a_tenant_open_and_another_tenant_header_does_not(medium: Medium, tmp_path: Path) -> None:
    """A record sealed for a tenant (its key derived for that tenant) opens for any reader with the
    keys; its header's tenant is covered by the tag. The tier seals with each record's tenant when
    the inner tier keeps tenants (the hook it then receives)."""
    ns = ns_new()
    data = payloads(2)
    keys = [ns.key(b"tenant" + bytes([i]) * 26, 0) for i in range(2)]
    store, _ = open_store(medium, key_file(tmp_path / "keys", K1), ns)
    with store:
        tier = sealed_tier(store)
        t = tenant_id("acme")
        store.run(tier._put_many([(keys[0], memoryview(data[0].numpy()))], [t]))
        (raw,) = store.run(tier.raw_get_many([keys[0]]))
        assert raw is not None and int.from_bytes(raw[TENANT_AT : TENANT_AT + 8], "little") == t
        out = torch.zeros(CHUNK, dtype=torch.uint8)
        assert store.run(tier.get_many([keys[0]], [out])) == [CHUNK] and torch.equal(out, data[0])
        moved = bytearray(raw)
        moved[TENANT_AT : TENANT_AT + 8] = (0).to_bytes(8, "little")  # claims the default tenant
        store.run(tier.raw_put_many([(keys[0], moved)]))
        out.zero_()
        assert store.run(tier.get_many([keys[0]], [out])) == [None] and not out.any()
        assert tier.counters["corrupt"] == 1


def test_a_huge_foreign_value_is_read_no_further_than_the_record_fits(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Reads stay bounded on a sealed Redis tier, as on a plain one: 32 MiB under a key read into
    64 KiB costs at most the sealed record's size on the wire; the value is deleted (it still
    starts with what was read)."""
    ns = ns_new()
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    for native in (True, False):
        cfg = RedisTierConfig(
            url=redis_server.url,
            key_prefix="huge" + uuid.uuid4().hex[:8],
            native_io=native,
            encryption={"keys_file": key_file(tmp_path / "keys", K1)},
        )
        tier = build_tier(cfg)
        assert isinstance(tier, SealedTier)
        key = ns.key(b"\x01" * 32, 0)

        async def go(tier: SealedTier = tier, key: bytes = key) -> list[Any]:
            async with tier:
                client.set(tier.inner.redis_key(key), b"\x00" * (32 << 20))  # type: ignore[attr-defined]
                before = int(client.info("stats")["total_net_output_bytes"])
                got = await tier.get_many([key], [bytearray(CHUNK)])
                sent = int(client.info("stats")["total_net_output_bytes"]) - before
                assert sent < 4 * CHUNK, sent
                return [got, tier.counters["corrupt"], await tier.contains_many([key])]

        assert asyncio.run(go()) == [[None], 1, [False]]
    client.close()


# ---- keys and configuration --------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "bad-length", "group-readable", "empty-env"])
def test_a_store_with_bad_keys_does_not_start_and_says_what_to_fix(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = K1.hex()
    enc: dict[str, str]
    if case == "missing":
        enc = {"keys_file": str(tmp_path / "no-such-file")}
        want = "check the path"
    elif case == "bad-length":
        enc = {"keys_file": key_file(tmp_path / "k", K1[:20])}
        want = "not a 256-bit key"
    elif case == "group-readable":
        enc = {"keys_file": key_file(tmp_path / "k", K1)}
        Path(enc["keys_file"]).chmod(0o640)
        want = "chmod 600"
    else:
        enc = {"keys_env": "TKV_SEALED_TEST_KEYS"}
        want = "environment variable TKV_SEALED_TEST_KEYS is empty"
    cfg = {
        "namespace": {"model": "sealed/bad-keys"},
        "tiers": [{"kind": "lmdb", "name": "disk", "path": str(tmp_path / "lmdb"), "encryption": enc}],
    }
    monkeypatch.setenv("TKV_SEALED_TEST_KEYS", "")
    with pytest.raises(tieredkv.ConfigError) as ei:
        tieredkv.open_store(cfg)
    msg = str(ei.value)
    assert "tier 'disk': encryption.keys_" in msg and want in msg and secret[:16] not in msg, msg
    assert not (tmp_path / "lmdb").exists(), "nothing created"


def test_stats_name_the_key_ids_never_the_keys(tmp_path: Path) -> None:
    tier = build_tier(
        LMDBTierConfig(path=str(tmp_path / "l"), encryption={"keys_file": key_file(tmp_path / "k", K2, K1)})
    )

    async def go() -> Any:
        async with tier:
            return await tier.stats()

    st = asyncio.run(go())
    assert st.kind == "lmdb" and st.extra["encryption"]["key_ids"] == [f"{key_id(K2):08x}", f"{key_id(K1):08x}"]
    assert K1.hex() not in repr(st) and K2.hex() not in repr(st) and K1.hex() not in repr(tier)


# ---- the admin CLI -----------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")}
    return subprocess.run(
        [sys.executable, "-m", "tieredkv.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=False,
    )


def test_verify_and_inspect_open_sealed_records(tmp_path: Path, redis_server: RedisServer) -> None:
    """``verify`` and ``inspect`` judge a sealed tier's records as its reads do: good ones verify
    (before: every sealed record was reported corrupt), a tampered one does not; ``--repair``
    deletes only it."""
    ns = ns_new()
    prefix = "cli" + uuid.uuid4().hex[:8]
    keys_file = key_file(tmp_path / "keys", K1)
    cfg = tmp_path / "tieredkv.yaml"
    cfg.write_text(
        f"namespace: {{model: {ns.model}}}\ntiers:\n  - kind: redis\n    name: remote\n    url: {redis_server.url}\n"
        f"    key_prefix: {prefix}\n    encryption: {{keys_file: {keys_file}}}\n"
    )
    data = payloads(4)
    keys = [ns.key(bytes([i]) * 32, i % 2) for i in range(4)]
    tier = build_tier(RedisTierConfig(url=redis_server.url, key_prefix=prefix, encryption={"keys_file": keys_file}))

    async def seed() -> None:
        async with tier:
            await tier.put_many([(k, data[i]) for i, k in enumerate(keys)])
            (raw,) = await tier.raw_get_many([keys[1]])
            assert raw is not None
            bad = bytearray(raw)
            bad[HEADER_SIZE + 7] ^= 1
            await tier.raw_put_many([(keys[1], bad)])

    asyncio.run(seed())
    r = cli("verify", "-c", str(cfg), "--json")
    v = json.loads(r.stdout)
    assert r.returncode == 1, r.stderr
    assert (v["tiers"][0]["checked"], v["tiers"][0]["ok"], v["tiers"][0]["corrupt"]) == (4, 3, 1)
    assert [c["key"] for c in v["corrupt"]] == [keys[1].hex()] and "authenticate" in v["corrupt"][0]["error"]

    good = json.loads(cli("inspect", keys[0].hex(), "-c", str(cfg), "--json").stdout)
    assert good["tiers"][0]["verified"] is True and good["tiers"][0]["header"]["flags"] == FLAG_SEALED
    bad = cli("inspect", keys[1].hex(), "-c", str(cfg), "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["tiers"][0]["verified"] is False

    fixed = json.loads(cli("verify", "-c", str(cfg), "--repair", "--json").stdout)
    assert fixed["tiers"][0]["repaired"] == 1
    again = cli("verify", "-c", str(cfg), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["tiers"][0]["ok"] == 3

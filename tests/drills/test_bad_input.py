"""Bad-input drills: malformed configs, unreachable or stalled Redis, unwritable LMDB paths, and
garbage written under our Redis key prefix by a foreign client.

Every malformed config gives a :class:`~tieredkv.errors.ConfigError` with exactly one line per
problem naming the field path, the value given and what is allowed (and ``tieredkv config check``
exits 2 with those lines, no traceback). Unreachable tiers fail fast at open. Foreign records are
misses, never served, and never break the rest of a batch.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml

from tests.drills._util import NS, block_hash, check_payload, payload, report, small_fs
from tieredkv import open_store
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import load_config
from tieredkv.errors import ConfigError, TierUnavailableError
from tieredkv.format import HEADER, HEADER_SIZE, MAGIC, encode_record
from tieredkv.keys import Namespace
from tieredkv.pipeline import KeyState
from tieredkv.store import TieredStore
from tieredkv.testing.servers import RedisServer, free_port

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]

# (id, config, field path, value as shown, a word of the allowed values / fix)
BAD_CONFIGS: list[tuple[str, dict[str, Any], str, str | None, str]] = [
    (
        "size-not-a-size",
        {"tiers": [{"kind": "cpu", "capacity_bytes": "lots"}]},
        "tiers.0.capacity_bytes",
        "'lots'",
        "8GiB",
    ),
    ("size-bad-unit", {"tiers": [{"kind": "lmdb", "map_size_bytes": "1XB"}]}, "tiers.0.map_size_bytes", "'1XB'", "XB"),
    ("size-zero", {"tiers": [{"kind": "cpu", "capacity_bytes": 0}]}, "tiers.0.capacity_bytes", "0", "greater than 0"),
    ("timeout-zero", {"tiers": [{"kind": "cpu", "op_timeout_s": 0}]}, "tiers.0.op_timeout_s", "0", "greater than 0"),
    (
        "timeout-word",
        {"tiers": [{"kind": "redis", "socket_timeout_s": "fast"}]},
        "tiers.0.socket_timeout_s",
        "'fast'",
        "number",
    ),
    ("ttl-negative", {"tiers": [{"kind": "redis", "ttl_s": -3}]}, "tiers.0.ttl_s", "-3", "greater than 0"),
    ("readers-zero", {"tiers": [{"kind": "lmdb", "max_readers": 0}]}, "tiers.0.max_readers", "0", "greater than 0"),
    ("int-word", {"pipeline": {"breaker_failures": "three"}}, "pipeline.breaker_failures", "'three'", "integer"),
    ("port-range", {"metrics": {"port": 70000}}, "metrics.port", "70000", "65535"),
    ("unknown-kind", {"tiers": [{"kind": "tape"}]}, "tiers.0", "'tape'", "allowed kinds: 'cpu', 'fs', 'lmdb', 'redis'"),
    ("missing-kind", {"tiers": [{"capacity_bytes": 5}]}, "tiers.0", None, "allowed kinds"),
    (
        "enum",
        {"tiers": [{"kind": "lmdb", "sync_mode": "sometimes"}]},
        "tiers.0.sync_mode",
        "'sometimes'",
        "'durable' or 'fast'",
    ),
    ("unknown-field", {"tierz": []}, "tierz", "[]", "did you mean 'tiers'"),
    (
        "unknown-tier-field",
        {"tiers": [{"kind": "cpu", "capacity": "1GiB"}]},
        "tiers.0.capacity",
        "'1GiB'",
        "did you mean 'capacity_bytes'",
    ),
    ("no-tiers", {"tiers": []}, "tiers", "[]", "at least 1"),
    ("tiers-not-list", {"tiers": {"kind": "cpu"}}, "tiers", None, "valid list"),
    ("tier-not-mapping", {"tiers": ["cpu"]}, "tiers.0", "'cpu'", "dictionary"),
    ("version", {"version": 2}, "version", "2", "should be 1"),
    (
        "url-scheme",
        {"tiers": [{"kind": "redis", "url": "http://127.0.0.1:6379"}]},
        "tiers.0.url",
        "'http://127.0.0.1:6379'",
        "redis://",
    ),
    (
        "hash-tag-prefix",
        {"tiers": [{"kind": "redis", "key_prefix": "a{b}"}]},
        "tiers.0.key_prefix",
        "'a{b}'",
        "hash tag",
    ),
    ("buckets", {"tiers": [{"kind": "redis", "hash_tag_buckets": 5000}]}, "tiers.0.hash_tag_buckets", "5000", "4096"),
    (
        "cap-over-map",
        {"tiers": [{"kind": "lmdb", "size_cap_bytes": "8GiB"}]},
        "tiers.0",
        None,
        "raise map_size_bytes or lower size_cap_bytes",
    ),
    (
        "segment-over-capacity",
        {"tiers": [{"kind": "cpu", "capacity_bytes": "1MiB", "segment_bytes": "8MiB"}]},
        "tiers.0",
        None,
        "must not exceed capacity_bytes",
    ),
    ("policy-unknown-tier", {"policy": [{"tiers": ["nvme0"]}]}, "policy.0.tiers.0", "'nvme0'", "configured:"),
    (
        "write-back-one-tier",
        {"tiers": [{"kind": "cpu"}], "policy": [{"write": "back"}]},
        "policy.0.write",
        None,
        "at least two tiers",
    ),
    ("duplicate-names", {"tiers": [{"kind": "cpu"}, {"kind": "cpu"}]}, "tiers.1", "'cpu'", "distinct 'name'"),
    ("empty-model", {"namespace": {"model": ""}}, "namespace.model", "''", "at least 1 character"),
]


def _problem_lines(e: ConfigError) -> list[str]:
    head, *lines = str(e).splitlines()
    assert head.startswith("invalid config") and head.endswith(f"{len(lines)} problem(s)"), head
    return [line.strip() for line in lines]


@pytest.mark.parametrize("raw,path,value,fix", [pytest.param(*c[1:], id=c[0]) for c in BAD_CONFIGS])
def test_malformed_config_is_one_line_naming_field_value_and_fix(
    raw: dict[str, Any], path: str, value: str | None, fix: str
) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(raw, env={})
    (line,) = _problem_lines(ei.value)
    assert line.startswith(f"{path}:"), line
    if value is not None:
        assert value in line, line
    assert fix in line, line
    assert "Traceback" not in line and "pydantic" not in line and "errors.pydantic.dev" not in line


@pytest.mark.parametrize("field", ["capacity_bytes", "segment_bytes"])
def test_negative_size_says_it_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"kind": "cpu", field: -1}]}, env={})
    (line,) = _problem_lines(ei.value)
    assert f"tiers.0.{field}: got -1" in line and ("greater than 0" in line or "negative" in line), line


def test_config_check_cli_exits_2_with_one_line_per_bad_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "tiers": [
                    {"kind": "cpu", "capacity_bytes": "lots"},
                    {"kind": "tape"},
                    {"kind": "lmdb", "sync_mode": "sometimes"},
                ],
                "pipeline": {"breaker_failures": "three"},
            }
        )
    )
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("tiers: [kind: cpu\n  - : :\n")
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- kind: cpu\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIEREDKV_")} | {"COLUMNS": "300"}
    cases = {
        bad: [
            "tiers.0.capacity_bytes: got 'lots'",
            "tiers.1: ",
            "tiers.2.sync_mode: got 'sometimes'",
            "pipeline.breaker_failures: got 'three'",
            "4 problem(s)",
        ],
        not_yaml: ["not valid YAML"],
        a_list: ["top level must be a mapping"],
        tmp_path / "missing.yaml": ["cannot read it", "check the path"],
    }
    for path, wants in cases.items():
        r = subprocess.run(
            [sys.executable, "-m", "tieredkv.cli", "config", "check", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=ROOT,
            check=False,
        )
        assert r.returncode == 2, (path, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        err = r.stderr
        for w in wants:
            assert w in err, (w, err)
        if path == bad:  # one line per problem
            assert sum(1 for line in err.splitlines() if line.strip().startswith(("tiers.", "pipeline."))) == 4, err


# ---- unreachable / stalled Redis, unwritable LMDB --------------------------------------------


def _no_threads_left() -> None:
    deadline = time.monotonic() + 5
    while any(t.name.startswith(("tieredkv-pipeline", "tieredkv-lmdb")) for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.02)


def _redis_config(url: str, **kw: Any) -> dict[str, Any]:
    return {"tiers": [{"kind": "redis", "url": url, "socket_timeout_s": 0.5, "connect_timeout_s": 0.3, **kw}]}


def _start_degraded(raw: dict[str, Any], caplog: pytest.LogCaptureFixture, names: str) -> tuple[float, str]:
    """Open a store whose only tier cannot be reached: it must come up at once with that tier's
    breaker open and a warning naming the problem (``names``), serve misses, and close fast.
    (Before fedd218 open_store raised TierUnavailableError instead; both are accepted.)"""
    t0 = time.perf_counter()
    try:
        store = open_store(load_config(raw, env={}))
    except TierUnavailableError as e:
        took = time.perf_counter() - t0
        assert names in str(e), str(e)
        _no_threads_left()
        return took, str(e)
    took = time.perf_counter() - t0
    try:
        name = store.tiers[0].name
        warning = " ".join(m for r in caplog.records if r.levelname == "WARNING" and name in (m := r.getMessage()))
        assert names in warning, f"no warning names the problem: {warning!r}"
        assert store.stats().breakers[name] == "open"
        key = NS.key(block_hash(1), 0)
        t1 = time.perf_counter()
        assert store.lookup([key]) == [(KeyState.MISS, None)]
        job = store.get_records([(key, bytearray(64))])
        assert job is not None
        got = store.wait([job], timeout=10)[job]  # a get on a dead tier finishes (failed)
        assert not got.ok and got.failed == (key,)
        assert time.perf_counter() - t1 < 3.0
    finally:
        t2 = time.perf_counter()
        store.close()
        assert time.perf_counter() - t2 < 5.0
    _no_threads_left()
    return took, warning


def test_unreachable_redis_fails_fast(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    async def direct() -> None:
        tier = RedisTier(load_config(_redis_config(url), env={}).tiers[0])
        t0 = time.perf_counter()
        with pytest.raises(TierUnavailableError, match="cannot reach the server"):
            await tier.get_many([NS.key(block_hash(1), 0)])
        assert time.perf_counter() - t0 < 3.0
        await tier.close()

    asyncio.run(direct())
    took, msg = _start_degraded(_redis_config(url), caplog, f"127.0.0.1:{port}")
    assert took < 3.0 and "cannot reach" in msg
    report("bad-input-unreachable-redis", store_up_s=round(took, 2))


def test_redis_that_accepts_but_never_answers_fails_within_its_timeouts(caplog: pytest.LogCaptureFixture) -> None:
    """A listener that completes the TCP handshake and then says nothing (a hung proxy)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)  # never accept(): the kernel completes handshakes into the backlog
    port = lsock.getsockname()[1]
    try:
        took, msg = _start_degraded(_redis_config(f"redis://127.0.0.1:{port}/0"), caplog, f"127.0.0.1:{port}")
    finally:
        lsock.close()
    # socket_timeout 0.5 s with one retry: about 1 s, far below the 5 s op deadline.
    assert took < 3.0, took
    assert "timeout" in msg.lower(), msg
    report("bad-input-silent-redis", store_up_s=round(took, 2))


def _lmdb_config(path: Path) -> dict[str, Any]:
    return {"tiers": [{"kind": "lmdb", "path": str(path), "map_size_bytes": "16MiB", "size_cap_bytes": "8MiB"}]}


def _unwritable(path: Path, why: str) -> None:
    """A path that can never hold the environment is a setup error: ConfigError naming the field and
    the path, at tier open and at store start (which then closes what it opened), never an outage."""

    async def direct() -> str:
        tier = LMDBTier(load_config(_lmdb_config(path), env={}).tiers[0])
        t0 = time.perf_counter()
        with pytest.raises(ConfigError) as ei:
            await tier.open()
        assert time.perf_counter() - t0 < 5
        await tier.close()
        return str(ei.value)

    msg = asyncio.run(direct())
    assert str(path) in msg and why in msg and ".path:" in msg and "writable directory" in msg, msg
    _no_threads_left()
    store = TieredStore(load_config(_lmdb_config(path), env={}))
    with pytest.raises(ConfigError, match="writable directory"):
        store.start()
    _no_threads_left()


def test_lmdb_path_under_a_regular_file_is_a_clear_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file")
    _unwritable(blocker / "lmdb", "Not a directory")


def test_lmdb_path_on_a_read_only_filesystem_is_a_clear_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with small_fs(tmp_path, "1m", "ro") as (mnt, why):
        if mnt is None:
            pytest.skip(f"needs a read-only mount: {why}")
        _unwritable(mnt / "lmdb", "Read-only file system")


def test_failed_start_closes_the_tiers_it_already_opened(tmp_path: Path) -> None:
    """A tier that fails to open with a non-transient error (a CPU tier that must pin memory on a
    machine without CUDA) fails the start, and the tiers opened before it are closed again."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("pin_memory='always' is valid with CUDA")
    cfg = load_config(
        {
            "tiers": [
                _lmdb_config(tmp_path / "lmdb")["tiers"][0],
                {"kind": "cpu", "capacity_bytes": "4MiB", "segment_bytes": "1MiB", "pin_memory": "always"},
            ]
        },
        env={},
    )
    store = TieredStore(cfg)
    with pytest.raises(ConfigError, match="pin_memory"):
        store.start()
    assert store.tiers[0].closed, "the LMDB tier opened before the CPU tier failed was left open"
    _no_threads_left()


# ---- garbage under our key prefix ----------------------------------------------------------------


def _garbage(key: bytes, other: bytes) -> list[tuple[str, bytes]]:
    rec = bytes(encode_record(key, b"genuine-looking payload" * 10))
    huge_len = bytearray(rec)
    HEADER.pack_into(huge_len, 0, MAGIC, 1, HEADER_SIZE, key[:16], 0, 0, 1 << 60, 0)
    return [
        ("empty", b""),
        ("one-byte", b"x"),
        ("text", b"hello from another application"),
        ("json", b'{"foo": [1, 2, 3]}'),
        ("magic-only", MAGIC),
        ("header-only", rec[:HEADER_SIZE]),
        ("huge-length-field", bytes(huge_len)),
        ("future-version", rec[:4] + (2).to_bytes(2, "little") + rec[6:]),
        ("record-of-another-key", bytes(encode_record(other, b"some other chunk" * 10))),
        ("other-namespace", bytes(encode_record(Namespace(model="someone-else").key(key[16:-4], 0), b"theirs"))),
        ("pickle", b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00\x8c\x07os.path\x94."),
        ("random-1MiB", os.urandom(1 << 20)),
    ]


async def test_foreign_garbage_under_our_prefix_is_a_miss(redis_server: RedisServer) -> None:
    prefix = f"drill{uuid.uuid4().hex[:8]}"
    tier = RedisTier(load_config(_redis_config(redis_server.url, key_prefix=prefix), env={}).tiers[0])
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        async with tier:
            good = [NS.key(block_hash(i), 0) for i in range(20)]
            await tier.put_many([(k, payload(i, 1, 3000)) for i, k in enumerate(good)])
            victims = [NS.key(block_hash(1000 + i), 0) for i in range(12)]
            cases = _garbage(victims[0], good[0])
            for (name, value), k in zip(cases, victims):
                await raw.set(tier.redis_key(k), value)
            # Foreign keys under our prefix that are not our layout at all.
            await raw.set(f"{prefix}:junk".encode(), b"x")
            await raw.set(f"{prefix}:{{zz}}:zz".encode(), b"x")
            await raw.set(f"{prefix}:{{{NS.fingerprint.hex()}.0}}:nothex".encode(), b"x")
            mixed = [k for pair in zip(good, victims) for k in pair] + good[len(victims) :]
            got = await tier.get_many(mixed)
            for k, g in zip(mixed, got):
                if k in victims:
                    assert g is None, f"foreign value {cases[victims.index(k)][0]} was served"
                else:
                    assert g is not None and check_payload(good.index(k), g) == 1
            assert tier.counters["corrupt"] == len(victims)
            listed = {info.key async for info in tier.scan(NS)}
            assert listed == set(good), "scan must list only our records"
    finally:
        await raw.delete(*[k async for k in raw.scan_iter(match=f"{prefix}:*")])
        await raw.aclose()
    report(
        "bad-input-foreign-garbage",
        garbage_values=len(cases),
        misses=len(victims),
        foreign_keys_ignored=3,
        neighbours_served=len(good),
    )


@pytest.mark.parametrize("kind", ["list", "hash"])
async def test_foreign_non_string_value_is_a_miss_not_a_failed_batch(redis_server: RedisServer, kind: str) -> None:
    prefix = f"drill{uuid.uuid4().hex[:8]}"
    tier = RedisTier(load_config(_redis_config(redis_server.url, key_prefix=prefix), env={}).tiers[0])
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        async with tier:
            keys = [NS.key(block_hash(i), 0) for i in range(4)]
            await tier.put_many([(k, b"ours") for k in keys])
            rk = tier.redis_key(keys[1])
            await raw.delete(rk)
            await (raw.rpush(rk, b"foreign") if kind == "list" else raw.hset(rk, "f", "v"))
            assert await tier.get_many(keys) == [b"ours", None, b"ours", b"ours"]
            assert {i.key async for i in tier.scan(NS)} >= {keys[0], keys[2], keys[3]}
    finally:
        await raw.delete(*[k async for k in raw.scan_iter(match=f"{prefix}:*")])
        await raw.aclose()

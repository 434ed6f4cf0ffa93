"""A hostile server on the Redis tier's own RESP client (``native_io``): a proxy process in front of
a real redis-server (tests/drills/_hostile_redis.py) answers the data path wrongly — a bulk header
announcing 256 MiB, a SET answered with a negative length, a nil, a bulk or an integer (and not
stored), a GETRANGE answered with an array, a connection dropped in the middle of a value.

What must hold: the client never allocates beyond what a request can legitimately receive (the
process's peak RSS moves by a few MiB, not hundreds); a store answered with anything but ``+OK``
is never acknowledged (the tier raises; the pipeline counts a dropped store); a failed load leaves
no byte of what arrived in its destinations (each byte is the one it held before, or zero) —
through :class:`RedisTier` and through ``tieredkv.open_store`` with the engine's torch blocks.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import tieredkv
from tests.drills._util import NS, block_hash, payload, report
from tieredkv.backends.redis import RedisTier
from tieredkv.config import RedisTierConfig
from tieredkv.errors import TierUnavailableError
from tieredkv.testing.servers import RedisServer, redis_command

pytestmark = [pytest.mark.timeout(120)]

HOSTILE = Path(__file__).with_name("_hostile_redis.py")
SIZE = 64 << 10
N = 8
SENTINEL = 0xAB
#: What a failed batch may cost this process at most (peak RSS): the fix bounds every allocation
#: by the request (here a 64 KiB destination, or max_batch_bytes=1 MiB for a bytes read).
RSS_BOUND = 8 << 20


class Hostile:
    """The proxy process; ``mode(m)`` switches what it falsifies."""

    def __init__(self, upstream: RedisServer) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HOSTILE), "--upstream-port", str(upstream.port)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # its port, once it listens
        assert line.strip().isdigit(), f"the hostile proxy did not start: {line!r}"
        self.port = int(line)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def mode(self, m: str, *arg: int) -> None:
        assert redis_command(self.port, "HOSTILE", "MODE", m, *arg) == b"+OK"

    def falsified(self) -> dict[str, int]:
        return dict(json.loads(redis_command(self.port, "HOSTILE", "STATS"))["falsified"])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def upstream() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def hostile(upstream: RedisServer) -> Iterator[Hostile]:
    h = Hostile(upstream)
    try:
        yield h
    finally:
        h.close()


def _cfg(url: str, **kw: Any) -> RedisTierConfig:
    base = {
        "url": url,
        "key_prefix": f"hostile{uuid.uuid4().hex[:8]}",
        "socket_timeout_s": 5.0,
        "op_timeout_s": 20.0,
        "connections": 2,
        "max_batch_bytes": "1MiB",
    }
    return RedisTierConfig(**{**base, **kw})


def _keys(n: int = N) -> list[bytes]:
    return [NS.key(block_hash(i), 0) for i in range(n)]


def _memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (``clear_refs`` 5); the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:  # not Linux, or not allowed here
        pytest.skip(f"cannot reset the peak RSS to measure it: {e}")
    return _memory()[0]


def _dirty(bufs: list[bytearray]) -> int:
    """Destinations holding any byte other than what they held (SENTINEL) or zero."""
    return sum(1 for b in bufs if set(b) - {0, SENTINEL})


def _whole(bufs: list[bytearray], values: list[bytes]) -> int:
    """Destinations holding a whole record (of a batch that failed as a whole)."""
    return sum(1 for b, v in zip(bufs, values, strict=True) if bytes(b) == v)


def test_an_oversized_bulk_header_is_refused_before_any_allocation(upstream: RedisServer, hostile: Hostile) -> None:
    """``$268435456`` announced for a 64 KiB value: into destinations and as bytes (GETRANGE up to
    max_batch_bytes), the batch fails and the peak RSS grows by a few MiB at most."""

    async def run() -> dict[str, Any]:
        keys = _keys()
        async with RedisTier(_cfg(hostile.url)) as tier:
            await tier.put_many([(k, payload(i, 1, SIZE)) for i, k in enumerate(keys)])
            hostile.mode("oversize")
            bufs = [bytearray([SENTINEL]) * SIZE for _ in keys]
            base = _reset_peak()
            with pytest.raises(TierUnavailableError):
                await tier.get_many(keys, into=bufs)
            into_growth = _memory()[1] - base
            base = _reset_peak()
            with pytest.raises(TierUnavailableError):
                await tier.get_many(keys)
            bytes_growth = _memory()[1] - base
            hostile.mode("pass")
            assert await tier.get_many(keys[:1]) == [payload(0, 1, SIZE)]  # the tier works again
            return {
                "peak_rss_growth_into_mib": round(into_growth / 2**20, 1),
                "peak_rss_growth_bytes_mib": round(bytes_growth / 2**20, 1),
                "dirty_blocks": _dirty(bufs),
                "falsified": hostile.falsified().get("oversize", 0),
            }

    got = asyncio.run(run())
    report("hostile-resp-oversize", **got)
    assert got["falsified"] >= 2
    assert got["peak_rss_growth_into_mib"] * 2**20 < RSS_BOUND, got
    assert got["peak_rss_growth_bytes_mib"] * 2**20 < RSS_BOUND, got
    assert got["dirty_blocks"] == 0


@pytest.mark.parametrize("mode", ["negative-set", "nil-set", "bulk-set", "int-set"])
def test_a_set_answered_with_anything_but_ok_is_never_acknowledged(
    upstream: RedisServer, hostile: Hostile, mode: str
) -> None:
    """The SETs are not stored (the proxy sends PING in their place) and answered ``$-5``, a nil,
    a bulk ``OK`` or ``:1``: the put fails (the old client counted every one stored); the tier
    works again once the server does."""

    async def run() -> dict[str, Any]:
        keys = _keys()
        raw = redis.Redis(port=upstream.port)
        acked_not_stored = 0
        async with RedisTier(_cfg(hostile.url)) as tier:
            hostile.mode(mode)
            try:
                await tier.put_many([(k, payload(i, 2, SIZE)) for i, k in enumerate(keys)])
                acked = True
            except TierUnavailableError:
                acked = False
            stored = int(raw.exists(*(tier.redis_key(k) for k in keys)))
            if acked:
                acked_not_stored = len(keys) - stored
            hostile.mode("pass")
            await tier.put_many([(keys[0], b"fine")])  # the tier works again
            assert raw.get(tier.redis_key(keys[0])) is not None
        raw.close()
        return {"acked": acked, "stored": stored, "acked_not_stored": acked_not_stored}

    got = asyncio.run(run())
    report(f"hostile-resp-{mode}", **got, falsified=hostile.falsified().get(mode, 0))
    assert got["acked_not_stored"] == 0 and not got["acked"], got


@pytest.mark.parametrize(
    ("mode", "batch", "after"),
    [("drop-mid-bulk", "1MiB", 2), ("drop-mid-bulk", "128KiB", 5), ("array-getrange", "1MiB", 0)],
    ids=["drop-mid-bulk", "drop-mid-bulk-in-a-later-run", "array-getrange"],
)
def test_a_failed_load_leaves_no_received_byte_in_its_destinations(
    upstream: RedisServer, hostile: Hostile, mode: str, batch: str, after: int
) -> None:
    """The connection dropped halfway through a value (after whole values already landed), or an
    array where a bulk belongs: the load fails, each destination holds what it held or zeros (the
    pool's retry on a fresh connection fails the same way; two connections share the batch). With
    a small max_batch_bytes the load goes out in runs of three records, and the drop comes in the
    second one: the records the first run delivered are zeroed too."""

    async def run() -> dict[str, Any]:
        keys = _keys()
        async with RedisTier(_cfg(hostile.url, max_batch_bytes=batch)) as tier:
            await tier.put_many([(k, payload(i, 3, SIZE)) for i, k in enumerate(keys)])
            hostile.mode(mode, after)
            bufs = [bytearray([SENTINEL]) * SIZE for _ in keys]
            with pytest.raises(TierUnavailableError):
                await tier.get_many(keys, into=bufs)
            hostile.mode("pass")
            good = [bytearray(SIZE) for _ in keys]
            assert await tier.get_many(keys, into=good) == [SIZE] * N
            assert all(bytes(g) == payload(i, 3, SIZE) for i, g in enumerate(good))
        values = [payload(i, 3, SIZE) for i in range(N)]
        return {
            "dirty_blocks": _dirty(bufs),
            "whole_records_left": _whole(bufs, values),
            "falsified": hostile.falsified(),
        }

    got = asyncio.run(run())
    report(f"hostile-resp-{mode}-{batch}", **got)
    assert got["falsified"].get(mode, 0) >= 1
    assert got["dirty_blocks"] == 0, got


def test_engine_blocks_through_open_store(upstream: RedisServer, hostile: Hostile) -> None:
    """Through the public API, with a torch block tensor read straight into (direct transfers):
    a store answered with a nil is a dropped store, not a hit; a load whose connection drops
    mid-value leaves its blocks as they were or zeroed."""
    nblocks, bpc = 1 + 2 * N, 1
    block_bytes = SIZE
    cfg: dict[str, Any] = {
        "namespace": {"model": f"hostile-{uuid.uuid4().hex[:8]}"},
        "tiers": [{"kind": "redis", **_cfg(hostile.url).model_dump(mode="json", exclude_none=True)}],
        "pipeline": {"job_timeout_s": 30.0, "breaker_failures": 100},
    }
    raw = redis.Redis(port=upstream.port)
    with tieredkv.open_store(cfg) as s:
        blocks = torch.zeros(nblocks, block_bytes, dtype=torch.uint8)
        s.register_group(0, [blocks], blocks_per_chunk=bpc)
        keys = [s.key(block_hash(i), 0) for i in range(N)]
        src = torch.randint(0, 256, (N, block_bytes), dtype=torch.uint8)
        blocks[1 : N + 1] = src
        tier = s.tiers[0]
        assert isinstance(tier, RedisTier) and tier.config.native_io

        # a store answered with nil: nothing stored, nothing acknowledged
        hostile.mode("nil-set")
        res = s.wait([s.store(0, [(k, (1 + i,)) for i, k in enumerate(keys)])])
        (nil_store,) = res.values()
        assert raw.exists(*(tier.redis_key(k) for k in keys)) == 0
        acked_not_stored = len(nil_store.done)
        dropped = s.stats().dropped.get(tier.name, 0)

        # stored for real, then a load whose connection drops mid-value
        hostile.mode("pass")
        res = s.wait([s.store(0, [(k, (1 + i,)) for i, k in enumerate(keys)])])
        assert all(r.ok and len(r.done) == N for r in res.values())
        hostile.mode("drop-mid-bulk")
        blocks[N + 1 :] = SENTINEL
        res = s.wait([s.load(0, [(k, (N + 1 + i,)) for i, k in enumerate(keys)])])
        (load,) = res.values()
        loaded = blocks[N + 1 :]
        dirty = int(sum(1 for b in loaded if bool(((b != 0) & (b != SENTINEL)).any())))
        hostile.mode("pass")
        res = s.wait([s.load(0, [(k, (N + 1 + i,)) for i, k in enumerate(keys)])])
        assert all(r.ok for r in res.values()) and torch.equal(blocks[N + 1 :], src)
    raw.close()
    report(
        "hostile-resp-open-store",
        nil_store_ok=nil_store.ok,
        acked_not_stored=acked_not_stored,
        dropped_stores=dropped,
        load_ok=load.ok,
        dirty_blocks=dirty,
    )
    assert not nil_store.ok and acked_not_stored == 0 and dropped >= N
    assert not load.ok and dirty == 0


def test_the_hostile_proxy_itself_passes_everything_in_pass_mode(hostile: Hostile) -> None:
    """The harness: a plain proxy round-trips records of every size (CRLF inside, empty)."""

    async def run() -> None:
        keys = _keys(4)
        values = [b"", b"\r\n" * 100, os.urandom(SIZE), os.urandom(3 << 20)]
        async with RedisTier(_cfg(hostile.url, max_batch_bytes="8MiB")) as tier:
            await tier.put_many(list(zip(keys, values)))
            assert await tier.get_many(keys) == values

    asyncio.run(run())
    assert hostile.falsified() == {}

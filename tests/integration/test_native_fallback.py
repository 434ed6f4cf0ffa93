"""Processes with and without the C helper share one LMDB environment and one Redis server.

Where the helper (``tieredkv._fastrec``) does not build, tieredkv runs its pure-Python paths. Two
processes of one deployment can differ there (an image without a compiler next to one with it), so
each side must serve what the other wrote and refuse what the other would refuse. These run
both directions on real LMDB files, in two processes, and on a real Redis server.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tieredkv import format as fmt
from tieredkv.backends.lmdb import LMDBTier
from tieredkv.backends.redis import RedisTier
from tieredkv.config import LMDBTierConfig, RedisTierConfig
from tieredkv.keys import Namespace
from tieredkv.testing.contract import payload
from tieredkv.testing.servers import RedisServer

NATIVE = fmt._fastrec
SIZES = [1000, 64 * 1024, 300 * 1024 + 5]
NS = Namespace(model="native-fallback")

pytestmark = pytest.mark.skipif(NATIVE is None, reason="the C helper is not built: one path only")


def keys(group: int) -> list[bytes]:
    return [NS.key(bytes([group, i]) * 16, group) for i in range(len(SIZES))]


async def _round(tier: Any, write_native: bool, read_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    ks = keys(int(write_native) * 2 + int(read_native))
    monkeypatch.setattr(fmt, "_fastrec", NATIVE if write_native else None)
    await tier.put_many([(k, payload(n, seed=n)) for k, n in zip(ks, SIZES)])
    monkeypatch.setattr(fmt, "_fastrec", NATIVE if read_native else None)
    out = [torch.zeros(n + 7, dtype=torch.uint8) for n in SIZES]
    assert await tier.get_many(ks, into=out) == SIZES
    for o, n in zip(out, SIZES):
        assert torch.equal(o[:n], payload(n, seed=n)) and not o[n:].any()
    # a damaged record is refused on the reading side, whichever side wrote it
    (rec,) = await tier.raw_get_many([ks[1]])
    bad = bytearray(rec)
    bad[-1] ^= 1
    await tier.raw_put_many([(ks[1], bad)])
    dst = torch.zeros(SIZES[1], dtype=torch.uint8)
    assert await tier.get_many([ks[1]], into=[dst]) == [None]
    assert not dst.any()


@pytest.mark.parametrize("write_native", [True, False])
@pytest.mark.parametrize("read_native", [True, False])
@pytest.mark.parametrize("file_batch", [None, 1], ids=["in-lmdb", "record-files"])
async def test_lmdb_records_cross_between_the_paths(
    tmp_path: Path, write_native: bool, read_native: bool, file_batch: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = LMDBTierConfig(
        path=str(tmp_path / "kv"), size_cap_bytes=64 << 20, map_size_bytes=128 << 20, file_batch_bytes=file_batch
    )
    tier = LMDBTier(cfg)
    await tier.open()
    try:
        await _round(tier, write_native, read_native, monkeypatch)
        assert tier.counters["corrupt"] == 1
    finally:
        await tier.close()


@pytest.mark.parametrize("write_native", [True, False])
@pytest.mark.parametrize("read_native", [True, False])
async def test_redis_records_cross_between_the_paths(
    redis_server: RedisServer, write_native: bool, read_native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = RedisTier(RedisTierConfig(url=redis_server.url, key_prefix=f"nf{int(write_native)}{int(read_native)}"))
    await tier.open()
    try:
        await _round(tier, write_native, read_native, monkeypatch)
        assert tier.counters["corrupt"] == 1
        await tier.delete_many([k for g in range(4) for k in keys(g)])
    finally:
        await tier.close()


def test_a_process_without_the_helper_reads_what_one_with_it_wrote(tmp_path: Path) -> None:
    """Two processes on one LMDB environment: this one (helper loaded) writes, a child with the
    helper's import blocked reads and checks every byte, then writes its own records for this
    process to read back."""
    path = str(tmp_path / "shared")
    child = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.modules["tieredkv._fastrec"] = None  # as on a machine where it did not build
        import torch
        from tieredkv import format as fmt
        from tieredkv.backends.lmdb import LMDBTier
        from tieredkv.config import LMDBTierConfig
        from tieredkv.keys import Namespace
        from tieredkv.testing.contract import payload

        assert fmt._fastrec is None and not fmt.NATIVE
        ns = Namespace(model="native-fallback")
        sizes = {SIZES!r}

        async def main():
            tier = LMDBTier(LMDBTierConfig(path={path!r}, size_cap_bytes=64 << 20, map_size_bytes=128 << 20))
            await tier.open()
            ks = [ns.key(bytes([9, i]) * 16, 0) for i in range(len(sizes))]
            out = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
            assert await tier.get_many(ks, into=out) == sizes
            assert all(torch.equal(o, payload(n, seed=n)) for o, n in zip(out, sizes))
            mine = [ns.key(bytes([8, i]) * 16, 0) for i in range(len(sizes))]
            await tier.put_many([(k, payload(n, seed=n + 1)) for k, n in zip(mine, sizes)])
            await tier.close()

        asyncio.run(main())
        print("child ok")
        """
    )

    async def write_then_read() -> None:
        tier = LMDBTier(LMDBTierConfig(path=path, size_cap_bytes=64 << 20, map_size_bytes=128 << 20))
        await tier.open()
        try:
            ks = [NS.key(bytes([9, i]) * 16, 0) for i in range(len(SIZES))]
            await tier.put_many([(k, payload(n, seed=n)) for k, n in zip(ks, SIZES)])
            r = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", child], capture_output=True, text=True)
            assert r.returncode == 0 and "child ok" in r.stdout, r.stderr[-3000:]
            theirs = [NS.key(bytes([8, i]) * 16, 0) for i in range(len(SIZES))]
            out = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
            assert await tier.get_many(theirs, into=out) == SIZES
            assert all(torch.equal(o, payload(n, seed=n + 1)) for o, n in zip(out, SIZES))
        finally:
            await tier.close()

    assert fmt._fastrec is NATIVE
    asyncio.run(write_then_read())


@pytest.mark.parametrize("native", [True, False])
def test_reads_by_place_answer_alike_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """``read_placed_into`` (the LMDB tier's read of records in record files, its places taken from
    index entries) per item, with and without the helper: a good record's length, nothing read
    where the entry is not a place or there is no destination, -1 for a payload longer than its
    destination, a damaged record refused (its destination zeroed), a file that is gone an
    ``FileNotFoundError``; several files and offsets in one call."""
    import struct

    layout_struct = struct.Struct("<dQ16sQ")  # stamp, size, token, offset: the LMDB tier's layout
    layout = (layout_struct.size, 8, 16, 32)
    sizes = [4096, 70_000, 1000]
    ks = [NS.key(bytes([7, i]) * 16, 0) for i in range(len(sizes))]
    pays = [payload(n, seed=n).numpy().tobytes() for n in sizes]
    heads = bytearray(fmt.HEADER_SIZE * len(sizes))
    fmt.encode_heads_into(memoryview(heads), [(k, memoryview(p)) for k, p in zip(ks, pays)])
    tok_a, tok_b = bytes(range(16)), bytes(range(16, 32))
    fmt.write_records(str(tmp_path / tok_a.hex()), memoryview(heads), pays, sync=False)
    fmt.write_records(str(tmp_path / tok_b.hex()), memoryview(heads[:64]), pays[:1], sync=False)
    offs = [0, fmt.HEADER_SIZE + sizes[0], 2 * fmt.HEADER_SIZE + sizes[0] + sizes[1]]

    def entry(token: bytes, i: int, at: int | None = None) -> memoryview:
        return memoryview(layout_struct.pack(1.5, fmt.HEADER_SIZE + sizes[i], token, offs[i] if at is None else at))

    monkeypatch.setattr(fmt, "_fastrec", NATIVE if native else None)
    entries: list[Any] = [
        entry(tok_a, 0),
        entry(tok_a, 1),
        entry(tok_a, 2),
        entry(tok_b, 0, 0),  # the same record in a second file
        entry(tok_a, 1),  # no destination: not read
        memoryview(b"x" * 16),  # an access entry that is no place: not read
        None,  # no entry
        entry(tok_a, 1),  # a destination too small
        entry(tok_a, 2, offs[1]),  # another record's place: not good for this key
        entry(bytes(16), 0),  # a file that is not there
    ]
    order = [0, 1, 2, 0, 1, 0, 0, 1, 2, 0]
    dsts: list[Any] = [bytearray(sizes[j] + 3) for j in order]
    dsts[4] = None
    dsts[7] = bytearray(sizes[1] - 1)
    got = fmt.read_placed_into(str(tmp_path), entries, [ks[j] for j in order], dsts, layout)
    assert got[:4] == [sizes[0], sizes[1], sizes[2], sizes[0]]
    for i in range(4):
        n = sizes[order[i]]
        assert bytes(dsts[i][:n]) == pays[order[i]] and not any(dsts[i][n:])
    assert got[4:7] == [None, None, None]
    assert got[7] == -1
    assert isinstance(got[8], fmt.CorruptRecordError) and not any(dsts[8])
    assert isinstance(got[9], FileNotFoundError)

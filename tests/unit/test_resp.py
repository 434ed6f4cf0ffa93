"""The native RESP reader (tieredkv.backends._resp) fed byte streams cut at every place a socket
could cut them: replies land in order, bulk replies with a destination land in it, and anything
unexpected closes the connection instead of being guessed at."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError

from tieredkv.backends._resp import Into, Placed, Record, _pack, _Protocol, _windows, native_target


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def writelines(self, parts: list[Any]) -> None:
        self.written.extend(bytes(p) for p in parts)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _deliver(proto: _Protocol, stream: bytes, cuts: list[int]) -> None:
    """Hand ``stream`` to the protocol the way an event loop does: ask for a buffer, fill part of it."""
    pos = 0
    for cut in [*cuts, len(stream)]:
        while pos < cut:
            buf = proto.get_buffer(-1)
            assert len(buf) > 0
            n = min(len(buf), cut - pos)
            buf[:n] = stream[pos : pos + n]
            pos += n
            proto.buffer_updated(n)


async def _run(stream: bytes, intos: list[Into | None], cuts: list[int]) -> tuple[list[Any], _Protocol]:
    proto = _Protocol()
    transport = _Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    task = asyncio.ensure_future(proto.execute([["X"]] * len(intos), intos, 5.0))
    await asyncio.sleep(0)
    _deliver(proto, stream, cuts)
    return await task, proto


def _replies_stream(payload: bytes, foreign: bytes) -> bytes:
    return (
        b"+OK\r\n"
        + b":1\r\n"
        + b"$%d\r\n" % len(payload)
        + payload
        + b"\r\n"
        + b"$-1\r\n"
        + b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
        + b"$%d\r\n" % len(foreign)
        + foreign
        + b"\r\n"
        + b"-ERR unknown command\r\n"
        + b"$0\r\n\r\n"
    )


@pytest.mark.parametrize("seed", range(40))
def test_replies_cut_anywhere_land_in_order_and_in_place(seed: int) -> None:
    rng = random.Random(seed)
    head_len, body_len = 64, rng.choice([1, 100, 5000, 70_000, 200_000])
    record = os.urandom(head_len + body_len)
    foreign = os.urandom(rng.choice([0, 10, head_len + body_len + 1]))  # does not fit: read as bytes
    stream = _replies_stream(record, foreign)
    ncuts = rng.choice([0, 1, 5, 50, len(stream)])
    cuts = sorted(rng.sample(range(1, len(stream)), min(ncuts, len(stream) - 1)))
    head, body = bytearray(head_len), bytearray(body_len + 7)
    head2, body2 = bytearray(head_len), bytearray(body_len)
    intos: list[Into | None] = [None, None, Into(memoryview(head), memoryview(body)), None, None]
    intos += [Into(memoryview(head2), memoryview(body2)), None, None]
    replies, proto = asyncio.run(_run(stream, intos, cuts))
    assert replies[0] == b"OK" and replies[1] == 1
    assert isinstance(replies[2], Placed) and replies[2] == len(record)
    assert bytes(head) + bytes(body[:body_len]) == record and bytes(body[body_len:]) == bytes(7)
    assert replies[3] is None
    assert isinstance(replies[4], OutOfMemoryError)
    assert replies[5] == foreign and not isinstance(replies[5], Placed) and bytes(head2) == bytes(head_len)
    assert isinstance(replies[6], ResponseError) and str(replies[6]) == "unknown command"
    assert replies[7] == b""
    assert proto.broken is None  # still usable


@pytest.mark.parametrize(
    "stream",
    [b"$5\r\nabcdeXY", b"*1\r\n:1\r\n", b"?what\r\n", b":1\r\n:2\r\n"],
    ids=["bulk-without-crlf", "array", "unknown-type", "extra-reply"],
)
def test_a_bad_stream_breaks_the_connection(stream: bytes) -> None:
    async def main() -> None:
        proto = _Protocol()
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute([["X"]], [None], 5.0))
        await asyncio.sleep(0)
        _deliver(proto, stream, [])
        if stream == b":1\r\n:2\r\n":  # the batch got its reply; the extra one breaks the connection
            assert await task == [1]
        else:
            with pytest.raises(RedisConnectionError):
                await task
        assert proto.broken is not None and transport.closed
        with pytest.raises(RedisConnectionError):
            await proto.execute([["X"]], [None], 5.0)

    asyncio.run(main())


def test_lost_connection_fails_the_batch_and_a_timeout_breaks_it() -> None:
    async def main() -> None:
        proto = _Protocol()
        proto.connection_made(_Transport())  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute([["X"], ["Y"]], [None, None], 5.0))
        await asyncio.sleep(0)
        _deliver(proto, b"+OK\r\n", [])
        proto.connection_lost(None)
        with pytest.raises(RedisConnectionError):
            await task
        slow = _Protocol()
        slow.connection_made(_Transport())  # type: ignore[arg-type]
        with pytest.raises(Exception) as ei:
            await slow.execute([["X"]], [None], 0.05)
        assert "Timeout" in type(ei.value).__name__ and slow.broken is not None

    asyncio.run(main())


def test_windows_cut_after_the_reply_that_fills_one() -> None:
    def into(n: int) -> Into:
        return Into(memoryview(bytearray(64)), memoryview(bytearray(n - 64)))

    assert _windows([None, into(300), None, into(300)], 512) == []  # one window: sent whole
    assert _windows([None, into(300), None, into(300), None, into(100)], 512) == [4]
    assert _windows([into(600), into(600), into(600)], 512) == [1, 2]
    assert _windows([None] * 50, 1) == []  # no placed replies (e.g. SETs): one write


@pytest.mark.parametrize("cut_every", [0, 7, 1000])
def test_placed_reads_go_out_two_windows_at_a_time(cut_every: int) -> None:
    """A batch of reads larger than two windows: the first two go out at once, each later one
    when the oldest window in flight is answered; the replies land in order and in place, however
    the socket cuts them."""

    async def main() -> None:
        n, size = 9, 300
        records = [os.urandom(size) for _ in range(n)]
        heads = [bytearray(64) for _ in range(n)]
        bodies = [bytearray(size - 64) for _ in range(n)]
        commands: list[list[Any]] = []
        intos: list[Into | None] = []
        for i in range(n):
            commands += [["EXISTS", b"k%d" % i], ["GETRANGE", b"k%d" % i, 0, size]]
            intos += [None, Into(memoryview(heads[i]), memoryview(bodies[i]))]
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute(commands, intos, 5.0, window=2 * size))

        def sent() -> list[int]:
            wire = b"".join(transport.written)
            return [i for i in range(n) if b"GETRANGE\r\n$%d\r\nk%d\r\n" % (len(b"k%d" % i), i) in wire]

        await asyncio.sleep(0)
        assert sent() == [0, 1, 2, 3]  # windows of two records: two windows in flight
        for i in range(n):
            stream = b":1\r\n$%d\r\n%s\r\n" % (size, records[i])
            cuts = list(range(cut_every, len(stream), cut_every)) if cut_every else []
            _deliver(proto, stream, cuts)
            # the window of records i-1, i answered: the window after the next one goes out
            assert sent() == list(range(min(n, 4 + 2 * ((i + 1) // 2))))
        replies = await task
        assert replies[0::2] == [1] * n and replies[1::2] == [size] * n
        assert all(isinstance(r, Placed) for r in replies[1::2])
        assert [bytes(h) + bytes(b) for h, b in zip(heads, bodies)] == records
        assert proto.broken is None and not proto._later  # nothing left to send

        # a connection lost mid-batch fails it and sends nothing more
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute(commands, intos, 5.0, window=2 * size))
        await asyncio.sleep(0)
        _deliver(proto, b":1\r\n$%d\r\n%s\r\n" % (size, records[0]), [])
        proto.connection_lost(None)
        with pytest.raises(RedisConnectionError):
            await task
        assert sent() == [0, 1, 2, 3] and not proto._later

    asyncio.run(main())


def test_pack_sends_record_parts_without_joining_large_ones() -> None:
    header, payload = b"H" * 64, memoryview(os.urandom(100_000))
    parts = _pack([["SET", b"k", Record(header, payload), "EX", 5], ["GETRANGE", b"k", 0, 99]])
    assert any(p is payload for p in parts)  # the payload goes out as the caller's buffer
    wire = b"".join(bytes(p) for p in parts)
    n = 64 + len(payload)
    assert wire == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % n
        + header
        + bytes(payload)
        + b"\r\n$2\r\nEX\r\n$1\r\n5\r\n*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$1\r\n0\r\n$2\r\n99\r\n"
    )


def test_native_target_reads_urls() -> None:
    assert native_target("redis://:pw@10.0.0.1:7000/3") == {
        "host": "10.0.0.1",
        "port": 7000,
        "db": 3,
        "username": None,
        "password": "pw",
    }
    assert native_target("redis://alice:p%40ss@h") == {
        "host": "h",
        "port": 6379,
        "db": 0,
        "username": "alice",
        "password": "p@ss",
    }
    assert native_target("unix:///tmp/r.sock?db=2")["path"] == "/tmp/r.sock"  # type: ignore[index]
    assert native_target("rediss://h:6380/0") is None

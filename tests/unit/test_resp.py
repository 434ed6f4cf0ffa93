"""The native RESP reader (tieredkv.backends.redis.resp) fed byte streams cut at every place a socket
could cut them: replies land in order, bulk replies with a destination land in it, and anything
unexpected closes the connection instead of being guessed at."""

from __future__ import annotations

import asyncio
import os
import random
import tracemalloc
from typing import Any, Self

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError

from tieredkv.backends.redis.pool import RespPool, native_target
from tieredkv.backends.redis.resp import (
    Into,
    Placed,
    Record,
    RespProtocolError,
    _pack,
    _Protocol,
    _windows,
)


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


async def _run(
    stream: bytes, commands: list[list[Any]], intos: list[Into | None], cuts: list[int]
) -> tuple[list[Any], _Protocol]:
    proto = _Protocol()
    transport = _Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    task = asyncio.ensure_future(proto.execute(commands, intos, 5.0))
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
    head3, body3 = bytearray(head_len), bytearray(body_len)
    intos: list[Into | None] = [None, None, Into(memoryview(head), memoryview(body)), None, None]
    intos[3] = Into(memoryview(head3), memoryview(body3))
    intos += [Into(memoryview(head2), memoryview(body2)), None, None]
    commands: list[list[Any]] = [
        ["SET", b"k", b"v"],
        ["EXISTS", b"k"],
        ["GETRANGE", b"k", 0, head_len + len(body)],
        ["GET", b"k"],
        ["SET", b"k", b"v", "EX", 5],
        ["GETRANGE", b"k", 0, head_len + body_len],  # room for one byte more than the destination
        ["EXISTS", b"k"],
        ["GETRANGE", b"k", 0, 10],
    ]
    replies, proto = asyncio.run(_run(stream, commands, intos, cuts))
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
    ("stream", "command"),
    [
        (b"$5\r\nabcdeXY", ["GETRANGE", b"k", 0, 9]),
        (b"*1\r\n:1\r\n", ["EXISTS", b"k"]),
        (b"?what\r\n", ["EXISTS", b"k"]),
        (b":1\r\n:2\r\n", ["EXISTS", b"k"]),
    ],
    ids=["bulk-without-crlf", "array", "unknown-type", "extra-reply"],
)
def test_a_bad_stream_breaks_the_connection(stream: bytes, command: list[Any]) -> None:
    async def main() -> None:
        proto = _Protocol()
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute([command], [None], 5.0))
        await asyncio.sleep(0)
        _deliver(proto, stream, [])
        if stream == b":1\r\n:2\r\n":  # the batch got its reply; the extra one breaks the connection
            assert await task == [1]
        else:
            with pytest.raises(RedisConnectionError):
                await task
        assert proto.broken is not None and transport.closed
        with pytest.raises(RedisConnectionError):
            await proto.execute([command], [None], 5.0)

    asyncio.run(main())


def test_lost_connection_fails_the_batch_and_a_timeout_breaks_it() -> None:
    async def main() -> None:
        proto = _Protocol()
        proto.connection_made(_Transport())  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute([["PING"], ["PING"]], [None, None], 5.0))
        await asyncio.sleep(0)
        _deliver(proto, b"+PONG\r\n", [])
        proto.connection_lost(None)
        with pytest.raises(RedisConnectionError):
            await task
        slow = _Protocol()
        slow.connection_made(_Transport())  # type: ignore[arg-type]
        with pytest.raises(Exception) as ei:
            await slow.execute([["PING"]], [None], 0.05)
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


# ---- every reply bounded by its command ---------------------------------------------------------


def _one(command: list[Any], stream: bytes, into: Into | None = None, cuts: list[int] | None = None) -> Any:
    """The reply of one command to ``stream``, or the exception its batch failed with; the
    connection must be broken (and closed) exactly when the batch failed."""

    async def main() -> Any:
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute([command], [into], 5.0))
        await asyncio.sleep(0)
        _deliver(proto, stream, cuts or [])
        await asyncio.sleep(0)  # a batch that got its replies returns now
        if not task.done():
            proto.connection_lost(None)  # the stream ended: the peer closed
        try:
            (reply,) = await task
        except RedisConnectionError as e:
            assert proto.broken is not None and transport.closed
            with pytest.raises(RedisConnectionError):  # never reused
                await proto.execute([command], [into], 5.0)
            return e
        assert proto.broken is None and not transport.closed
        return reply

    return asyncio.run(main())


_SET = ["SET", b"k", Record(b"H" * 64, b"payload"), "EX", 60]
_RANGE = ["GETRANGE", b"k", 0, 99]  # at most 100 bytes


@pytest.mark.parametrize(
    ("command", "stream"),
    [
        # a store answered with anything but +OK (e.g. a negative length read as a nil): never stored
        (_SET, b"$-5\r\n"),
        (_SET, b"$-1\r\n"),
        (_SET, b"$2\r\nOK\r\n"),
        (_SET, b":1\r\n"),
        (_SET, b"+QUEUED\r\n"),
        (_SET, b"+ok\r\n"),
        (_SET, b"*1\r\n+OK\r\n"),
        (_SET, b"_\r\n"),  # RESP3 null
        (_SET, b"#t\r\n"),  # RESP3 boolean
        (["PING"], b"+OK\r\n"),
        (["AUTH", "pw"], b"+PONG\r\n"),
        # counts out of range, or malformed
        (["EXISTS", b"k"], b":2\r\n"),
        (["EXISTS", b"k"], b":-1\r\n"),
        (["EXISTS", b"k"], b":+1\r\n"),
        (["EXISTS", b"k"], b":01\r\n"),
        (["EXISTS", b"k"], b": 1\r\n"),
        (["EXISTS", b"k"], b":1_0\r\n"),
        (["EXISTS", b"k"], b":\r\n"),
        (["EXISTS", b"k"], b",1.0\r\n"),  # RESP3 double
        (["DEL", b"a", b"b"], b":3\r\n"),
        (["EXISTS", b"k"], b"$1\r\n1\r\n"),
        # bulk lengths: negative, signed, padded, not digits, beyond the command's bound
        (_RANGE, b"$-1\r\n"),  # GETRANGE never answers nil
        (_RANGE, b"$-2\r\n"),
        (_RANGE, b"$+5\r\nabcde\r\n"),
        (_RANGE, b"$05\r\nabcde\r\n"),
        (_RANGE, b"$ 5\r\nabcde\r\n"),
        (_RANGE, b"$5x\r\nabcde\r\n"),
        (_RANGE, b"$\r\n"),
        (_RANGE, b"$\xd9\xa5\r\nabcde\r\n"),  # a non-ASCII digit
        (_RANGE, b"$101\r\n" + b"x" * 101 + b"\r\n"),
        (_RANGE, b"$268435456\r\n" + b"x" * 100),
        (_RANGE, b"$99999999999999999999999\r\n"),
        (_RANGE, b"+OK\r\n"),
        (_RANGE, b":5\r\n"),
        (_RANGE, b"*1\r\n$1\r\nx\r\n"),
        (_RANGE, b"%1\r\n+a\r\n+b\r\n"),  # RESP3 map
        (_RANGE, b"=5\r\ntxt:x\r\n"),  # RESP3 verbatim string
        # lines longer than their type allows (no CRLF in sight)
        (_RANGE, b"$" + b"1" * 40),
        (["EXISTS", b"k"], b":" + b"1" * 40),
        (_SET, b"+" + b"O" * 40),
        (_SET, b"-ERR " + b"x" * 10_000),
    ],
)
def test_a_reply_its_command_cannot_get_breaks_the_connection(command: list[Any], stream: bytes) -> None:
    for cuts in ([], list(range(1, len(stream)))):  # whole, and a byte at a time
        got = _one(command, stream, cuts=cuts)
        assert isinstance(got, RespProtocolError), (stream, got)


def test_replies_within_their_bounds_are_taken() -> None:
    assert _one(_SET, b"+OK\r\n") == b"OK"
    assert _one(["PING"], b"+PONG\r\n") == b"PONG"
    assert _one(["EXISTS", b"k"], b":0\r\n") == 0
    assert _one(["DEL", b"a", b"b", b"c"], b":3\r\n") == 3
    assert _one(_RANGE, b"$0\r\n\r\n") == b""
    assert _one(_RANGE, b"$100\r\n" + b"\r\n" * 50 + b"\r\n") == b"\r\n" * 50
    assert _one(["GETRANGE", b"k", 5, 4], b"$0\r\n\r\n") == b""
    err = _one(_SET, b"-OOM command not allowed\r\n")
    assert isinstance(err, OutOfMemoryError)  # a refusal is a reply in its place, not a broken connection
    assert isinstance(_one(_RANGE, b"-WRONGTYPE Operation against a key\r\n"), ResponseError)
    assert isinstance(_one(_SET, b"-ERR " + b"x" * 4000 + b"\r\n"), ResponseError)
    head, body = bytearray(4), bytearray(6)
    assert _one(["GET", b"k"], b"$-1\r\n", Into(memoryview(head), memoryview(body))) is None
    got = _one(["GET", b"k"], b"$10\r\n0123456789\r\n", Into(memoryview(head), memoryview(body)))
    assert isinstance(got, Placed) and got == 10 and head + body == b"0123456789"
    assert isinstance(
        _one(["GET", b"k"], b"$11\r\n0123456789A\r\n", Into(memoryview(head), memoryview(body))), RespProtocolError
    )


@pytest.mark.parametrize(
    "command",
    [
        ["GET", b"k"],
        ["GETRANGE", b"k", 0, -1],
        ["GETRANGE", b"k", -5, 10],
        ["SET", b"k", b"v", "GET"],
        ["SET", b"k", b"v", "NX"],
        ["SET", b"k", b"v", "EX"],
        ["HGETALL", b"k"],
        ["PING", b"hello"],
        [],
    ],
)
def test_a_command_whose_reply_has_no_bound_is_refused_before_it_is_sent(command: list[Any]) -> None:
    async def main() -> None:
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await proto.execute([["PING"], command], [None, None], 5.0)
        assert transport.written == [] and proto.broken is None
        with pytest.raises(ValueError, match="place"):  # an Into only where a value comes back
            await proto.execute([["EXISTS", b"k"]], [Into(memoryview(bytearray(1)), memoryview(bytearray(1)))], 5.0)

    asyncio.run(main())


def test_an_announced_length_beyond_the_bound_allocates_nothing() -> None:
    """``$268435456`` to a GETRANGE of 100 bytes, with a destination and without: refused on the
    header, before anything the size of the announcement exists (the old parser allocated it)."""
    tracemalloc.start()
    try:
        for into in (None, Into(memoryview(bytearray(64)), memoryview(bytearray(36)))):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            got = _one(_RANGE, b"$268435456\r\n" + b"x" * 1000, into)
            peak = tracemalloc.get_traced_memory()[1] - base
            assert isinstance(got, RespProtocolError) and peak < 1 << 20, peak
    finally:
        tracemalloc.stop()


# ---- a failed batch leaves nothing in its destinations ------------------------------------------


def _reads(
    n: int, size: int, fill: int = 0xAB
) -> tuple[list[list[Any]], list[Into | None], list[bytearray], list[bytearray]]:
    """EXISTS + GETRANGE-into of ``n`` records of ``size`` bytes (64 header + payload); the
    destinations (payload one byte longer than the record's) start as ``fill``."""
    heads = [bytearray([fill]) * 64 for _ in range(n)]
    bodies = [bytearray([fill]) * (size - 64 + 1) for _ in range(n)]
    commands: list[list[Any]] = []
    intos: list[Into | None] = []
    for i in range(n):
        commands += [["EXISTS", b"k%d" % i], ["GETRANGE", b"k%d" % i, 0, size]]
        intos += [None, Into(memoryview(heads[i]), memoryview(bodies[i]))]
    return commands, intos, heads, bodies


def _answer(records: list[bytes]) -> bytes:
    return b"".join(b":1\r\n$%d\r\n%s\r\n" % (len(r), r) for r in records)


@pytest.mark.parametrize("how", ["lost", "bad-reply", "timeout", "cancelled"])
@pytest.mark.parametrize("cut_every", [0, 1000])
def test_a_failed_batch_zeroes_every_destination_it_placed_bytes_into(how: str, cut_every: int) -> None:
    """Two records received whole, the third cut off part way (a byte at a time too: then it is
    received straight into its destination), then the batch fails: the bytes of all three are
    zeroed, and the fourth destination, never reached, is as it was; nothing is returned."""
    size = 3000

    async def main() -> None:
        records = [os.urandom(size) for _ in range(4)]
        commands, intos, heads, bodies = _reads(4, size)
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute(commands, intos, 0.2 if how == "timeout" else 5.0))
        await asyncio.sleep(0)
        stream = _answer(records[:2]) + b":1\r\n$%d\r\n" % size + records[2][:1234]
        _deliver(proto, stream, list(range(cut_every, len(stream), cut_every)) if cut_every else [])
        assert not task.done()
        assert bytes(heads[2]) + bytes(bodies[2][: 1234 - 64]) == records[2][:1234]  # landed in place
        if how == "lost":
            proto.connection_lost(None)
        elif how == "bad-reply":  # the rest of the value, then no CRLF after it
            _deliver(proto, records[2][1234:] + b"XY", [])
        elif how == "cancelled":
            task.cancel()
        with pytest.raises(RedisConnectionError if how in ("lost", "bad-reply") else BaseException) as ei:
            await task
        if how == "timeout":
            assert "Timeout" in type(ei.value).__name__
        if how == "cancelled":
            assert isinstance(ei.value, asyncio.CancelledError)
        assert proto.broken is not None and transport.closed
        for i in range(3):
            assert not any(heads[i]) and not any(bodies[i][: size - 64])  # zeroed
            assert bodies[i][size - 64] == 0xAB  # the byte beyond the record was never touched
        assert set(heads[3]) == {0xAB} and set(bodies[3]) == {0xAB}  # never reached: as it was
        # nothing lands after the failure, whatever still arrives
        _deliver(proto, records[2][1234:] + b"\r\n" + _answer(records[3:]), [])
        assert not any(heads[2]) and set(heads[3]) == {0xAB}

    asyncio.run(main())


def test_a_protocol_error_after_whole_replies_zeroes_them() -> None:
    size = 500

    async def main() -> None:
        records = [os.urandom(size) for _ in range(2)]
        commands, intos, heads, bodies = _reads(2, size)
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute(commands, intos, 5.0))
        await asyncio.sleep(0)
        _deliver(proto, _answer(records[:1]) + b":1\r\n$-7\r\n", [])
        with pytest.raises(RespProtocolError):
            await task
        assert not any(heads[0]) and not any(bodies[0][: size - 64]) and bodies[0][-1] == 0xAB
        assert set(heads[1]) == {0xAB}

    asyncio.run(main())


def test_an_answered_batch_keeps_its_bytes_when_the_connection_breaks_later() -> None:
    size = 500

    async def main() -> None:
        records = [os.urandom(size)]
        commands, intos, heads, bodies = _reads(1, size)
        proto, transport = _Protocol(), _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute(commands, intos, 5.0))
        await asyncio.sleep(0)
        _deliver(proto, _answer(records) + b"+unsolicited\r\n", [])
        assert await task == [1, size]
        assert proto.broken is not None  # the extra reply broke the connection, after the batch
        assert bytes(heads[0]) + bytes(bodies[0][: size - 64]) == records[0]

    asyncio.run(main())


# ---- the pool against a scripted server ---------------------------------------------------------


class _Scripted:
    """A loopback server answering each connection's commands with ``script(conn_no, command)``:
    bytes to send, or ``(bytes, None)``: send them, then close the connection."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.conns = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def target(self) -> dict[str, Any]:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return {"host": "127.0.0.1", "port": port, "db": 0, "username": None, "password": None}

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = self.conns
        self.conns += 1
        try:
            while True:
                line = await r.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int((await r.readline())[1:])
                    args.append((await r.readexactly(n + 2))[:-2])
                out = self.script(conn, args)
                w.write(out[0] if isinstance(out, tuple) else out)
                await w.drain()
                if isinstance(out, tuple):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return  # the client went away, or the test is over
        finally:
            w.close()


def _pool(target: dict[str, Any], size: int = 1, socket_timeout: float = 5.0) -> RespPool:
    return RespPool(target, size=size, socket_timeout=socket_timeout, connect_timeout=5.0)


def test_the_pool_retries_a_batch_cut_off_on_a_pooled_connection_from_zeroed_destinations() -> None:
    """The pooled connection dies in the middle of a value; the retry on a new connection gets a
    shorter value: no byte of the first attempt is left behind it."""
    size = 2000
    first = os.urandom(size)
    second = os.urandom(100)

    def script(conn: int, args: list[bytes]) -> bytes | tuple[bytes, None]:
        if args[0] == b"PING":
            return b"+PONG\r\n"
        if args[0] == b"EXISTS":
            return b":1\r\n"
        if conn == 0:  # the pooled connection: half the value, then gone
            sent.append(first)
            return b"$%d\r\n" % size + first[: size // 2], None
        return b"$%d\r\n%s\r\n" % (len(second), second)

    sent: list[bytes] = []

    async def main() -> None:
        async with _Scripted(script) as srv:
            pool = _pool(srv.target)
            assert await pool.execute([["PING"]]) == [b"PONG"]  # the connection is pooled now
            commands, intos, heads, bodies = _reads(1, size, fill=0)
            replies = await pool.execute(commands, intos)
            await pool.aclose()
        assert sent and srv.conns == 2
        assert replies == [1, len(second)] and isinstance(replies[1], Placed)
        assert bytes(heads[0]) + bytes(bodies[0][: len(second) - 64]) == second
        assert not any(bodies[0][len(second) - 64 :])  # the first attempt's bytes past it were zeroed

    asyncio.run(main())


def test_a_protocol_error_is_not_retried() -> None:
    def script(conn: int, args: list[bytes]) -> bytes:
        return b"+PONG\r\n" if args[0] == b"PING" else b"$-5\r\n"

    async def main() -> None:
        async with _Scripted(script) as srv:
            pool = _pool(srv.target)
            assert await pool.execute([["PING"]]) == [b"PONG"]
            with pytest.raises(RespProtocolError):
                await pool.execute([_SET])
            await pool.aclose()
        assert srv.conns == 1  # no second connection for a retry

    asyncio.run(main())


@pytest.mark.parametrize("how", ["one-fails", "cancelled"])
def test_a_split_batch_that_fails_anywhere_leaves_nothing_in_any_destination(how: str) -> None:
    """A batch split over two connections: one answers whole, the other drops mid-value (or the
    caller gives up while it waits): the whole fails and the finished half's bytes are zeroed
    too; the other connection is closed, so nothing lands afterwards."""
    size = 2000
    records = [os.urandom(size) for _ in range(4)]

    def script(conn: int, args: list[bytes]) -> bytes | tuple[bytes, None]:
        if args[0] == b"PING":
            return b"+PONG\r\n"
        i = int(args[1][1:])
        if i >= 2 and how == "cancelled":
            return b""  # the second half is never answered
        if args[0] == b"EXISTS":
            return b":1\r\n"
        if i == 3 and how == "one-fails":
            return b"$%d\r\n" % size + records[i][:1000], None  # half a value, then gone
        return b"$%d\r\n%s\r\n" % (size, records[i])

    async def main() -> None:
        async with _Scripted(script) as srv:
            pool = _pool(srv.target, size=2, socket_timeout=600.0)  # nothing here waits for a timeout
            commands, intos, heads, bodies = _reads(4, size)
            batches = [(commands[:4], intos[:4]), (commands[4:], intos[4:])]
            task = asyncio.ensure_future(pool.execute_split(batches))
            if how == "cancelled":
                while bytes(heads[1]) + bytes(bodies[1][: size - 64]) != records[1]:
                    await asyncio.sleep(0.001)  # until the first half landed
                task.cancel()
                done, _ = await asyncio.wait([task], timeout=60)
                assert done, "the unanswered half was not stopped"
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(RedisConnectionError):
                    await task
            await pool.aclose()
        for i in range(4):
            assert set(heads[i]) <= {0, 0xAB} and set(bodies[i]) <= {0, 0xAB}, i
        assert not any(heads[0]) and not any(heads[1])  # whole replies of the other half: zeroed

    asyncio.run(main())

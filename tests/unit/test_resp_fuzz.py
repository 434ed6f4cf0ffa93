"""Property-based tests of the native RESP client (tieredkv.backends.redis.resp).

* Against a real redis-server: random batches of the data path's commands (SET of binary values of
  random sizes, empty ones and ones with CRLF inside, as one part or as header + payload parts;
  GETRANGE of random ranges, into random destinations or not; EXISTS and DEL of one key or several;
  GET into a destination), sent through :class:`RespPool` on the default loop and on uvloop, with
  reply windows of the default size and of a few bytes, give what redis-py gets for the same
  batch on keys of their own.
* Against hostile byte streams: a batch's legitimate replies, or those replies mutated (cut short,
  a byte flipped, bytes inserted, a bulk length replaced by a huge, negative or malformed one,
  garbage), or arbitrary bytes, handed to the protocol object cut at random places. Whatever
  comes: the batch ends at once when the stream does (never a hang); it returns replies that are
  each one its command can get (exactly the legitimate ones when nothing was mutated) or fails
  with redis-py's ConnectionError / TimeoutError and leaves every destination as it was or zeroed;
  and the memory it allocates stays within what its commands can legitimately receive.
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tieredkv.backends.redis import resp as _resp
from tieredkv.backends.redis.pool import RespPool
from tieredkv.backends.redis.resp import Into, Placed, Record, _Protocol
from tieredkv.testing.servers import RedisServer

SENTINEL = 0xAB

try:
    import uvloop

    LOOPS: list[Callable[[], asyncio.AbstractEventLoop] | None] = [None, uvloop.new_event_loop]
except ImportError:  # pragma: no cover - uvloop is installed with the dev extras
    LOOPS = [None]


def _value(rng: random.Random, n: int) -> bytes:
    """``n`` random bytes with CRLFs (and lone CRs and LFs) scattered inside."""
    v = bytearray(rng.randbytes(n))
    for _ in range(min(n // 2, rng.randint(0, 4))):
        p = rng.randrange(0, n - 1)
        v[p : p + 2] = rng.choice([b"\r\n", b"\r\n", b"\rx", b"x\n"])
    return bytes(v)


_SIZES = st.one_of(
    st.sampled_from([0, 1, 2, 63, 64, 65, 100, 4096, 65_536, 70_000]),
    st.integers(min_value=0, max_value=300_000),
)


# ---- against a real redis-server ----------------------------------------------------------------


@st.composite
def _ops(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Abstract ops on 3 keys: ("set", k, size, seed, split) / ("getrange", k, a, b, into) /
    ("get", k, into) / ("exists", ks) / ("del", ks); into: None, (head, body) lengths, or (head,
    "fit", slack): a body that the reply fits with ``slack`` bytes to spare."""
    keys = st.integers(min_value=0, max_value=2)
    into = st.one_of(
        st.none(),
        st.tuples(st.sampled_from([0, 1, 64]), _SIZES),
        st.tuples(st.sampled_from([0, 1, 64]), st.just("fit"), st.sampled_from([0, 1, 7, 4096])),
    )
    start = st.one_of(st.just(0), st.integers(0, 300), st.integers(0, 100_000))
    end = st.one_of(st.just(1 << 20), st.integers(0, 400_000))
    op = st.one_of(
        st.tuples(st.just("set"), keys, _SIZES, st.integers(0, 2**32), st.one_of(st.none(), st.integers(0, 100))),
        st.tuples(st.just("getrange"), keys, start, end, into),
        st.tuples(st.just("get"), keys, st.tuples(st.sampled_from([0, 64]), _SIZES)),
        st.tuples(st.just("exists"), st.lists(keys, min_size=1, max_size=3)),
        st.tuples(st.just("del"), st.lists(keys, min_size=1, max_size=3)),
    )
    setup = st.tuples(st.just("set"), keys, _SIZES, st.integers(0, 2**32), st.one_of(st.none(), st.integers(0, 100)))
    return draw(st.lists(setup, max_size=3)) + draw(st.lists(op, min_size=1, max_size=10))


def _batch(
    ops: list[tuple[Any, ...]], prefix: bytes
) -> tuple[list[list[Any]], list[Into | None], list[tuple[bytearray, bytearray] | None]]:
    """The commands of ``ops`` on keys under ``prefix``, their destinations (filled with SENTINEL)
    and the Intos over them. A GET's destination is made large enough for the value it will find
    (a GET has no bound but its destination)."""
    commands: list[list[Any]] = []
    intos: list[Into | None] = []
    dests: list[tuple[bytearray, bytearray] | None] = []
    held: dict[int, int] = {}  # key -> length of its value, as the batch goes
    for op in ops:
        kind = op[0]
        where = None
        if kind == "set":
            _, k, size, seed, split = op
            value = _value(random.Random(seed), size)
            cut = size if split is None else min(split, size)
            arg: Any = value if split is None else Record(value[:cut], memoryview(value)[cut:])
            commands.append(["SET", prefix + b"%d" % k, arg])
            held[op[1]] = size
        elif kind == "getrange":
            _, k, a, b, where = op
            commands.append(["GETRANGE", prefix + b"%d" % k, a, b])
            if where is not None and where[1] == "fit":  # room for what it will get, and some
                n = max(0, min(held.get(k, 0), b + 1) - a)
                where = (where[0], max(0, n - where[0]) + where[2])
        elif kind == "get":
            _, k, (head, body) = op
            commands.append(["GET", prefix + b"%d" % k])
            where = (head, max(body, held.get(k, 0) - head))
        else:
            commands.append([kind.upper(), *(prefix + b"%d" % k for k in op[1])])
            if kind == "del":
                for k in op[1]:
                    held.pop(k, None)
        dest = None if where is None else (bytearray([SENTINEL]) * where[0], bytearray([SENTINEL]) * where[1])
        dests.append(dest)
        intos.append(None if dest is None else Into(memoryview(dest[0]), memoryview(dest[1])))
    return commands, intos, dests


def _redis_py(client: redis.Redis, commands: list[list[Any]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for cmd in commands:
        pipe.execute_command(*(b"".join(bytes(p) for p in a.parts) if isinstance(a, Record) else a for a in cmd))
    return list(pipe.execute(raise_on_error=False))


@pytest.mark.parametrize("loop_factory", LOOPS, ids=["asyncio", "uvloop"][: len(LOOPS)])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=_ops(), second=_ops(), window=st.sampled_from([None, 1, 70_000]), connections=st.sampled_from([1, 2]))
def test_random_batches_get_what_redis_py_gets(
    redis_server: RedisServer,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
    first: list[tuple[Any, ...]],
    second: list[tuple[Any, ...]],
    window: int | None,
    connections: int,
) -> None:
    """``first`` then ``second`` in one batch on one connection, or each on a connection of its
    own (then they run in no set order: each has keys of its own)."""
    run = uuid.uuid4().hex.encode()
    half = len(first)
    a, b = _batch(first, b"fz:n:" + run + b":a:"), _batch(second, b"fz:n:" + run + b":b:")
    commands, intos, dests = a[0] + b[0], a[1] + b[1], a[2] + b[2]
    plain = _batch(first, b"fz:p:" + run + b":a:")[0] + _batch(second, b"fz:p:" + run + b":b:")[0]
    target = {"host": "127.0.0.1", "port": redis_server.port, "db": 0, "username": None, "password": None}

    async def native() -> list[Any]:
        pool = RespPool(target, size=connections, socket_timeout=10.0, connect_timeout=5.0)
        try:
            if connections == 1:
                return await pool.execute(commands, intos)
            parts = await pool.execute_split([(commands[:half], intos[:half]), (commands[half:], intos[half:])])
            return parts[0] + parts[1]
        finally:
            await pool.aclose()

    client = redis.Redis(port=redis_server.port, protocol=2)
    saved = _resp.REPLY_WINDOW
    try:
        if window is not None:
            _resp.REPLY_WINDOW = window  # a window per reply, or a few replies per window
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            got = runner.run(native())
        want = _redis_py(client, plain)
    finally:
        _resp.REPLY_WINDOW = saved
        keys = list(client.scan_iter(match=b"fz:*:" + run + b":*"))  # both sides' keys
        if keys:
            client.delete(*keys)
        client.close()
    assert len(got) == len(want) == len(commands)
    event(f"values placed: {sum(isinstance(g, Placed) for g in got) > 0}")
    event(f"values read as bytes: {sum(isinstance(g, bytes) and len(g) > 2 for g in got) > 0}")
    for cmd, g, w, d in zip(commands, got, want, dests, strict=True):
        name = cmd[0]
        if isinstance(w, Exception):
            assert isinstance(g, ResponseError) and str(g) == str(w), (name, g, w)
        elif name == "SET":
            assert g == b"OK" and w is True
        elif name in ("EXISTS", "DEL"):
            assert g == w and type(g) is int
        elif isinstance(g, Placed):
            assert d is not None and len(d[0]) <= g <= len(d[0]) + len(d[1])
            assert bytes(d[0]) + bytes(d[1][: g - len(d[0])]) == w
            assert set(d[1][g - len(d[0]) :]) <= {SENTINEL}  # nothing past the value touched
        else:
            assert g == w and not isinstance(g, Placed), (name, g if g is None else len(g), w if w is None else len(w))
            if d is not None:  # not placed: the destination is untouched
                assert set(d[0]) <= {SENTINEL} and set(d[1]) <= {SENTINEL}


# ---- against hostile byte streams ---------------------------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def writelines(self, parts: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


@st.composite
def _exchange(draw: st.DrawFn) -> tuple[list[list[Any]], list[tuple[int, int] | None], list[bytes], list[Any]]:
    """A batch and its legitimate replies: (commands, destination sizes, each reply's bytes on
    the wire, each reply as the client should return it: bytes / int / None / ("placed", value)
    / ("error", message))."""
    n = draw(st.integers(min_value=1, max_value=8))
    commands: list[list[Any]] = []
    sizes: list[tuple[int, int] | None] = []
    wire: list[bytes] = []
    replies: list[Any] = []
    refused: dict[str, list[Any]] = {
        "SET": ["SET", b"k", b"v"],
        "EXISTS": ["EXISTS", b"k"],
        "DEL": ["DEL", b"k"],
        "GETRANGE": ["GETRANGE", b"k", 0, 10],
        "GET": ["GET", b"k"],
    }
    for _ in range(n):
        kind = draw(st.sampled_from(["SET", "EXISTS", "DEL", "GETRANGE", "GET", "PING"]))
        size: tuple[int, int] | None = None
        reply_wire: bytes
        reply: Any
        if draw(st.integers(0, 9)) == 0 and kind != "PING":
            msg = draw(st.sampled_from(["WRONGTYPE Operation against a key", "OOM command not allowed", "ERR no"]))
            reply_wire, reply = b"-%s\r\n" % msg.encode(), ("error", msg)
            if kind in ("GETRANGE", "GET"):
                size = (64, draw(st.integers(0, 3000)))
            commands.append(refused[kind])
        elif kind == "SET":
            commands.append(["SET", b"k", b"v", "EX", 5])
            reply_wire, reply = b"+OK\r\n", b"OK"
        elif kind == "PING":
            commands.append(["PING"])
            reply_wire, reply = b"+PONG\r\n", b"PONG"
        elif kind in ("EXISTS", "DEL"):
            nk = draw(st.integers(1, 3))
            commands.append([kind, *[b"k"] * nk])
            v = draw(st.integers(0, nk))
            reply_wire, reply = b":%d\r\n" % v, v
        else:
            head, body = draw(st.sampled_from([0, 64])), draw(st.integers(0, 3000))
            size = (head, body)
            if kind == "GETRANGE":
                a = draw(st.integers(0, 5))
                b = draw(st.integers(0, head + body + 2))
                commands.append(["GETRANGE", b"k", a, b])
                most = max(b - a + 1, 0)
            else:
                commands.append(["GET", b"k"])
                most = head + body
            if kind == "GET" and draw(st.booleans()):
                reply_wire, reply = b"$-1\r\n", None
            else:
                value = _value(random.Random(draw(st.integers(0, 2**32))), draw(st.integers(0, most)))
                reply_wire = b"$%d\r\n%s\r\n" % (len(value), value)
                if kind == "GETRANGE" and draw(st.booleans()):
                    size = None  # read as bytes
                fits = size is not None and head <= len(value) <= head + body
                reply = ("placed", value) if fits else value
        sizes.append(size)
        wire.append(reply_wire)
        replies.append(reply)
    return commands, sizes, wire, replies


#: How a stream is spoilt ("length": a bulk header's length replaced, the likeliest to matter).
_MUTATIONS = ["none", "truncate", "flip", "insert", "length", "length", "swap", "swap", "extra", "garbage"]
#: Replies put in another's place by "swap": each one some command of the data path can get.
_SWAPS = [b"+OK\r\n", b"+PONG\r\n", b":0\r\n", b":1\r\n", b":3\r\n", b"$-1\r\n", b"$3\r\nabc\r\n", b"$0\r\n\r\n"]
_LENGTHS = [b"268435456", b"-5", b"-2", b"-1", b"+5", b"05", b"5x", b"", b"99999999999999999999", b"1_0", b" 5"]


def _mutate(data: st.DataObject, wire: list[bytes]) -> tuple[str, bytes]:
    """The replies ``wire`` joined, spoilt in one way (or not: "none")."""
    stream = b"".join(wire)
    how = data.draw(st.sampled_from(_MUTATIONS), label="mutation")
    bulks = [i for i, w in enumerate(wire) if w.startswith(b"$")]
    if how == "length" and not bulks:
        how = "truncate"
    if how == "none" or not stream:
        return "none", stream
    if how == "truncate":
        return how, stream[: data.draw(st.integers(0, len(stream) - 1))]
    if how == "flip":
        p = data.draw(st.integers(0, len(stream) - 1))
        return how, stream[:p] + bytes([stream[p] ^ data.draw(st.integers(1, 255))]) + stream[p + 1 :]
    if how == "insert":
        p = data.draw(st.integers(0, len(stream)))
        return how, stream[:p] + data.draw(st.binary(min_size=1, max_size=20)) + stream[p:]
    if how == "length":  # a bulk reply's header announces another length; its value stays as it was
        i = data.draw(st.sampled_from(bulks))
        length = data.draw(st.sampled_from(_LENGTHS))
        event(f"length {length!r}")
        head = b"$" + length + b"\r\n"
        return how, b"".join(wire[:i]) + head + wire[i][wire[i].index(b"\r\n") + 2 :] + b"".join(wire[i + 1 :])
    if how == "swap":  # one reply replaced by another type's (or the same: then it may be taken)
        i = data.draw(st.integers(0, len(wire) - 1))
        return how, b"".join(wire[:i]) + data.draw(st.sampled_from(_SWAPS)) + b"".join(wire[i + 1 :])
    if how == "extra":
        return how, stream + data.draw(st.sampled_from([b"+OK\r\n", b":1\r\n", b"$1\r\nx\r\n", b"*0\r\n"]))
    return how, data.draw(st.binary(max_size=200))


def _conforms(cmd: list[Any], reply: Any, size: tuple[int, int] | None) -> bool:
    """Whether ``reply`` is one that ``cmd`` can get."""
    if isinstance(reply, ResponseError):
        return True
    name = cmd[0]
    if name == "SET":
        return reply == b"OK"
    if name == "PING":
        return reply == b"PONG"
    if name in ("EXISTS", "DEL"):
        return type(reply) is int and 0 <= reply <= len(cmd) - 1
    most = max(cmd[3] - cmd[2] + 1, 0) if name == "GETRANGE" else sum(size or (0, 0))
    if reply is None:
        return name == "GET"
    if isinstance(reply, Placed):
        return size is not None and size[0] <= reply <= min(most, size[0] + size[1])
    return isinstance(reply, bytes) and len(reply) <= most


@settings(max_examples=300, deadline=None)
@given(exchange=_exchange(), data=st.data())
def test_hostile_streams_never_hang_overallocate_or_leave_bytes_behind(
    exchange: tuple[list[list[Any]], list[tuple[int, int] | None], list[bytes], list[Any]], data: st.DataObject
) -> None:
    commands, sizes, wire, expected = exchange
    how, stream = _mutate(data, wire)
    cuts = sorted(
        {c for c in data.draw(st.lists(st.integers(1, 1 << 14), max_size=8), label="cuts") if c < len(stream)}
    )
    dests = [None if s is None else (bytearray([SENTINEL]) * s[0], bytearray([SENTINEL]) * s[1]) for s in sizes]
    intos = [None if d is None else Into(memoryview(d[0]), memoryview(d[1])) for d in dests]
    # what the batch may legitimately allocate: each bulk reply not placed, received, then copied
    bound = sum(
        2 * (max(c[3] - c[2] + 1, 0) if c[0] == "GETRANGE" else sum(s or (0, 0)))
        for c, s in zip(commands, sizes, strict=True)
        if c[0] in ("GETRANGE", "GET")
    )

    async def main() -> tuple[list[Any] | BaseException, int]:
        proto = _Protocol()
        proto.connection_made(_Transport())  # type: ignore[arg-type]
        task = asyncio.ensure_future(proto.execute(commands, intos, 30.0))
        await asyncio.sleep(0)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            pos = 0
            for cut in [*cuts, len(stream)]:
                while pos < cut:
                    buf = proto.get_buffer(-1)
                    k = min(len(buf), cut - pos)
                    buf[:k] = stream[pos : pos + k]
                    pos += k
                    proto.buffer_updated(k)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        await asyncio.sleep(0)
        if not task.done():
            proto.connection_lost(None)  # the stream ended
        done, _ = await asyncio.wait([task], timeout=5.0)
        assert done, "the batch did not end when its stream did"
        try:
            return task.result(), peak
        except (RedisConnectionError, RedisTimeoutError) as e:
            return e, peak

    result, peak = asyncio.run(main())
    event(f"{how}: {type(result).__name__ if isinstance(result, BaseException) else 'replies'}")
    assert peak <= bound + (256 << 10), (how, peak, bound)
    if isinstance(result, BaseException):
        assert how != "none" or not stream, result  # the legitimate replies are taken
        for d in dests:
            if d is not None:
                assert set(d[0]) <= {0, SENTINEL} and set(d[1]) <= {0, SENTINEL}, how
        return
    assert len(result) == len(commands)
    for cmd, r, s in zip(commands, result, sizes, strict=True):
        assert _conforms(cmd, r, s), (how, cmd, r)
    if how == "none":
        for r, e, d in zip(result, expected, dests, strict=True):
            if isinstance(e, tuple) and e[0] == "error":
                assert isinstance(r, ResponseError) and str(r) == e[1].removeprefix("ERR ")
            elif isinstance(e, tuple):
                assert isinstance(r, Placed) and d is not None and r == len(e[1])
                assert bytes(d[0]) + bytes(d[1][: r - len(d[0])]) == e[1]
            else:
                assert r == e and not isinstance(r, Placed)

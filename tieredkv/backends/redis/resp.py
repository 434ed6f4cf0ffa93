"""A small pipelined RESP2 client for the Redis tier's data path: writes without copying the
payload, reads straight into the caller's buffers.

Why: redis-py moves a value through several copies on the way in (socket buffer, hiredis, a new
``bytes``, then the tier's buffer), and a record written through it has to be built by copying
the payload behind its header. Here:

* a write sends the 64-byte header and the payload as separate parts of one bulk string
  (``transport.writelines``; no copy in Python);
* a read receives a bulk reply straight into its destination: the header into a small buffer,
  the payload into the caller's memory (:class:`asyncio.BufferedProtocol`, i.e. ``recv_into``).

Scope: one node over plain TCP or a unix socket; the commands the data path sends (SET, GETRANGE,
GET into a destination, EXISTS, DEL) and the connection's AUTH / SELECT / PING. Clusters, TLS and
the admin commands stay on redis-py. Errors are redis-py's exception classes, so the tier
translates both paths alike.

What a reply may be is fixed by its command before it is sent, and checked as it arrives:

* every command may be refused (an error reply); otherwise SET, AUTH and SELECT get ``+OK``, PING
  ``+PONG``, EXISTS and DEL an integer from 0 to their number of keys, ``GETRANGE key a b`` a bulk
  string of at most ``b - a + 1`` bytes (never nil), GET a nil or a bulk string no longer than its
  destination. A command with no such bound (e.g. a GET with no destination, a GETRANGE with a
  negative index) is refused before anything is sent (``ValueError``);
* a bulk string is allocated (or placed) only once its length is known to be within its
  command's bound, so what a batch allocates is bounded by what it asked for, whatever the server
  announces;
* anything else — another type (an array, a RESP3 type, a nil or a bulk string where ``+OK``
  belongs), a length out of bounds, a malformed length or integer (a negative length other than
  -1, a sign, a leading zero, a non-digit), a line longer than its type allows, a reply no
  command asked for — is a :class:`RespProtocolError` (a redis-py ``ConnectionError``).

A connection runs one batch at a time (its reads go out in windows, two in flight:
:data:`REPLY_WINDOW`); one that timed out, was cancelled, lost its peer or read something it does
not accept is closed, never reused, and its batch fails as a whole: none of its replies is
returned (a SET is never reported stored on a connection that broke), every destination the batch
placed bytes into — replies received whole, and the one cut off — is zeroed before the failure is
raised, and nothing more is received into any.

This module is the protocol (what a reply may be, the connection that parses and places it);
the connections to a node and their batches are :mod:`~tieredkv.backends.redis.pool`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Into", "Placed", "Record", "RespProtocolError"]

_CRLF = b"\r\n"
_READ_CHUNK = 1 << 16
#: Longest line of an error reply (its message); a longer one is a protocol error.
_MAX_ERROR_LINE = 1 << 13
#: Longest line of any other reply (``+OK``, ``+PONG``, an integer, a bulk length: 20 characters
#: at most); a longer one is a protocol error.
_MAX_SHORT_LINE = 32
_SMALL = 1 << 12  # arguments up to this size are joined into the command's prefix buffer
#: Bytes of placed replies (:class:`Into`) asked for in one window of a batch; two windows are in
#: flight on a connection, the next sent as the oldest one is answered. The server builds each
#: reply in memory of its own for every command it has read before it sends any, so a batch of
#: reads sent whole made it allocate (on a guest that hands freed memory back to its host: fault
#: in) the whole batch again. Through the pipeline (256 MiB per figure, two connections, one
#: server, sent whole and windowed alternating in one process, median of 4-7), loads at 64 KiB /
#: 256 KiB / 1 MiB / 4 MiB went 0.53 -> 0.75, 0.77 -> 1.14, 1.51 -> 1.62, 1.74 -> 1.91 GB/s, and
#: the server's page faults per 256 MiB load (256 KiB) from ~34,000 to ~500.
REPLY_WINDOW = 1 << 19

_ERRORS: dict[str, type[RedisError]] = {
    "OOM": OutOfMemoryError,
    "NOAUTH": AuthenticationError,
    "WRONGPASS": AuthenticationError,
    "NOPERM": NoPermissionError,
    "READONLY": ReadOnlyError,
    "LOADING": BusyLoadingError,
}

_PLUS, _MINUS, _COLON, _DOLLAR = 0x2B, 0x2D, 0x3A, 0x24


class RespProtocolError(RedisConnectionError):
    """A reply its command cannot legitimately get (another type, a length beyond the command's
    bound, a malformed line, a reply no command asked for): the connection is closed and never
    reused, and its batch fails (not retried: the server, or what stands in for it, is not
    speaking the protocol the data path relies on)."""


class Record:
    """One argument sent as a single bulk string made of ``parts`` (e.g. header, payload)."""

    __slots__ = ("parts", "size")

    def __init__(self, *parts: bytes | memoryview) -> None:
        self.parts = parts
        self.size = sum(len(p) for p in parts)


class Into:
    """Where a bulk reply goes: its first ``len(head)`` bytes into ``head``, the rest into ``body``
    (when it fits: ``len(head) <= length <= len(head) + len(body)``; otherwise the reply is bytes)."""

    __slots__ = ("body", "head")

    def __init__(self, head: memoryview, body: memoryview) -> None:
        self.head = head
        self.body = body


class Placed(int):
    """The reply of a command with an :class:`Into`: a bulk string of this many bytes, placed there."""


class _Want:
    """What a command's reply may be, besides an error: ``+text``, an integer in ``[0, most]``, or a
    bulk string of at most ``most`` bytes (``nil``: or a nil), placed in ``into`` when it fits."""

    __slots__ = ("into", "kind", "most", "nil", "text")

    def __init__(
        self, kind: int, *, text: bytes = b"", most: int = 0, nil: bool = False, into: Into | None = None
    ) -> None:
        self.kind = kind
        self.text = text
        self.most = most
        self.nil = nil
        self.into = into


_OK = _Want(_PLUS, text=b"OK")
_PONG = _Want(_PLUS, text=b"PONG")
_COUNT1 = _Want(_COLON, most=1)
#: SET options that keep its reply ``+OK`` (NX / XX / GET would make it a nil or a bulk string).
_SET_OPTIONS = {b"EX": 1, b"PX": 1, b"EXAT": 1, b"PXAT": 1, b"KEEPTTL": 0}


_GETRANGE, _GET, _SET, _COUNT, _AUTH, _PING = range(6)
#: The commands this client can bound the replies of (as the data path spells them, str or bytes).
_COMMANDS: dict[str | bytes, int] = {
    b"GETRANGE": _GETRANGE,
    b"GET": _GET,
    b"SET": _SET,
    b"EXISTS": _COUNT,
    b"DEL": _COUNT,
    b"AUTH": _AUTH,
    b"SELECT": _AUTH,
    b"PING": _PING,
}
_COMMANDS.update({k.decode(): v for k, v in _COMMANDS.items() if isinstance(k, bytes)})


def _arg_bytes(arg: Any) -> bytes:
    return arg.encode() if isinstance(arg, str) else bytes(arg) if isinstance(arg, (bytes, bytearray)) else b""


def _index(arg: Any) -> int:
    """A GETRANGE index the reply can be bounded by: a non-negative integer."""
    try:
        v = int(arg)
    except (TypeError, ValueError):
        v = -1
    if v < 0 or isinstance(arg, bool):
        raise ValueError(f"GETRANGE index {arg!r}: only non-negative indices bound the reply")
    return v


def _want(cmd: Sequence[Any], into: Into | None) -> _Want:
    """The replies ``cmd`` may get besides an error (``ValueError`` for a command whose reply this
    client cannot bound, or an :class:`Into` on a command that does not answer with a value)."""
    name = cmd[0] if cmd else b""
    which = _COMMANDS.get(name) if isinstance(name, (str, bytes)) else None
    if which is None:
        which = _COMMANDS.get(_arg_bytes(name).upper(), -1)
    if which == _GETRANGE and len(cmd) == 4:
        a, b = cmd[2], cmd[3]
        if type(a) is not int or type(b) is not int or a < 0 or b < 0:
            a, b = _index(a), _index(b)
        return _Want(_DOLLAR, most=max(b - a + 1, 0), into=into)
    if which == _GET and len(cmd) == 2 and into is not None:
        return _Want(_DOLLAR, most=len(into.head) + len(into.body), nil=True, into=into)
    if into is not None:
        raise ValueError(f"{_arg_bytes(name).decode(errors='replace')!r}: only GETRANGE and GET place their reply")
    if which == _SET and len(cmd) >= 3:
        opts = [_arg_bytes(a).upper() for a in cmd[3:]]
        i = 0
        while i < len(opts) and opts[i] in _SET_OPTIONS:
            i += 1 + _SET_OPTIONS[opts[i]]
        if i == len(opts):
            return _OK
    elif which == _COUNT and len(cmd) >= 2:
        return _COUNT1 if len(cmd) == 2 else _Want(_COLON, most=len(cmd) - 1)
    elif which == _AUTH and len(cmd) >= 2:
        return _OK
    elif which == _PING and len(cmd) == 1:
        return _PONG
    raise ValueError(f"the data path's RESP client cannot bound the reply of {list(cmd[:1])!r} as sent")


def _integer(line: bytes | bytearray, what: str) -> int:
    """A RESP integer as Redis writes it: ``-`` or not, then 1-19 ASCII digits, no leading zero."""
    digits = line if line.isdigit() else line[1:] if line[:1] == b"-" else b""
    if not (0 < len(digits) <= 19 and digits.isdigit() and (digits[0] != 0x30 or len(digits) == 1)):
        raise RespProtocolError(f"bad reply: {what} {bytes(line[:_MAX_SHORT_LINE])!r} is not an integer")
    return int(line)


def _error(message: str) -> RedisError:
    code = message.split(" ", 1)[0]
    if code == "ERR":
        message = message[4:]
    return _ERRORS.get(code, ResponseError)(message)


def _zero(parts: Sequence[memoryview]) -> None:
    for p in parts:
        if len(p):
            p[:] = bytes(len(p))


def _scrub(intos: Sequence[Into | None], replies: Sequence[Any]) -> None:
    """Zero what the placed replies of a batch (:class:`Placed`) put into their destinations."""
    for into, r in zip(intos, replies, strict=True):
        if into is not None and isinstance(r, Placed):
            _zero((into.head, into.body[: r - len(into.head)]))


class _Protocol(asyncio.BufferedProtocol):
    """One connection: sends a batch of commands and collects their replies in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(_READ_CHUNK)
        self._mv = memoryview(self._buf)
        self._r = 0  # parse window of the line buffer: [r, w)
        self._w = 0
        self._direct = False  # the last get_buffer handed out a reply target, not the line buffer
        self._targets: collections.deque[memoryview] = collections.deque()  # a bulk body's remaining parts
        self._tpos = 0
        self._need_crlf = False
        self._value: Any = None  # the reply being received (a bulk string)
        self._expect: collections.deque[_Want] = collections.deque()
        self._replies: list[Any] = []
        self._placed: list[memoryview] = []  # the caller's memory this batch placed bytes into
        self._waiter: asyncio.Future[list[Any]] | None = None
        self._later: collections.deque[list[bytes | memoryview]] = collections.deque()  # windows not sent yet
        self._send_at: collections.deque[int] = collections.deque()  # replies in before each is sent
        self.broken: BaseException | None = None

    # ---- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to the server lost: {exc or 'closed by the server'}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._targets and self._r == self._w:  # nothing buffered: receive into the reply's memory
            self._direct = True
            return self._targets[0][self._tpos :]
        self._direct = False
        if self._r == self._w:
            self._r = self._w = 0
        elif len(self._buf) - self._w < _READ_CHUNK // 4:
            n = self._w - self._r
            self._buf[:n] = self._buf[self._r : self._w]
            self._r, self._w = 0, n
            if len(self._buf) - n < _READ_CHUNK // 4:
                self._buf.extend(bytes(_READ_CHUNK))
                self._mv = memoryview(self._buf)
        return self._mv[self._w :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.broken is not None:  # closed: nothing more is parsed, nor placed anywhere
            self._r = self._w = 0
            return
        try:
            if self._direct:
                self._tpos += nbytes
                if self._tpos == len(self._targets[0]):
                    self._next_target()
            else:
                self._w += nbytes
            self._feed()
        except Exception as e:  # noqa: BLE001 - a protocol surprise: this connection is done
            self._fail(e if isinstance(e, RedisConnectionError) else RespProtocolError(f"bad reply: {e}"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost reports it

    # ---- parsing -----------------------------------------------------------------------

    def _next_target(self) -> None:
        self._targets.popleft()
        self._tpos = 0
        if not self._targets:
            self._need_crlf = True

    def _feed(self) -> None:
        buf = self._buf
        while True:
            if self._targets:  # bytes of a bulk body that came in with the line before it
                avail = self._w - self._r
                if not avail:
                    return
                t = self._targets[0]
                k = min(avail, len(t) - self._tpos)
                t[self._tpos : self._tpos + k] = self._mv[self._r : self._r + k]
                self._r += k
                self._tpos += k
                if self._tpos == len(t):
                    self._next_target()
                continue
            if self._need_crlf:
                if self._w - self._r < 2:
                    return
                if buf[self._r : self._r + 2] != _CRLF:
                    raise RespProtocolError("bad reply: a bulk string does not end with CRLF")
                self._r += 2
                self._need_crlf = False
                value, self._value = self._value, None
                self._reply(bytes(value) if isinstance(value, bytearray) else value)
                continue
            if self._r == self._w:
                return
            if not self._expect:
                raise RespProtocolError("bad reply: more replies than commands")
            kind = buf[self._r]
            if kind not in (_PLUS, _MINUS, _COLON, _DOLLAR):
                raise RespProtocolError(f"bad reply: unexpected type byte {bytes([kind])!r}")
            most = _MAX_ERROR_LINE if kind == _MINUS else _MAX_SHORT_LINE
            end = buf.find(_CRLF, self._r, min(self._w, self._r + most + 3))
            if end < 0:
                if self._w - self._r > most + 2:
                    raise RespProtocolError(f"bad reply: a line longer than {most} bytes")
                return
            line = buf[self._r + 1 : end]
            self._r = end + 2
            want = self._expect[0]
            if kind == _MINUS:
                self._reply(_error(line.decode(errors="replace")))
            elif kind != want.kind:
                raise RespProtocolError(
                    f"bad reply: {bytes([kind])!r} to a command that gets {bytes([want.kind])!r} or an error"
                )
            elif kind == _PLUS:
                if line != want.text:
                    raise RespProtocolError(f"bad reply: +{bytes(line)!r} where +{want.text!r} belongs")
                self._reply(want.text)
            elif kind == _COLON:
                v = _integer(line, "an integer")
                if not 0 <= v <= want.most:
                    raise RespProtocolError(f"bad reply: :{v} to a command that counts 0 to {want.most}")
                self._reply(v)
            else:
                self._bulk(_integer(line, "a bulk length"), want)

    def _bulk(self, n: int, want: _Want) -> None:
        if n < 0:
            if n != -1 or not want.nil:
                raise RespProtocolError(f"bad reply: a bulk length of {n} to a command that cannot get it")
            self._reply(None)
            return
        if n > want.most:  # checked before anything is allocated or placed
            raise RespProtocolError(f"bad reply: a bulk string of {n} bytes to a command that gets {want.most} at most")
        into = want.into
        if into is not None and len(into.head) <= n <= len(into.head) + len(into.body):
            parts = [into.head, into.body[: n - len(into.head)]]
            self._placed += parts
            self._value = Placed(n)
        else:
            value = bytearray(n)
            parts = [memoryview(value)]
            self._value = value
        self._targets.extend(p for p in parts if len(p))
        if not self._targets:
            self._need_crlf = True

    def _reply(self, value: Any) -> None:
        self._expect.popleft()
        self._replies.append(value)
        if self._send_at and len(self._replies) == self._send_at[0]:
            self._send_at.popleft()
            assert self.transport is not None
            self.transport.writelines(self._later.popleft())
        if not self._expect and self._waiter is not None and not self._waiter.done():
            self._placed = []  # the batch is answered: its placed replies are the caller's now
            self._waiter.set_result(self._replies)

    def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
        self._later.clear()  # a broken connection sends nothing more
        self._send_at.clear()
        self.close()  # and receives nothing more (nor parses, nor places): then its batch's
        self._targets.clear()  # placed bytes are zeroed
        self._expect.clear()
        placed, self._placed = self._placed, []
        _zero(placed)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    # ---- use ---------------------------------------------------------------------------

    def close(self) -> None:
        if self.broken is None:
            self.broken = RedisConnectionError("connection closed")
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def execute(
        self,
        commands: Sequence[Sequence[Any]],
        intos: Sequence[Into | None],
        timeout: float | None,
        window: int | None = None,
    ) -> list[Any]:
        """Send ``commands`` and return their replies in order (an error reply is an exception
        object in its place). Raises redis-py's ConnectionError (:class:`RespProtocolError` for a
        reply its command cannot get) / TimeoutError, with every destination this batch placed
        bytes into zeroed; ``ValueError`` (nothing sent) for a command whose reply is unbounded.

        Commands whose replies are placed (an :class:`Into`) go out in windows of about
        ``window`` bytes of replies (:data:`REPLY_WINDOW`), two windows in flight; a batch of
        other commands goes out in one write."""
        if self.broken is not None:
            raise self.broken
        assert self.transport is not None and self._waiter is None
        if not commands:  # no reply to wait for
            return []
        wants = collections.deque(_want(c, i) for c, i in zip(commands, intos, strict=True))
        loop = asyncio.get_running_loop()
        self._expect = wants
        self._replies = []
        self._placed = []
        self._waiter = loop.create_future()
        try:
            cuts = _windows(intos, REPLY_WINDOW if window is None else window)
            starts, ends = [0, *cuts], [*cuts, len(commands)]  # window k: commands[starts[k]:ends[k]]
            self._later.extend(_pack(commands[a:b]) for a, b in zip(starts[2:], ends[2:]))
            self._send_at.extend(ends[: len(self._later)])  # window k + 2 once window k is answered
            first_two = ends[1] if len(ends) > 1 else len(commands)
            self.transport.writelines(_pack(commands[:first_two]))
            async with asyncio.timeout(timeout):
                return await self._waiter
        except TimeoutError:
            self._fail(RedisTimeoutError("Timeout reading from the server"))
            raise self.broken from None  # type: ignore[misc]
        except BaseException:
            self._fail(RedisConnectionError("batch abandoned (cancelled)"))
            raise
        finally:
            self._waiter = None
            self._later.clear()
            self._send_at.clear()


def _windows(intos: Sequence[Into | None], window: int) -> list[int]:
    """Where a batch is cut into windows: after the command whose placed reply takes the
    window's bytes to ``window`` or more (none when the batch's placed replies fit one window)."""
    cuts: list[int] = []
    size = 0
    for i, into in enumerate(intos):
        if into is not None:
            size += len(into.head) + len(into.body)
            if size >= window:
                cuts.append(i + 1)
                size = 0
    if cuts and cuts[-1] == len(intos):
        cuts.pop()
    return cuts


def _pack(commands: Sequence[Sequence[Any]]) -> list[bytes | memoryview]:
    """RESP arrays of bulk strings; small pieces joined, large ones (payloads) passed as they are."""
    out: list[bytes | memoryview] = []
    small = bytearray()
    for cmd in commands:
        small += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int):
                arg = b"%d" % arg
            parts = arg.parts if isinstance(arg, Record) else (arg,)
            small += b"$%d\r\n" % (arg.size if isinstance(arg, Record) else len(arg))
            for part in parts:
                if len(part) <= _SMALL:
                    small += part
                else:
                    out.append(bytes(small))
                    small.clear()
                    out.append(part)
            small += _CRLF
    if small:
        out.append(bytes(small))
    return out

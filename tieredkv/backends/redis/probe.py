"""Lookups a Redis tier answers in the step they are asked: :class:`BoundedExists`, one pipelined
``EXISTS`` per batch on blocking sockets of its own, answered from the calling thread within a
budget (``lookup_budget_ms``), or not at all.

Why: a scheduler thread (vLLM's) must never wait on I/O, so a lookup that reached a Redis tier
used to go out asynchronously and answer "ask again" in the step it was asked. On a hybrid model
that shifts a new request's schedule by a step, and with it which sliding-window and Mamba chunk
boundaries get stored; later requests then hit less. A request's whole prefix is one pipelined
``EXISTS`` (on a local network one round trip of well under a millisecond): sent when its first
lookup comes in (:meth:`Tier.probe_batch <tieredkv.backends.base.Tier.probe_batch>`), answered
in that step when the server answers within the budget.

Bounds (what makes it safe to call from a scheduler thread):

* **Time.** Every socket call of a batch (the connect, when there is no connection yet, the
  send, each receive) gets what is left of the budget as its timeout; past the budget the batch
  answers None. The connection then still owes replies, so it is closed (a late reply is never
  read as a later batch's); the next batch connects again.
* **Failures pause it.** A batch not answered (over budget, refused, reset, an error reply, a
  reply ``EXISTS`` cannot get) pauses the path for 50 ms, doubling while failures go on, at most
  2 s: a dead or stalled server costs one budget per pause, not one per lookup, and a dead one
  fails at once (connection refused). Calls while paused answer None at once.
* **Memory.** A batch reads one line per command it sent (plus the connection's ``AUTH`` /
  ``SELECT`` replies on a new connection, sent in the same write): an integer ``:0`` / ``:1``,
  ``+OK``, or an error of at most 8 KiB. Anything else (another type, a longer line, bytes no
  command asked for) is a protocol error: the connection is closed.
* **One batch at a time.** A caller that finds another thread in the path gets None at once.

Counted on the tier (``tier.counters``, the tier's stats): ``bounded_lookups`` /
``bounded_lookup_keys`` / ``bounded_lookup_us`` (answered batches, their keys, their time in
microseconds), ``bounded_lookup_timeouts`` (over budget), ``bounded_lookup_errors`` (a failure
within budget: refused, reset, an error reply, a protocol error), ``bounded_lookup_skipped``
(paused or busy: not tried).

Where it runs: a single node over ``redis://`` or ``unix://`` (the host an IP literal, or a name
resolved when the tier opens), and a Redis Cluster, whose keys are grouped by the node owning
their slot in the cluster client's slot map (read, never changed, here): one connection per
node, every node's share sent before any reply is read, all within the one budget. A key whose
slot the map does not cover, a node named by a host name, or a ``-MOVED`` / ``-ASK`` /
``-TRYAGAIN`` reply (a slot moving) leaves the batch unanswered: the asynchronous lookup follows
redirections. TLS (``rediss://``) is not done here (the asynchronous path answers).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BoundedExists", "Where", "command", "literal_address"]

log = logging.getLogger(__name__)

#: Longest reply line a batch accepts (an error's message); a longer one is a protocol error.
_MAX_LINE = 1 << 13
#: First pause after a failed batch, and the most it grows to while failures go on (doubling).
PAUSE_FIRST_S = 0.05
PAUSE_MAX_S = 2.0

#: Where a node is: ``(family, address)`` for ``socket.socket(family)`` / ``connect(address)``.
Where = tuple[int, Any]


def literal_address(host: str, port: int) -> Where | None:
    """``(family, (host, port))`` when ``host`` is an IP literal (no resolver call), else None."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if ip.version == 6:
        return socket.AF_INET6, (str(ip), port)
    return socket.AF_INET, (str(ip), port)


def command(*args: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


class _Unanswered(Exception):
    """A batch not answered; ``kind`` is the counter it goes to (``timeouts`` or ``errors``)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _left(deadline: float) -> float:
    """What is left of the budget (seconds); raises once it is spent."""
    left = deadline - time.perf_counter()
    if left <= 0:
        raise _Unanswered("timeouts", "budget spent")
    return left


class _Node:
    """A blocking connection to one node, made by the first batch that needs it."""

    __slots__ = ("buf", "hello", "sock", "where")

    def __init__(self, where: Where, hello: bytes, greetings: int) -> None:
        self.where = where
        #: What a new connection sends before its first batch (``AUTH`` / ``SELECT``), and the
        #: number of ``+OK`` replies it gets for it.
        self.hello = (hello, greetings)
        self.sock: socket.socket | None = None
        self.buf = bytearray()

    def send(self, payload: bytes, deadline: float) -> int:
        """Send ``payload`` (connecting first, the hello in the same write); the number of hello
        replies that come before the payload's."""
        greet = 0
        if self.sock is None:
            family, addr = self.where
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(_left(deadline))
                sock.connect(addr)
                if family != getattr(socket, "AF_UNIX", None):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            self.buf = bytearray()
            hello, greet = self.hello
            payload = hello + payload
        self.sock.settimeout(_left(deadline))
        self.sock.sendall(payload)
        return greet

    def lines(self, n: int, deadline: float) -> list[bytes]:
        """The next ``n`` reply lines (without CRLF), within the budget."""
        sock, buf = self.sock, self.buf
        assert sock is not None
        out: list[bytes] = []
        start = 0
        while len(out) < n:
            j = buf.find(b"\r\n", start)
            if j < 0:
                if len(buf) - start > _MAX_LINE:
                    raise _Unanswered("errors", "a reply line longer than any EXISTS reply")
                sock.settimeout(_left(deadline))
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise _Unanswered("errors", "the server closed the connection")
                buf += chunk
                continue
            out.append(bytes(buf[start:j]))
            start = j + 2
        del buf[:start]
        if buf:
            raise _Unanswered("errors", "bytes no command asked for")
        return out

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self.buf = bytearray()
        if sock is not None:
            sock.close()


class BoundedExists:
    """Pipelined ``EXISTS`` batches answered within ``budget_s`` from the calling thread, or None.

    Args:
        budget_s: the most a batch may take, connect included.
        route: the node a Redis key is on (``(family, address)``), or None when this cannot tell
            it without waiting (the batch is then not answered).
        hello: the commands a new connection sends first (``AUTH``, ``SELECT``), each answered
            ``+OK``.
        count: the tier's counter (``count(name, n)``).
        name: the tier's name, for the log.
    """

    def __init__(
        self,
        *,
        budget_s: float,
        route: Callable[[bytes], Where | None],
        hello: Sequence[bytes] = (),
        count: Callable[[str, int], None],
        name: str,
    ) -> None:
        self.budget_s = budget_s
        self._route = route
        self._hello = (b"".join(hello), len(hello))
        self._count = count
        self.name = name
        self._nodes: dict[Where, _Node] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._paused_until = 0.0
        self._pause = PAUSE_FIRST_S
        #: Why the last batch was not answered (None after an answered one): for logs and tests.
        self.last_failure: str | None = None

    def exists(self, rkeys: Sequence[bytes]) -> list[bool] | None:
        """Whether each Redis key exists, or None: not answered within the budget (or the server
        failed, or a key's node is not known here, or the path is paused or busy)."""
        if not rkeys:
            return []
        t0 = time.perf_counter()
        if t0 < self._paused_until or self._closed or not self._lock.acquire(blocking=False):
            self._count("bounded_lookup_skipped", 1)
            return None
        try:
            if self._closed:
                return None
            return self._exists(rkeys, t0)
        finally:
            self._lock.release()

    def _exists(self, rkeys: Sequence[bytes], t0: float) -> list[bool] | None:
        deadline = t0 + self.budget_s
        groups: dict[Where, list[int]] = {}
        route = self._route
        try:
            for i, rk in enumerate(rkeys):
                where = route(rk)
                if where is None:
                    raise _Unanswered("errors", "a key's node is not known without waiting")
                idx = groups.get(where)
                if idx is None:
                    idx = groups[where] = []
                idx.append(i)
            sent: list[tuple[_Node, list[int], int]] = []
            for where, idx in groups.items():
                node = self._nodes.get(where)
                if node is None:
                    node = self._nodes[where] = _Node(where, *self._hello)
                payload = b"".join([b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(rkeys[i]), rkeys[i]) for i in idx])
                sent.append((node, idx, node.send(payload, deadline)))
            out = [False] * len(rkeys)
            refused: bytes | None = None
            for node, idx, greet in sent:
                lines = node.lines(greet + len(idx), deadline)
                for line in lines[:greet]:
                    if line != b"+OK":  # AUTH / SELECT refused: this connection is no good
                        node.close()
                        refused = refused or line
                for i, line in zip(idx, lines[greet:]):
                    if line == b":1":
                        out[i] = True
                    elif line != b":0":
                        if line[:1] != b"-":
                            raise _Unanswered("errors", f"a reply EXISTS cannot get: {line[:40]!r}")
                        refused = refused or line
            if refused is not None:
                raise _Unanswered("errors", f"refused: {refused[:200].decode('utf-8', 'replace')}")
        except _Unanswered as e:
            self._failed(e.kind, str(e), close=not str(e).startswith("refused"))
            return None
        except TimeoutError as e:
            self._failed("timeouts", f"budget spent ({e})", close=True)
            return None
        except OSError as e:
            self._failed("errors", f"{type(e).__name__}: {e}", close=True)
            return None
        us = int((time.perf_counter() - t0) * 1e6)
        self._pause = PAUSE_FIRST_S
        if self.last_failure is not None:
            log.info("tier %s: lookups answered in the step again", self.name)
            self.last_failure = None
        self._count("bounded_lookups", 1)
        self._count("bounded_lookup_keys", len(rkeys))
        self._count("bounded_lookup_us", us)
        return out

    def _failed(self, kind: str, detail: str, *, close: bool) -> None:
        if close:
            for node in self._nodes.values():
                node.close()
        first = self.last_failure is None
        self.last_failure = f"{kind}: {detail}"
        self._count(f"bounded_lookup_{kind}", 1)
        self._paused_until = time.perf_counter() + self._pause
        (log.info if first else log.debug)(
            "tier %s: a lookup batch not answered within %.3g ms (%s); asked asynchronously, in-step"
            " lookups paused for %.3g s",
            self.name,
            self.budget_s * 1e3,
            detail,
            self._pause,
        )
        self._pause = min(self._pause * 2, PAUSE_MAX_S)

    def close(self) -> None:
        """Close every connection (waits at most one batch's budget for a caller in the path)."""
        self._closed = True
        with self._lock:
            for node in self._nodes.values():
                node.close()
            self._nodes.clear()

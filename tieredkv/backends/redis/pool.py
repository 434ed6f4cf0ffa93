"""The Redis tier's own connections to one node (``native_io``): :class:`RespPool`, and
:func:`native_target`, where a URL points. Each connection speaks the bounded protocol of
:mod:`~tieredkv.backends.redis.resp`.

A connection is made with its ``AUTH`` / ``SELECT`` and a ``PING`` (a round trip before any data
goes out), runs one batch at a time, and goes back to the pool unless it broke. A batch split over
several connections (:meth:`RespPool.execute_split`) fails as a whole: the other connections'
batches are stopped and their placed replies zeroed. A batch that fails on a pooled connection
because the connection was lost (e.g. the server restarted) is retried once on a new connection
(every command the data path sends is idempotent); a protocol error is not retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tieredkv.backends.redis.resp import Into, RespProtocolError, _Protocol, _scrub

__all__ = ["RespPool", "native_target"]


def native_target(url: str) -> dict[str, Any] | None:
    """Where a ``redis://`` or ``unix://`` URL points (host/port or path, db, credentials);
    ``None`` for ``rediss://`` (TLS stays on redis-py)."""
    parts = urlsplit(url)
    if parts.scheme == "redis":
        db = (parts.path or "/0").lstrip("/") or "0"
        where: dict[str, Any] = {"host": parts.hostname or "127.0.0.1", "port": parts.port or 6379}
    elif parts.scheme == "unix":
        where = {"path": unquote(parts.path)}
        db = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p).get("db", "0")
    else:
        return None
    where["db"] = int(db)
    where["username"] = unquote(parts.username) if parts.username else None
    where["password"] = unquote(parts.password) if parts.password else None
    return where


class RespPool:
    """Up to ``size`` connections to one node; :meth:`execute` runs a batch on one of them."""

    def __init__(
        self,
        target: dict[str, Any],
        *,
        size: int,
        socket_timeout: float | None,
        connect_timeout: float | None,
    ) -> None:
        self.target = target
        self.size = size
        self.socket_timeout = socket_timeout
        self.connect_timeout = connect_timeout
        self._idle: list[_Protocol] = []
        self._sem = asyncio.Semaphore(size)
        self._closed = False

    async def _connect(self) -> _Protocol:
        t = self.target
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                if "path" in t:
                    _, proto = await loop.create_unix_connection(_Protocol, t["path"])
                else:
                    _, proto = await loop.create_connection(_Protocol, t["host"], t["port"])
        except TimeoutError:
            raise RedisTimeoutError("Timeout connecting to the server") from None
        except OSError as e:
            where = t.get("path") or f"{t['host']}:{t['port']}"
            raise RedisConnectionError(f"Error connecting to {where}: {e}") from e
        hello: list[list[Any]] = []
        if t["password"] is not None:
            hello.append(["AUTH", t["username"], t["password"]] if t["username"] else ["AUTH", t["password"]])
        if t["db"]:
            hello.append(["SELECT", t["db"]])
        # A round trip before any data goes out: a server that accepts connections but does not
        # answer (stopped, overloaded) fails here, and no write is left queued to land later.
        hello.append(["PING"])
        if hello:
            try:
                replies = await proto.execute(hello, [None] * len(hello), self.socket_timeout)
            except BaseException:
                proto.close()
                raise
            for r in replies:
                if isinstance(r, BaseException):
                    proto.close()
                    raise r
        return proto

    async def execute(self, commands: Sequence[Sequence[Any]], intos: Sequence[Into | None] | None = None) -> list[Any]:
        """Replies of ``commands`` (sent on one connection), error replies in place. On a failure
        every destination the batch placed bytes into is zeroed (see :meth:`_Protocol.execute`)."""
        if self._closed:
            raise RedisConnectionError("the tier's connections are closed")
        expect = list(intos) if intos is not None else [None] * len(commands)
        async with self._sem:
            conn = None
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.broken is not None:  # lost its peer while idle
                    conn = None
            pooled = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                replies = await conn.execute(commands, expect, self.socket_timeout)
            except RespProtocolError:
                conn.close()
                raise
            except RedisConnectionError:
                conn.close()
                if not pooled:
                    raise
                conn = await self._connect()  # the server may have restarted under a pooled connection
                try:
                    replies = await conn.execute(commands, expect, self.socket_timeout)
                except BaseException:
                    conn.close()
                    raise
            except BaseException:
                conn.close()
                raise
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)
            return replies

    async def execute_split(
        self, batches: Sequence[tuple[Sequence[Sequence[Any]], Sequence[Into | None]]]
    ) -> list[list[Any]]:
        """:meth:`execute` of each ``(commands, intos)`` at once (on as many connections); the
        replies of each, or — when one fails, or this call is cancelled — the failure, raised
        only once every other batch has stopped (cancelled: its connection is closed) and the
        replies the finished ones placed are zeroed, so that nothing stays in, nor lands later
        in, a destination of the failed whole."""
        tasks = [asyncio.ensure_future(self.execute(c, i)) for c, i in batches]
        ok = False
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            results = [t.result() for t in tasks]
            ok = True
            return results
        finally:
            if not ok:
                for t in tasks:
                    t.cancel()
                again = False
                while not all(t.done() for t in tasks):  # each stops at once: its connection closes
                    try:
                        await asyncio.wait(tasks)
                    except asyncio.CancelledError:
                        again = True
                for (_, intos), t in zip(batches, tasks, strict=True):
                    if not t.cancelled() and t.exception() is None:
                        _scrub(intos, t.result())
                if again:
                    raise asyncio.CancelledError

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        await asyncio.sleep(0)  # let the transports finish closing

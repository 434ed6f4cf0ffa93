"""The Redis tier's data path on its own connections (``native_io``): the glue between the tier's
batches and :class:`~tieredkv.backends.redis.resp.RespPool`.

A batch is built by an ``add(pipe, i)`` callback that queues the commands of key ``i`` with the
method names of a redis-py pipeline (``set``, ``getrange``, ``exists``), so one callback serves
both client paths: :class:`_NativePipe` collects them (a record's header and payload as separate
parts of one bulk string, a ``GETRANGE`` with a destination to receive it into), and
:func:`native_run` splits them in order over the pool's connections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tieredkv.backends.redis.pool import RespPool
from tieredkv.backends.redis.resp import Into

__all__ = ["_NativePipe", "native_run"]


class _NativePipe:
    """Collects data-path commands for :class:`~tieredkv.backends.redis.resp.RespPool` with the method
    names of a redis-py pipeline (so one ``add`` serves both)."""

    __slots__ = ("commands", "intos")

    def __init__(self) -> None:
        self.commands: list[list[Any]] = []
        self.intos: list[Into | None] = []

    def _add(self, cmd: list[Any], into: Into | None = None) -> None:
        self.commands.append(cmd)
        self.intos.append(into)

    def set(self, name: bytes, value: Any, ex: int | None = None) -> None:
        self._add(["SET", name, value] if ex is None else ["SET", name, value, "EX", ex])

    def getrange(self, name: bytes, start: int, end: int, into: Into | None = None) -> None:
        self._add(["GETRANGE", name, start, end], into)

    def exists(self, name: bytes) -> None:
        self._add(["EXISTS", name])


async def native_run(pool: RespPool, idx: list[int], add: Callable[[Any, int], Any]) -> list[Any]:
    """The commands ``add`` queues for ``idx``, split in order over the pool's connections
    (run concurrently); replies in order. One slice failing fails the batch (as a node would):
    the others are stopped and what any of them placed in a destination is zeroed."""
    k = max(1, min(pool.size, len(idx)))
    step = -(-len(idx) // k)
    pipes = []
    for a in range(0, len(idx), step):
        pipe = _NativePipe()
        for i in idx[a : a + step]:
            add(pipe, i)
        pipes.append(pipe)
    if len(pipes) == 1:
        return await pool.execute(pipes[0].commands, pipes[0].intos)
    parts = await pool.execute_split([(p.commands, p.intos) for p in pipes])
    return [r for part in parts for r in part]

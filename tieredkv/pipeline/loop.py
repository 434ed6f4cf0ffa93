"""The loop bridge: an asyncio event loop on its own thread, driven from the engine's threads.

Everything that touches a tier runs on this loop; engine threads hand it coroutines with
:meth:`LoopThread.run` (block for the result), :meth:`LoopThread.submit` (a
``concurrent.futures.Future`` at once) or :meth:`LoopThread.spawn` (fire and forget; the task
is cancelled at :meth:`LoopThread.cancel_tasks`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tieredkv.errors import TierClosedError

__all__ = ["LoopThread", "new_loop"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """One event loop running forever on a daemon thread until :meth:`stop`."""

    def __init__(self, *, use_uvloop: bool = False, name: str = "tieredkv-pipeline") -> None:
        self.use_uvloop = use_uvloop
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def running(self) -> bool:
        return self.loop is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        loop = new_loop(self.use_uvloop)
        self.loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, join_s: float = 10.0) -> None:
        """Stop the loop and join its thread, waiting at most ``join_s`` (tasks should be
        cancelled first; a thread still busy then is a daemon, left to finish on its own)."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=join_s)
        if not thread.is_alive():
            loop.close()
        self.loop = None
        self._thread = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result (raises what it raises, or
        ``TimeoutError`` after ``timeout`` seconds)."""
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; its future at once (never blocks)."""
        loop = self.loop
        if loop is None:
            coro.close()
            raise TierClosedError("pipeline is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` as a task on the loop, kept until it ends or :meth:`cancel_tasks`."""

        def start() -> None:
            task = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            self.call_soon(start)
        except TierClosedError:
            coro.close()
            raise

    def call_soon(self, fn: Callable[[], Any]) -> None:
        loop = self.loop
        if loop is None:
            raise TierClosedError("pipeline is not running")
        loop.call_soon_threadsafe(fn)

    def tasks(self) -> list[asyncio.Task[Any]]:
        """Tasks started by :meth:`spawn` still running (loop thread)."""
        return list(self._tasks)


def new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()

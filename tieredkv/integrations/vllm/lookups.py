"""Non-blocking, batched existence checks against tieredkv's tiers for vLLM's scheduler thread.

vLLM asks one key at a time and must never wait on I/O. :class:`AsyncLookups` answers from
what it already knows; an unknown key is queued (the caller answers RETRY), the queue goes out
as one ``Pipeline.lookup_future`` at the end of the scheduler step, and the answer is there for
the next step. An answer is used for the rest of the step it was first read in, then dropped,
so a later lookup asks the tiers again (nothing stale is kept across steps).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

__all__ = ["AsyncLookups"]

log = logging.getLogger(__name__)


class AsyncLookups:
    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        self._queued: dict[bytes, None] = {}
        self._inflight: dict[bytes, Future[Any]] = {}
        self._futures: list[tuple[Future[Any], list[bytes]]] = []
        self._answers: dict[bytes, str] = {}
        self._used: set[bytes] = set()
        self.queries = 0

    def answer(self, key: bytes) -> str | None:
        """``"hit"`` / ``"pending"`` / ``"miss"`` when known, else None (queued; ask again next step)."""
        self._poll()
        state = self._answers.get(key)
        if state is not None:
            self._used.add(key)
            return state
        if key not in self._inflight:
            self._queued[key] = None
        return None

    def flush(self) -> None:
        """Send the queued keys as one batched lookup (returns at once)."""
        if not self._queued:
            return
        keys = list(self._queued)
        self._queued.clear()
        try:
            fut = self._pipeline.lookup_future(keys)
        except Exception as e:  # noqa: BLE001 - a closed pipeline answers miss, never raises into vLLM
            log.warning("tieredkv lookup of %d keys not sent: %s", len(keys), e)
            for k in keys:
                self._answers[k] = "miss"
            return
        self.queries += 1
        self._futures.append((fut, keys))
        for k in keys:
            self._inflight[k] = fut

    def end_step(self) -> None:
        """Drop the answers read during this step."""
        for k in self._used:
            self._answers.pop(k, None)
        self._used.clear()

    def forget(self, keys: Any) -> None:
        for k in keys:
            self._answers.pop(k, None)

    def busy(self) -> bool:
        return bool(self._queued or self._futures)

    def clear(self) -> None:
        self._queued.clear()
        self._answers.clear()
        self._used.clear()
        for fut, _ in self._futures:
            fut.cancel()
        self._futures.clear()
        self._inflight.clear()

    def _poll(self) -> None:
        if not self._futures:
            return
        still = []
        for fut, keys in self._futures:
            if not fut.done():
                still.append((fut, keys))
                continue
            try:
                states = [s.value for s, _ in fut.result()]
            except Exception as e:  # noqa: BLE001
                log.warning("tieredkv lookup of %d keys failed (misses): %s", len(keys), e)
                states = ["miss"] * len(keys)
            for k, s in zip(keys, states):
                if self._inflight.get(k) is fut:
                    del self._inflight[k]
                self._answers[k] = s
        self._futures = still

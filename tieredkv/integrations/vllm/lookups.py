"""Non-blocking, batched existence checks against tieredkv's tiers for vLLM's scheduler thread.

vLLM asks one key at a time and must never wait on I/O. :class:`AsyncLookups` answers from
what it already knows; an unknown key is queued (the caller answers RETRY), the queue goes out
as one ``Pipeline.lookup_future`` at the end of the scheduler step, and the answer is there for
a later step.

An answer is kept while it is being asked for: vLLM defers a request whose lookup met a RETRY
and asks every key of it again on a later step, so an answer read in step *s* stays for step
*s + 1*; one not asked for during a whole step is dropped at that step's end (so nothing stale
lives on: a later lookup asks the tiers again). Dropping answers as soon as they are read makes
the answered and the queued keys of a long prefix swap places every step and the request wait
for thousands of steps.
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
        self._fresh: set[bytes] = set()  # answered since the last end_step, or read during this step
        self.queries = 0
        self.keys_sent = 0

    def answer(self, key: bytes) -> str | None:
        """``"hit"`` / ``"pending"`` / ``"miss"`` when known, else None (queued; ask again next step)."""
        self._poll()
        state = self._answers.get(key)
        if state is not None:
            self._fresh.add(key)
            return state
        if key not in self._inflight:
            self._queued[key] = None
        return None

    def prefetch(self, key: bytes) -> None:
        """Queue ``key`` for the next batch unless it is known or on its way (a likely next question)."""
        if key not in self._answers and key not in self._inflight:
            self._queued[key] = None

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
                self._fresh.add(k)
            return
        self.queries += 1
        self.keys_sent += len(keys)
        self._futures.append((fut, keys))
        for k in keys:
            self._inflight[k] = fut

    def end_step(self) -> None:
        """Drop the answers nobody asked for during this step (answers that arrived meanwhile stay)."""
        self._poll()
        if len(self._fresh) < len(self._answers):
            self._answers = {k: v for k, v in self._answers.items() if k in self._fresh}
        self._fresh.clear()

    def forget(self, keys: Any) -> None:
        for k in keys:
            self._answers.pop(k, None)

    def has_unsent(self) -> bool:
        """Keys queued but not yet sent: the next step's ``on_schedule_end`` must run to send them."""
        return bool(self._queued)

    def busy(self) -> bool:
        """Lookups queued or still on their way (resolved answers waiting to be read are not work)."""
        self._poll()
        return bool(self._queued or self._futures)

    def clear(self) -> None:
        self._queued.clear()
        self._answers.clear()
        self._fresh.clear()
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
                self._fresh.add(k)
        self._futures = still

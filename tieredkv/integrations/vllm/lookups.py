"""Non-blocking, batched existence checks against tieredkv's tiers for vLLM's scheduler thread.

vLLM asks one key at a time and must never wait on I/O. :class:`AsyncLookups` answers from
what it already knows; an unknown key is queued (the caller answers RETRY), the queue goes out
as one ``TieredStore.lookup_async`` at the end of the scheduler step, and the answer is there for
a later step.

An answer is kept until it is asked for again: vLLM defers a request whose lookup met a RETRY
and asks every key of it again when the scheduler next reaches it (the next step, or later when
the batch is full), so an answer stays until ``ttl_steps`` steps pass without anyone asking for it
(then a later lookup asks the tiers again: nothing stale lives on for long). Dropping answers as
soon as they are read makes the answered and the queued keys of a long prefix swap places every
step and the request wait for thousands of steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

__all__ = ["AsyncLookups"]

log = logging.getLogger(__name__)


#: Sends a batch of keys; a future of ``[(KeyState, tier), ...]`` (``TieredStore.lookup_async``).
LookupAsync = Callable[[list[bytes]], "Future[Any]"]


class AsyncLookups:
    def __init__(self, lookup_async: LookupAsync, *, ttl_steps: int = 32, max_answers: int = 1 << 16) -> None:
        self._lookup_async = lookup_async
        self.ttl_steps = ttl_steps
        self.max_answers = max_answers
        self._step = 0
        self._last_asked: dict[bytes, int] = {}
        self._queued: dict[bytes, None] = {}
        self._inflight: dict[bytes, Future[Any]] = {}
        self._futures: list[tuple[Future[Any], list[bytes]]] = []
        self._answers: dict[bytes, str] = {}
        self.queries = 0
        self.keys_sent = 0

    def answer(self, key: bytes) -> str | None:
        """``"hit"`` / ``"pending"`` / ``"miss"`` when known, else None (queued; ask again next step).

        Callers ask ``TieredStore.probe`` first (``store.probe(key) or lookups.answer(key)``): a
        store in flight is pending, then each tier of the key's route that can tell without
        waiting answers at once; its answer is the freshest and is not kept here."""
        if self._futures:
            self._poll()
        state = self._answers.get(key)
        if state is not None:
            if state == "pending":
                # A store was in flight when the tiers were asked: read once, then asked again.
                # Kept, it would outlive that store (its complete_store may have forgotten the
                # key before this answer arrived) and, refreshed by every ask, keep the request
                # waiting for ever.
                del self._answers[key]
                self._last_asked.pop(key, None)
                return state
            self._touch(key)
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
            fut = self._lookup_async(keys)
        except Exception as e:  # noqa: BLE001 - a closed pipeline answers miss, never raises into vLLM
            log.warning("tieredkv lookup of %d keys not sent: %s", len(keys), e)
            for k in keys:
                self._answers[k] = "miss"
                self._touch(k)
            return
        self.queries += 1
        self.keys_sent += len(keys)
        self._futures.append((fut, keys))
        for k in keys:
            self._inflight[k] = fut

    def end_step(self) -> None:
        """Drop the answers nobody asked for during the last ``ttl_steps`` steps (and the oldest
        beyond ``max_answers``)."""
        self._poll()
        self._step += 1
        oldest = self._step - self.ttl_steps
        last = self._last_asked  # least recently asked first
        while last:
            k, t = next(iter(last.items()))
            if t >= oldest and len(last) <= self.max_answers:
                break
            del last[k]
            self._answers.pop(k, None)

    def _touch(self, key: bytes) -> None:
        self._last_asked.pop(key, None)
        self._last_asked[key] = self._step

    def forget(self, keys: Any) -> None:
        """Drop what is known of ``keys`` (their store completed): kept answers, and the answers
        of lookups still on their way, which were asked before and are discarded on arrival."""
        for k in keys:
            self._answers.pop(k, None)
            self._last_asked.pop(k, None)
            self._inflight.pop(k, None)

    def has_unsent(self) -> bool:
        """Keys queued but not yet sent: the next step's ``on_schedule_end`` must run to send them."""
        return bool(self._queued)

    def busy(self) -> bool:
        """Lookups queued or still on their way (resolved answers waiting to be read are not work)."""
        self._poll()
        return bool(self._queued or self._futures)

    def wait(self, timeout: float | None = 10.0) -> bool:
        """Block until every lookup sent has resolved (tests and orderly shutdown only; the
        scheduler thread never calls this)."""
        futs = [f for f, _ in self._futures]
        if futs:
            _, not_done = wait_futures(futs, timeout=timeout)
            if not_done:
                return False
        self._poll()
        return True

    def clear(self) -> None:
        self._queued.clear()
        self._answers.clear()
        self._last_asked.clear()
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
                if self._inflight.get(k) is not fut:
                    continue  # forgotten (or asked again) since it was sent: stale
                del self._inflight[k]
                self._answers[k] = s
                self._touch(k)  # arrived now: counts as asked this step
        self._futures = still

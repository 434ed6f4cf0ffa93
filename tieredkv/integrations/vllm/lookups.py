"""Non-blocking, batched existence checks against tieredkv's tiers for vLLM's scheduler thread.

vLLM asks one key at a time and must never wait on I/O. :class:`AsyncLookups` answers from
what it already knows; an unknown key is queued (the caller answers RETRY), the queue goes out
as one ``TieredStore.lookup_async`` at the end of the scheduler step, and the answer is there for
a later step.

**In the step.** Given ``probe_now`` (``TieredStore.probe_many``) and ``request_keys``, the first
unknown key a request asks about sends every key of that request not known yet at once (its
whole prefix, every group: vLLM records them on the request's ``ReqContext`` before it asks the
first, :func:`request_offload_keys`) as one batch that a tier may answer within a bound of its
own (Redis: one pipelined ``EXISTS`` within ``lookup_budget_ms``). What it answers is kept like
an asynchronous answer and the key is answered in the step it was asked; what it leaves
unanswered (over budget, a server failing, a breaker open) goes the asynchronous way as before.
Once per request per step: a request whose batch went unanswered is not asked again in that step.

An answer is kept until it is asked for again: vLLM defers a request whose lookup met a RETRY
and asks every key of it again when the scheduler next reaches it (the next step, or later when
the batch is full), so an answer stays until ``ttl_steps`` steps pass without anyone asking for it
(then a later lookup asks the tiers again: nothing stale lives on for long). Dropping answers as
soon as they are read makes the answered and the queued keys of a long prefix swap places every
step and the request wait for thousands of steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

__all__ = ["AsyncLookups", "request_offload_keys"]

log = logging.getLogger(__name__)


#: Sends a batch of keys; a future of ``[(KeyState, tier), ...]`` (``TieredStore.lookup_async``).
LookupAsync = Callable[[list[bytes]], "Future[Any]"]
#: Answers a batch in the calling thread where it can within bounded time: per key a ``KeyState``
#: (its ``value``: ``"hit"`` / ``"miss"`` / ``"pending"``) or None (``TieredStore.probe_many``).
ProbeNow = Callable[[Sequence[bytes]], Sequence[Any]]
#: The stored keys a request's lookups may ask, from its ``ReqContext`` (the caller maps vLLM's
#: keys to its stored keys and their partial-record candidates); a sized collection.
RequestKeys = Callable[[Any], Sequence[bytes]]


def request_offload_keys(req_context: Any) -> Iterable[bytes]:
    """Every offload key vLLM has recorded for a request (all its groups, in the order recorded):
    vLLM 0.33's scheduler records each key's end position on the request's ``ReqContext``
    (``set_offload_key_position``, into the private ``_offload_key_positions``, listed in
    :mod:`~tieredkv.integrations.vllm.compat`) before it asks the manager about the first, so they
    are the keys the step's lookups of this request may ask. Empty when the context has none
    (another vLLM, a stand-in): the lookups then go the asynchronous way."""
    positions = getattr(req_context, "_offload_key_positions", None)
    return positions if isinstance(positions, dict) else ()


class AsyncLookups:
    """Answers from what is known; unknown keys asked in the step (``probe_now``) or queued."""

    def __init__(
        self,
        lookup_async: LookupAsync,
        *,
        probe_now: ProbeNow | None = None,
        request_keys: RequestKeys | None = None,
        ttl_steps: int = 32,
        max_answers: int = 1 << 16,
        max_batch_keys: int = 4096,
    ) -> None:
        self._lookup_async = lookup_async
        self._probe_now = probe_now if request_keys is not None else None
        self._request_keys = request_keys
        self.ttl_steps = ttl_steps
        self.max_answers = max_answers
        #: Most keys one request's in-step batch asks (its prefix first); the rest go asynchronously.
        self.max_batch_keys = max_batch_keys
        self._step = 0
        self._last_asked: dict[bytes, int] = {}
        self._queued: dict[bytes, None] = {}
        self._inflight: dict[bytes, Future[Any]] = {}
        self._futures: list[tuple[Future[Any], list[bytes]]] = []
        self._answers: dict[bytes, str] = {}
        self._batched: set[Any] = set()  # requests whose in-step batch went out this step
        self.queries = 0
        self.keys_sent = 0
        #: In-step batches sent, their keys, the keys they answered, the batches that answered none.
        self.step_batches = 0
        self.step_batch_keys = 0
        self.step_answered = 0
        self.step_unanswered = 0

    def answer(self, key: bytes, req_context: Any = None) -> str | None:
        """``"hit"`` / ``"pending"`` / ``"miss"`` when known, else None (queued; ask again next step).

        Callers ask ``TieredStore.probe`` first (``store.probe(key) or lookups.answer(key)``): a
        store in flight is pending, then each tier of the key's route that can tell without
        waiting answers at once; its answer is the freshest and is not kept here.

        With ``req_context`` (the request asking) and ``probe_now``, an unknown key first sends the
        request's in-step batch (see the module docstring), once per request per step."""
        if self._futures:
            self._poll()
        state = self._answers.get(key)
        if state is None and req_context is not None and self._probe_now is not None and key not in self._inflight:
            self._ask_now(key, req_context)
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

    def _ask_now(self, key: bytes, req_context: Any) -> None:
        """The request's in-step batch: ``key`` and every key of the request not known and not on
        its way, answered where ``probe_now`` can; answers kept as the asynchronous ones are."""
        rid = getattr(req_context, "req_id", None)
        if rid is None or rid in self._batched:
            return
        self._batched.add(rid)
        assert self._probe_now is not None and self._request_keys is not None
        answers, inflight = self._answers, self._inflight
        keys = {key: None}
        try:
            recorded = self._request_keys(req_context)
            if not recorded:
                return  # vLLM recorded no keys on it (a stand-in context): the asynchronous way
            for k in recorded:
                if k not in answers and k not in inflight:
                    keys[k] = None
                    if len(keys) >= self.max_batch_keys:
                        break
            batch = list(keys)
            states = self._probe_now(batch)
        except Exception as e:  # noqa: BLE001 - a closed store: the asynchronous path answers
            log.warning("tieredkv in-step lookup of %d keys failed: %s", len(keys), e)
            return
        self.step_batches += 1
        self.step_batch_keys += len(batch)
        n = 0
        for k, st in zip(batch, states):
            if st is None:
                continue
            value = st.value
            if value == "pending":
                continue  # the store's probe says so while it lasts (never kept: see answer)
            answers[k] = value
            self._queued.pop(k, None)
            self._touch(k)
            n += 1
        self.step_answered += n
        if not n:
            self.step_unanswered += 1

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
        self._batched.clear()
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
        self._batched.clear()
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

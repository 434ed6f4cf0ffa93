"""KV events from tieredkv's tiers: vLLM ``OffloadingEvent``s for what each tier came to hold and
stopped holding, returned by the manager's (:class:`~tieredkv.integrations.vllm.manager.
TieredKVManager`) and the secondary tier's (:class:`~tieredkv.integrations.vllm.secondary.
TieredKVSecondaryTier`) ``take_events``. vLLM's ``OffloadingConnector`` (or ``TieredKVConnector``)
turns them into ``BlockStored`` / ``BlockRemoved`` for its KV events publisher, as it does for
its own CPU tier's events. Only while vLLM's KV cache events are on
(``--kv-events-config '{"enable_kv_cache_events": true, ...}'``): otherwise nothing is recorded
and ``take_events`` returns nothing.

What they come from: the store's tier events (:mod:`tieredkv.pipeline.events`) — a batch a
tier's writer stored (a store, a write-back one tier down, a promotion up), the slots a store
published in the CPU tier, and what a tier reported removed by itself (its eviction policy,
its server's evictions and expiries, a corrupt record dropped).

Each event is one tier's run of keys, in the order it happened:

* ``keys``: vLLM's offload keys (block hash + 4-byte group), the namespace fingerprint taken
  off; a partial record (a sliding-window / Mamba chunk whose leading sub-blocks were not
  written) is announced under its chunk's key, and the removal of one of a chunk's records is
  announced only when the tier holds none of them any more (its probe says so; a tier that
  cannot tell at once, Redis, announces it). Keys of another namespace or cache generation are
  not announced (they can never be hit by this engine).
* ``medium`` / ``locality`` from the tier's ``TierCapabilities.medium``: ``host`` (the CPU slab)
  → ``CPU``; ``disk`` (LMDB, the shared-filesystem tier) → ``STORAGE``; ``remote`` (Redis) →
  ``STORAGE`` with locality ``REMOTE``; a tier that does not say → ``STORAGE``.
* ``ownership``: ``"tieredkv:<tier name>"``, so two tiers of one medium are told apart — except,
  under the whole spec, a ``host`` tier, which plays vLLM's CPU primary tier (``None``, as
  vLLM's own CPU manager).
* ``removal_expected``: True for every tier that is not that primary (its removals are
  published, as vLLM's KVCR tier does), so vLLM's self-describing events keep a chunk's payload
  until its removal.

When: a stored event once the tier holds the records and vLLM has completed the store
(``complete_store`` / the job reported finished): a tier write of a key vLLM still counts in
flight is held back until it is not (a removal of it meanwhile cancels it) — the same moment
vLLM's CPU manager announces its stores. A write-back or a promotion, which vLLM never sees, is
announced when it is written. A removed event when the tier reports it (see each tier's
:meth:`~tieredkv.backends.base.Tier.set_removal_listener`).
"""

from __future__ import annotations

from collections.abc import Collection, Container
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, PARTIAL_MARK, partial_chunk_key
from tieredkv.pipeline.events import TierEvent
from tieredkv.store import TieredStore

__all__ = ["KVEvents", "tier_event_fields"]

_MEDIA: dict[str, tuple[Medium, Locality | None]] = {
    "host": (Medium.CPU, None),
    "disk": (Medium.STORAGE, None),
    "remote": (Medium.STORAGE, Locality.REMOTE),
}
_PARTIAL = 3  # a partial chunk key's extra bytes: PARTIAL_MARK + valid_from
_MARK_AT = slice(-GROUP_BYTES - _PARTIAL, -GROUP_BYTES - 1)  # where a partial key has its mark


def tier_event_fields(medium: str, name: str, *, primary: bool) -> dict[str, Any]:
    """The ``OffloadingEvent`` fields of a tier of ``medium`` named ``name`` (``primary``: the
    whole spec, where a host tier is vLLM's primary CPU tier)."""
    m, locality = _MEDIA.get(medium, (Medium.STORAGE, None))
    if primary and m is Medium.CPU:
        return {"medium": m, "locality": locality, "ownership": None, "removal_expected": False}
    return {"medium": m, "locality": locality, "ownership": f"tieredkv:{name}", "removal_expected": True}


class KVEvents:
    """A store's tier events as vLLM ``OffloadingEvent``s (see the module docstring).

    ``writing``: the stored keys whose store vLLM has not completed (the integration's own
    bookkeeping, read on the scheduler thread); their stored events wait. Call
    :meth:`take` from the scheduler thread with the current namespace fingerprint."""

    def __init__(
        self,
        store: TieredStore,
        writing: Container[bytes],
        *,
        primary: bool,
        partial_groups: Collection[bytes] = (),
        blocks_per_chunk: int = 1,
    ) -> None:
        self.store = store
        self.writing = writing
        #: Group suffixes whose chunks may also be held as partial records (several per key).
        self._partial_groups = frozenset(partial_groups)
        self._bpc = blocks_per_chunk
        self._tiers = {t.name: t for t in store.tiers}
        self._fields = {
            t.name: tier_event_fields(store.tier_medium(t.name), t.name, primary=primary) for t in store.tiers
        }
        #: (tier, stored key) of writes held back, oldest first.
        self._held: dict[tuple[str, bytes], None] = {}
        #: The length of vLLM's offload keys (block hash + group): the integration sets it from
        #: the first key it is given; 0 until then (a partial record is then told by its mark).
        self.key_len = 0
        self.counters = {"stored_keys": 0, "removed_keys": 0, "held_keys": 0, "foreign_keys": 0}
        store.record_tier_events()

    def take(self, fingerprint: bytes) -> list[OffloadingEvent]:
        """The events since the last call, oldest first."""
        entries = self.store.take_tier_events()
        if self._held:
            entries = self._release() + entries
        if not entries:
            return []
        runs: list[tuple[str, bool, list[bytes]]] = []
        writing, held = self.writing, self._held
        for tier, removed, keys in entries:
            if removed:
                if held:
                    for k in keys:
                        held.pop((tier, k), None)  # never announced: nothing to take back but this
            elif writing:
                late = [k for k in keys if self._whole(k) in writing]
                if late:
                    held.update(dict.fromkeys((tier, k) for k in late))
                    self.counters["held_keys"] += len(late)
                    late_set = set(late)
                    keys = [k for k in keys if k not in late_set]
            if not keys:
                continue
            if runs and runs[-1][0] == tier and runs[-1][1] is removed:
                runs[-1][2].extend(keys)
            else:
                runs.append((tier, removed, list(keys)))
        out = []
        for tier, removed, keys in runs:
            vkeys = self._offload_keys(keys, fingerprint)
            if removed and vkeys and self._partial_groups:
                vkeys = self._not_held(tier, vkeys, fingerprint)
            if vkeys:
                self.counters["removed_keys" if removed else "stored_keys"] += len(vkeys)
                out.append(OffloadingEvent(keys=vkeys, removed=removed, **self._fields[tier]))
        return out

    def _release(self) -> list[TierEvent]:
        """The held writes vLLM has completed since, as stored entries (per tier, in order)."""
        writing = self.writing
        done = [tk for tk in self._held if self._whole(tk[1]) not in writing]
        out: list[TierEvent] = []
        for tier, key in done:
            del self._held[(tier, key)]
            if out and out[-1].tier == tier:
                out[-1].keys.append(key)
            else:
                out.append(TierEvent(tier, False, [key]))
        return out

    def _not_held(self, tier: str, vkeys: list[OffloadKey], fp: bytes) -> list[OffloadKey]:
        """``vkeys`` less those of a group with partial records that tier ``tier`` still holds
        under another record (the whole chunk, or a partial one: a lookup still finds the chunk);
        asked of the tier's probe, and removed as reported where it cannot tell."""
        out: list[OffloadKey] = []
        probe = self._tiers[tier].probe
        for k in vkeys:
            if k[-GROUP_BYTES:] not in self._partial_groups:
                out.append(k)
                continue
            held = probe([fp + k] + [fp + partial_chunk_key(k, v) for v in range(1, self._bpc)])
            if not held or not any(held):
                out.append(k)
        return out

    def _whole(self, skey: bytes) -> bytes:
        """The whole chunk's stored key of ``skey`` (itself, unless a partial record's)."""
        n = self.key_len
        if n:
            partial = len(skey) == FINGERPRINT_BYTES + n + _PARTIAL
        else:
            partial = skey[_MARK_AT] == PARTIAL_MARK
        return skey[: -GROUP_BYTES - _PARTIAL] + skey[-GROUP_BYTES:] if partial else skey

    def _offload_keys(self, skeys: list[bytes], fp: bytes) -> list[OffloadKey]:
        """vLLM's keys of the stored keys of namespace ``fp`` (others dropped, counted)."""
        n, klen = len(fp), self.key_len
        out: list[OffloadKey] = []
        for k in skeys:
            if k[:n] != fp:
                continue
            if klen and len(k) == n + klen:
                out.append(OffloadKey(k[n:]))
            elif (not klen or len(k) == n + klen + _PARTIAL) and k[_MARK_AT] == PARTIAL_MARK:
                out.append(OffloadKey(k[n : -GROUP_BYTES - _PARTIAL] + k[-GROUP_BYTES:]))
            elif not klen:
                out.append(OffloadKey(k[n:]))
            # else: a key of another shape under this fingerprint (the namespace catalog's record)
        self.counters["foreign_keys"] += len(skeys) - len(out)
        return out

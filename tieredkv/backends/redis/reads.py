"""The Redis tier's reads: :class:`RedisReads` (``get_many``, ``contains_many``, ``raw_get_many``)
and the deletion of what they find corrupt (also the ``delete_if_same`` hook).

Values are whole records (:func:`tieredkv.format.encode_record`), written with one ``SET``
each (atomic per record; ``EX`` when ``ttl_s`` is set) and verified on every read. Reads are
bounded: ``GETRANGE key 0 cap`` (with ``EXISTS`` in the same pipeline, to tell an empty value
from no key) where ``cap`` is the destination's record size (or ``max_batch_bytes`` when the
caller wants bytes), so a huge foreign value under one of our keys costs at most ``cap + 1``
bytes on the wire and in memory; it is a miss, counted ``corrupt`` and deleted. A longer value
whose header is ours for that key is a record too big for the destination (an ``oversize``
miss, kept), or, when bytes are wanted, read in full by a second ``GETRANGE`` up to the size
its header states.

A value judged corrupt is deleted only while it still holds the bytes that were judged: a Lua
script per key (``_DEL_IF_SAME``), or a ``WATCH``ed transaction where scripting is refused, so a
fresh record another client wrote meanwhile is never dropped.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import AskError, ClusterDownError, RedisError, ResponseError, TryAgainError, WatchError

from tieredkv.backends.base import runs
from tieredkv.backends.redis.client import _SMALL_BATCH, RedisTierBase, _each, _raise_first
from tieredkv.backends.redis.native import _NativePipe
from tieredkv.backends.redis.resp import Into, Placed
from tieredkv.errors import CorruptRecordError
from tieredkv.format import HEADER_SIZE, decode_header, verify_into, verify_parts, verify_record
from tieredkv.keys import key_fingerprint, key_group

__all__ = ["RedisReads"]

log = logging.getLogger(__name__)

# Deletes a key only if it still holds the bytes we judged corrupt, so a fresh record written
# concurrently by another client is never dropped. ARGV: SHA-1 of the bytes seen, their length,
# "1" if they were the whole value (else a prefix: the value must still start with them). The
# value is never read past those bytes (it may be huge).
_DEL_IF_SAME = """
local len = tonumber(ARGV[2])
local n = redis.call('STRLEN', KEYS[1])
if n < len or (ARGV[3] == '1' and n ~= len) then return 0 end
local v = ''
if len > 0 then v = redis.call('GETRANGE', KEYS[1], 0, len - 1) end
if redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


#: Replies of a cluster whose slot did not settle in the retries (not a refusal of the command).
_UNSETTLED = (AskError, TryAgainError, ClusterDownError)


def _wrongtype(e: BaseException) -> bool:
    """A ``WRONGTYPE`` refusal: a foreign value of another type under one of our keys."""
    return isinstance(e, ResponseError) and str(e).startswith("WRONGTYPE")


class RedisReads(RedisTierBase):
    """Loads: bounded, verified reads (see the module docstring)."""

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        """:meth:`_read_records`; when it fails (or is cancelled) part way, the records it had
        already delivered into destinations are zeroed too: a failed load leaves nothing in the
        blocks it touched (a failed batch zeroes its own placed bytes, see :mod:`~tieredkv.backends.redis.resp`)."""
        out: list[int | bytes | None] = [None] * len(keys)
        try:
            return await self._read_records(keys, into, out)
        except BaseException:
            for dst, n in zip(into, out, strict=True):
                if dst is not None and type(n) is int:
                    dst[:n] = bytes(n)
            raise

    async def _read_records(
        self, keys: list[bytes], into: list[memoryview | None], out: list[int | bytes | None]
    ) -> list[int | bytes | None]:
        corrupt: list[tuple[bytes, bytes, bool]] = []  # (redis key, bytes seen, whole value?)
        rest: list[tuple[int, bytes, bytes, int]] = []  # (index, redis key, head read, record size its header claims)

        def cap(i: int) -> int:
            """The most bytes key ``i`` may hold to be served: a longer value is not read."""
            dst = into[i]
            return self._max_batch if dst is None else HEADER_SIZE + len(dst)

        def size(i: int) -> int:
            dst = into[i]
            return self._record_guess if dst is None else HEADER_SIZE + len(dst)

        for run in runs(range(len(keys)), size, self._run_bytes()):
            rkeys = [self.redis_key(keys[i]) for i in run]
            caps = [cap(i) for i in run]

            heads = [bytearray(HEADER_SIZE) for _ in run] if self._native is not None else []

            def add(
                pipe: Any,
                j: int,
                rkeys: list[bytes] = rkeys,
                caps: list[int] = caps,
                run: Sequence[int] = run,
                heads: list[bytearray] = heads,
            ) -> None:
                pipe.exists(rkeys[j])  # tells an empty value (corrupt) from no key (a plain miss)
                dst = into[run[j]]
                if isinstance(pipe, _NativePipe) and dst is not None:  # the payload lands in dst
                    pipe.getrange(rkeys[j], 0, caps[j], into=Into(memoryview(heads[j]), dst))
                else:
                    pipe.getrange(rkeys[j], 0, caps[j])  # at most caps[j] + 1 bytes: longer means too long

            replies = await self._per_key(rkeys, add, ncmd=2, data=True)
            for j, (i, rk, limit, reply) in enumerate(zip(run, rkeys, caps, replies, strict=True)):
                if isinstance(reply, BaseException):  # its node is down: a miss (counted node_errors)
                    continue
                exists, value = reply
                if isinstance(value, Placed):  # header in heads[j], payload already in its buffer
                    out[i] = self._verify_placed(keys[i], rk, heads[j], into[i], int(value), corrupt)  # type: ignore[arg-type]
                    continue
                if isinstance(value, BaseException):
                    if _wrongtype(value):  # a foreign non-string value under our key: a miss
                        self._on_corrupt(keys[i], value)
                    continue
                if not value and not (isinstance(exists, int) and exists > 0):
                    continue  # no such key
                if len(value) > limit:
                    claimed = _claimed_record_size(value, keys[i])
                    if claimed is None or claimed <= limit:  # not our record, or longer than it says
                        says = "no header for this key" if claimed is None else f"a header for {claimed} bytes"
                        self._on_corrupt(
                            keys[i],
                            CorruptRecordError(f"a value longer than {limit} bytes with {says} (not read further)"),
                        )
                        corrupt.append((rk, value, False))
                    elif into[i] is not None:  # a record for this key, larger than the destination
                        self._count("oversize")
                        log.warning(
                            "tier %s: record of %d bytes does not fit a %d-byte buffer; miss",
                            self.name,
                            claimed - HEADER_SIZE,
                            len(into[i]),  # type: ignore[arg-type]  # not None: a buffer was given
                        )
                    else:  # bytes wanted and the header vouches for the size: read the rest
                        rest.append((i, rk, value, claimed))
                    continue
                out[i] = self._verify_deliver(keys[i], rk, value, into[i], corrupt)
        if rest:
            rks = [rk for _, rk, _, _ in rest]
            try:
                tails = await self._per_key(
                    rks, lambda pipe, j: pipe.getrange(rks[j], len(rest[j][2]), rest[j][3])
                )  # ≤ claimed + 1 bytes
            except RedisError as e:  # their nodes went down since the first read: misses, not an error
                log.warning("tier %s: could not read the rest of %d large records: %s", self.name, len(rks), e)
                tails = [e] * len(rks)
            for (i, rk, head, claimed), tail in zip(rest, tails, strict=True):
                if isinstance(tail, BaseException):
                    continue
                out[i] = self._verify_deliver(
                    keys[i], rk, head + tail, None, corrupt, whole=len(head) + len(tail) <= claimed
                )
        if corrupt:
            await self._drop_corrupt(corrupt)
        return out

    def _verify_deliver(
        self,
        key: bytes,
        rk: bytes,
        value: bytes,
        dst: memoryview | None,
        corrupt: list[tuple[bytes, bytes, bool]],
        *,
        whole: bool = True,
    ) -> int | bytes | None:
        try:
            if dst is None:
                got: int | bytes = bytes(verify_record(value, key))
            else:
                got = verify_into(value, key, dst)  # checked and copied in one C call where built
        except CorruptRecordError as e:
            self._on_corrupt(key, e)
            corrupt.append((rk, value, whole))
            return None
        self._note_size(len(value))
        if got == -1:  # a good record, larger than its destination
            self._oversize(key, len(value) - HEADER_SIZE, dst)  # type: ignore[arg-type]  # dst given
            return None
        return got

    def _verify_placed(
        self,
        key: bytes,
        rk: bytes,
        head: bytearray,
        dst: memoryview,
        length: int,
        corrupt: list[tuple[bytes, bytes, bool]],
    ) -> int | None:
        """Verify a record read in place (header apart, payload in ``dst``); the payload's length,
        or None (a miss: what landed in ``dst`` is zeroed, so no damaged byte stays there)."""
        n = length - HEADER_SIZE
        try:
            verify_parts(memoryview(head), dst[:n], key)
        except CorruptRecordError as e:
            self._on_corrupt(key, e)
            landed = dst[: max(0, min(n, len(dst)))]
            corrupt.append((rk, bytes(head) + bytes(landed), True))
            landed[:] = bytes(len(landed))
            return None
        self._note_size(length)
        return n

    async def _drop_corrupt(self, corrupt: list[tuple[bytes, bytes, bool]]) -> None:
        """Delete values judged corrupt (``(redis key, bytes seen, whether they were the whole
        value)``), unless rewritten meanwhile (rare path)."""
        try:
            await self._del_if_same(corrupt)
        except RedisError as e:  # best effort: the read's results stand; the next read retries
            log.warning("tier %s: could not delete a corrupt value: %s", self.name, e)

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        return await self._del_if_same([(self.redis_key(k), raw, True) for k, raw in items])

    async def _del_if_same(self, entries: list[tuple[bytes, bytes, bool]]) -> int:
        """Delete each ``(redis key, bytes, whole)`` while the value still is those bytes (``whole``)
        or still starts with them: a Lua script per key (pipelined; on a cluster through
        :meth:`_per_key`, so a slot in migration is followed), or, where scripting is refused (a
        managed Redis, an ACL without ``+eval``), a ``WATCH``ed transaction. Never a blind ``DEL``:
        a record another client wrote meanwhile stays."""
        deleted = 0
        for run in runs(entries, lambda _: 1, _SMALL_BATCH):
            rks = [rk for rk, _, _ in run]
            argv = [
                (hashlib.sha1(seen, usedforsecurity=False).hexdigest(), len(seen), int(whole)) for _, seen, whole in run
            ]

            def add(pipe: Any, i: int, rks: list[bytes] = rks, argv: list[tuple[str, int, int]] = argv) -> None:
                pipe.execute_command("EVAL", _DEL_IF_SAME, 1, rks[i], *argv[i])

            for (rk, seen, whole), reply in zip(run, await self._per_key(rks, add), strict=True):
                if isinstance(reply, ResponseError) and not isinstance(reply, _UNSETTLED):
                    deleted += await self._del_if_same_watched(rk, seen, whole)  # scripting refused
                elif isinstance(reply, BaseException):
                    raise reply
                else:
                    deleted += int(reply)
        return deleted

    async def _del_if_same_watched(self, rk: bytes, seen: bytes, whole: bool) -> int:
        async with self._client.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(rk)
                value = await pipe.getrange(rk, 0, len(seen)) if not whole else await pipe.get(rk)
                same = value == seen if whole else value is not None and value[: len(seen)] == seen
                if not same:
                    await pipe.unwatch()
                    return 0
                pipe.multi()
                pipe.delete(rk)
                (n,) = await pipe.execute()
                return int(n)
            except WatchError:  # written meanwhile: kept
                return 0

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for run in runs(keys, lambda _: self._record_guess, self._max_batch):
            rkeys = [self.redis_key(k) for k in run]
            out.extend(_raise_first(await self._per_key(rkeys, _each("get", rkeys))))
        return out

    def probe_batch(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key exists, answered in the step: one pipelined ``EXISTS`` within
        ``lookup_budget_ms`` on connections of its own (:mod:`~tieredkv.backends.redis.probe`),
        or None (over budget, the server failing, TLS, off, or the tier not open)."""
        bounded = self._bounded
        if bounded is None:
            return None
        return bounded.exists([self.redis_key(k) for k in keys])

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        out: list[bool] = []
        for run in runs(keys, lambda _: 1, _SMALL_BATCH):
            rkeys = [self.redis_key(k) for k in run]
            replies = await self._per_key(rkeys, _each("exists", rkeys))
            out.extend(r is True or (isinstance(r, int) and r > 0) for r in replies)
        return out


def _claimed_record_size(head: bytes, key: bytes) -> int | None:
    """The record size (header + payload) the header at the start of ``head`` states, if it is a
    well-formed header for stored key ``key``; else ``None``. The checksum is not checked."""
    if len(head) < HEADER_SIZE:
        return None
    n = int.from_bytes(head[32:40], "little")
    try:
        hdr = decode_header(head[:HEADER_SIZE], n)
    except CorruptRecordError:
        return None
    if hdr.fingerprint != key_fingerprint(key) or hdr.group != key_group(key):
        return None
    return HEADER_SIZE + n

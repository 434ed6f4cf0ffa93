"""The tier contract: an async, batch-first store of verified records.

Primitives:

* :class:`Tier` — the ABC. Its public methods (``put_many``, ``get_many``,
  ``contains_many``, ``delete_many``, ``scan``, ``stats``, ``close``) do argument checks,
  deadlines, pins, metrics hooks and error translation once; a backend writes only the
  underscore hooks (``_open``, ``_put_many``, ``_get_many``, ``_contains_many``,
  ``_delete_many``, ``_scan``, ``_stats``, ``_close``).
* :class:`RecordInfo` — one record seen by ``scan``.
* :class:`TierStats` — capacity, usage, record count and counters.

Keys are *stored keys* (namespace fingerprint + block hash + 4-byte group; see
:mod:`tieredkv.keys`). Values are raw chunk payloads; each backend wraps them in the
record format of :mod:`tieredkv.format` and verifies it on every read. A record that fails
verification is a miss: the backend deletes it and ``counters["corrupt"]`` moves.

Capacity is all-or-nothing per ``put_many`` call: either every item is stored (evicting
unpinned records as needed) or :class:`~tieredkv.errors.TierFullError` is raised and none
is. Pinned keys (``pin_many``) are never evicted or deleted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar, overload

from tieredkv.errors import CorruptRecordError, TierClosedError, TieredKVError, TierTimeoutError, TierUnavailableError
from tieredkv.format import HEADER_SIZE, as_readable, as_writable, verify_record
from tieredkv.keys import FINGERPRINT_BYTES, MIN_STORED_KEY_BYTES, Namespace, key_fingerprint, stored_key_group
from tieredkv.tenants import TenantQuotas

__all__ = [
    "EvictListener",
    "OpObserver",
    "RawLimits",
    "RecordInfo",
    "RemovalListener",
    "Tier",
    "TierCapabilities",
    "TierStats",
    "cancel_background",
    "check_items",
    "check_key",
    "runs",
]

log = logging.getLogger(__name__)

#: ``observer(tier_name, op, keys, nbytes, seconds, outcome)``; outcome is "ok" or an error class name.
OpObserver = Callable[[str, str, int, int, float, str], None]
#: ``listener(key, payload, tenant)``: a record the tier's own policy evicts (see
#: :meth:`Tier.set_evict_listener`); ``payload`` is valid during the call only.
EvictListener = Callable[[bytes, memoryview, int], None]
#: ``listener(keys)``: stored keys this tier stopped holding by its own doing (see
#: :meth:`Tier.set_removal_listener`).
RemovalListener = Callable[[list[bytes]], None]

_T = TypeVar("_T")


def runs(
    items: Iterable[_T], size: Callable[[_T], int], max_bytes: int, max_items: int | None = None
) -> Iterable[list[_T]]:
    """``items`` in consecutive runs whose ``size`` sums to at most ``max_bytes`` (and of at most
    ``max_items``); never an empty run (an item larger than ``max_bytes`` is a run of its own).
    How backends and the admin CLI batch records per round trip or transaction."""
    run: list[_T] = []
    total = 0
    for it in items:
        n = size(it)
        if run and (total + n > max_bytes or (max_items is not None and len(run) >= max_items)):
            yield run
            run, total = [], 0
        run.append(it)
        total += n
    if run:
        yield run


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """A stored record as seen by :meth:`Tier.scan`."""

    key: bytes
    size: int
    """Payload bytes (without the 64-byte header)."""
    stamp: float | None = None
    """Last write or access time (Unix seconds) where the tier tracks one."""
    tenant: int | None = None
    """The record's tenant id (:func:`tieredkv.keys.tenant_id`; 0: the default tenant) where the
    tier can tell without reading the record; None: unknown."""

    @property
    def fingerprint(self) -> bytes:
        return key_fingerprint(self.key)

    @property
    def group(self) -> int:
        return stored_key_group(self.key)


@dataclass(slots=True)
class TierStats:
    """A tier's capacity, usage and counters at one moment."""

    name: str
    kind: str
    capacity_bytes: int | None
    used_bytes: int
    records: int | None
    counters: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier can do beyond the contract; callers branch on these, never on ``kind``."""

    #: Lives inside the engine's process (the CPU slab): the admin CLI cannot reach its records.
    in_process: bool = False
    #: Offers the zero-copy slot API the pipeline uses for direct transfers (``reserve`` /
    #: ``commit`` / ``borrow`` on slots of its own memory).
    slots: bool = False
    #: ``scan()`` fills :attr:`RecordInfo.stamp` itself; otherwise :meth:`Tier.fill_stamps` may.
    access_stamps: bool = False
    #: Enforces its capacity itself through an :class:`~tieredkv.eviction.EvictionPolicy`
    #: (False: a server does, e.g. Redis ``maxmemory``).
    local_eviction: bool = True
    #: Several engines or processes may read and write it at once.
    shared: bool = False
    #: :meth:`Tier.probe` answers from any thread without I/O that can wait (an in-process index,
    #: a memory-mapped B-tree) once the tier is open; otherwise it may return None.
    sync_probe: bool = False
    #: Batches a pipeline lane may have in :meth:`Tier.put_checked` at once. More than one for a
    #: tier whose write has a stage of its own before its writer (LMDB checksums on a second
    #: thread) or whose medium takes the next batch while the last is answered (Redis), and only
    #: for one that applies writes to a key in the order the calls were made (a later batch may
    #: overwrite a key of an earlier one).
    writes_in_flight: int = 1
    #: Where its records live, for the cache-hit source an engine reports (vLLM's
    #: ``CacheHitSource``): ``"host"`` (this host's memory), ``"disk"`` (a local file system) or
    #: ``"remote"`` (a server); ``"unspecified"`` for a tier that does not say.
    medium: str = "unspecified"
    #: Keeps each record's tenant (the ``tenants`` of :meth:`Tier.put_many`, in the record's
    #: header) and bounds tenants by :attr:`Tier.quotas`: a tenant over its quota loses its own
    #: records first. A tier without it stores every record as the default tenant.
    tenants: bool = False


@dataclass(frozen=True)
class RawLimits:
    """One measurement of a tier's medium without tieredkv (``tieredkv bench``): what the medium
    itself does on the same payloads, the figure the tier's own throughput is judged against."""

    #: Figure name → GB/s. ``"<what>.store"`` / ``"<what>.load"`` for one direction, a bare name
    #: for a figure that bounds both (``"memcpy"``). Names are the medium's, never a tier's label.
    gbps: dict[str, float]
    #: ``"store"`` / ``"load"`` → the figure in :attr:`gbps` the tier is judged against (ratio =
    #: tier GB/s / that figure), or several: the limit is then the strongest of them as measured
    #: (the bench takes the one with the highest median); a direction left out gets figures
    #: without a ratio.
    baseline: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
    #: Caveats printed once with the results ("the raw Redis figures use one node of the cluster").
    notes: tuple[str, ...] = ()
    #: ``"store"`` / ``"load"`` → the figure in :attr:`gbps` of the same medium doing the integrity
    #: work every record that leaves the process must get (a checksum computed over each payload
    #: on store, the delivered bytes checked against it on load), and nothing else: the most a tier
    #: that keeps integrity could do here. Reported beside the baseline (:func:`tieredkv.bench.
    #: floor_ratios`), never instead of it; empty for a medium whose records never leave the process.
    floor: dict[str, str] = field(default_factory=dict)

    def limit(self, op: str) -> tuple[str, ...]:
        """The figures ``op``'s limit is the strongest of (empty: none declared)."""
        got = self.baseline.get(op, ())
        return (got,) if isinstance(got, str) else tuple(got)


class Tier(ABC):
    """Base of every tier. Subclasses set :attr:`kind`, :attr:`config_model` and
    :attr:`capabilities`, and implement the underscore hooks.

    A third-party tier is this subclass plus one entry-point line
    (``[project.entry-points."tieredkv.backends"] mykind = "pkg.mod:MyTier"``): the registry
    finds the class, the config validates ``kind: mykind`` items with :attr:`config_model`.
    """

    kind: ClassVar[str] = "abstract"
    #: The pydantic model of this tier's config: a :class:`~tieredkv.config.TierConfigBase`
    #: subclass whose ``kind`` is :attr:`kind` (the registry validates config items with it).
    config_model: ClassVar[type[Any] | None] = None
    capabilities: ClassVar[TierCapabilities] = TierCapabilities()
    #: Same as ``capabilities.local_eviction`` (set from it for each subclass that does not set it):
    #: True when the tier enforces capacity itself, False when a server does (Redis ``maxmemory``).
    evicts_locally: ClassVar[bool] = True
    #: Set by admin tools: listing records (``scan``) must not count as reading them, so it must
    #: not change what an eviction policy or ``evict --older-than`` sees. A tier whose scan would
    #: touch records (Redis) reads them passively then; the others are passive anyway.
    passive_scans: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" in cls.__dict__ and "evicts_locally" not in cls.__dict__:
            cls.evicts_locally = cls.capabilities.local_eviction

    def __init__(self, config: Any, *, name: str | None = None) -> None:
        self.config = config
        self.name: str = name or getattr(config, "name", "") or self.kind
        self.op_timeout: float | None = getattr(config, "op_timeout_s", None)
        #: Event counts (``hits``, ``misses``, ``corrupt``, ``evictions``, ...), moved by
        #: :meth:`_count` under a lock; read them whole with :meth:`counters_snapshot`.
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._pins: Counter[bytes] = Counter()
        self._pin_lock = threading.Lock()
        self._observers: list[OpObserver] = []
        self._opened = False
        self._closed = False
        self._open_lock: asyncio.Lock | None = None
        #: The tenants' quotas (see :meth:`set_quotas`); none by default.
        self.quotas: TenantQuotas = TenantQuotas()
        self._removal_listener: RemovalListener | None = None

    @classmethod
    def missing(cls, config: Any) -> str | None:
        """Where ``config`` points at no data of this tier yet (an LMDB directory without an
        environment), said without creating anything; None when it may hold data or cannot tell.
        Admin commands that must not create a tier ask this before :meth:`open`."""
        return None

    @classmethod
    def raw_limits(cls, config: Any, src: Any, dst: Any, *, workdir: str) -> RawLimits | None:
        """The raw limit of this tier's medium, for ``tieredkv bench``: one run of what the medium
        does without tieredkv on the bench's payloads, measured the way the tier uses it
        (``config`` is the bench copy of the tier's config). ``src`` is a ``(chunks, size)``
        uint8 torch tensor to write; ``dst``, of the same shape, is where reads go; ``workdir``
        is a scratch directory on the disk the bench runs beside. Called once per repetition,
        interleaved with the tiers; must leave the medium as it found it.

        None (the default): no raw figure, so the tier's throughput is reported without a ratio.
        The medium-specific code of the built-in tiers is in :mod:`tieredkv.backends._rawbench`."""
        return None

    @classmethod
    def bench_writes_fresh_pages(cls, config: Any) -> bool:
        """Whether this tier's stores write pages the kernel hands out as they go (the page cache,
        a heap, a server's memory), for ``tieredkv bench``: then the bench warms free pages before
        its timed stores (:func:`~tieredkv.backends._rawbench.warm_free_pages`), as the raw
        baselines of such media do. True (the default); False for a tier that stores into its
        own memory, touched when it opened (the CPU slab with ``prefault``)."""
        return True

    # ---- lifecycle -----------------------------------------------------------------

    async def open(self) -> Self:
        """Connect / allocate. Idempotent; called by ``async with`` and by the first operation."""
        if self._closed:
            raise TierClosedError(f"tier {self.name!r} is closed")
        if self._opened:
            return self
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if not self._opened:
                await self._guard("open", 0, self._open())
                self._opened = True
        return self

    async def close(self) -> None:
        """Release everything. Idempotent: a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._opened:
            try:
                await self._close()
            except Exception as e:  # noqa: BLE001 - closing must not raise native errors
                log.warning("tier %s: error while closing: %s", self.name, e)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- pins ----------------------------------------------------------------------

    def pin_many(self, keys: Iterable[bytes]) -> None:
        """Protect ``keys`` from eviction and deletion until :meth:`unpin_many` (counted). Safe from
        any thread: the scheduler pins a hit in the step it accepts it, not when the loop gets to it."""
        with self._pin_lock:
            self._pins.update(keys)  # one C loop

    def unpin_many(self, keys: Iterable[bytes]) -> None:
        pins = self._pins
        with self._pin_lock:
            for k in keys:
                n = pins.pop(k, 0) - 1
                if n > 0:
                    pins[k] = n

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    # ---- synchronous probe ---------------------------------------------------------

    def probe(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key holds a record, answered at once from any thread without I/O that can
        wait (an in-process index, a memory-mapped B-tree), or None when this tier cannot (a
        network server). Advisory, like ``contains_many``: ``get_many`` still verifies. The
        scheduler side uses it to answer a lookup in the step it is asked instead of one later."""
        return None

    def probe_key(self, key: bytes) -> bool | None:
        """:meth:`probe` of one key (the scheduler's per-key path; a tier with an in-process index
        answers it without building a list)."""
        got = self.probe((key,))
        return None if got is None else got[0]

    def probe_members(self) -> Container[bytes] | None:
        """A container whose ``in`` answers :meth:`probe_key` for any key, from any thread, while
        this tier stays open (an in-process index), or None (the default: ask ``probe_key``). The
        scheduler's prefix scans test a run of keys against it in one C loop."""
        return None

    def probe_batch(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether each key holds a record, for a batch a scheduler needs answered in the step it
        asks (a request's whole prefix): from the calling thread, within a bounded time, or None
        (the asynchronous lookup decides). Where :meth:`probe` answers without waiting this is
        :meth:`probe` (the default); a network tier may wait here for one round trip within a
        budget of its own (Redis: a pipelined ``EXISTS`` within ``lookup_budget_ms``), never
        longer, and answers None past it, when its server fails, or when it cannot tell."""
        return self.probe(keys)

    # ---- observers -----------------------------------------------------------------

    def add_observer(self, fn: OpObserver) -> None:
        """Call ``fn`` after every operation (metrics); exceptions in ``fn`` are logged."""
        self._observers.append(fn)

    def set_evict_listener(self, fn: EvictListener | None) -> None:
        """Call ``fn(key, payload, tenant)`` for every record this tier's own policy evicts (not
        deletes), before its space is reused: write-back demotes it to the next tier of its route,
        as its tenant's record. ``payload`` is a view of the record's bytes where they lie, valid
        during the call only (the space is reused right after): a listener copies what it keeps,
        and one that keeps nothing costs no copy (a full CPU tier evicts a record per store). The
        default passes nothing on (a tier that evicts nothing a route still needs, or whose
        server evicts: Redis ``maxmemory``); the CPU tier overrides it.
        Set by the pipeline once the tier is open."""

    def set_removal_listener(self, fn: RemovalListener | None) -> None:
        """Call ``fn(keys)`` with the stored keys this tier stops holding by its own doing: its
        eviction policy (a size cap, a tenant over its quota), a record dropped as corrupt, and
        what its server removes (Redis ``maxmemory`` evictions and TTL expiries, observed); not
        the deletions a caller asks for (``delete_many``, ``delete_if_same``: the caller knows).
        Batched where the tier removes in batches; called from whichever thread removes (the
        loop, an I/O thread), after the removal took effect. None (the default): nothing is
        reported and nothing is spent. Set on the tier's loop (a tier that must watch its server
        starts the watch there, or at open); an engine integration uses it for KV events."""
        self._removal_listener = fn

    def _removed(self, keys: Sequence[bytes]) -> None:
        """Report ``keys`` to the removal listener, if any (backends call this; see
        :meth:`set_removal_listener`). A listener that raises is logged, never the removal's error."""
        fn = self._removal_listener
        if fn is None or not keys:
            return
        try:
            fn(list(keys))
        except Exception:
            log.exception("tier %s: removal listener failed", self.name)

    def counters_snapshot(self) -> dict[str, int]:
        """A copy of :attr:`counters`, taken under the lock backends count under (their I/O
        threads may be counting at the same moment): what a metrics scrape reads."""
        with self._counter_lock:
            return dict(self.counters)

    # ---- public operations -----------------------------------------------------------

    async def put_many(self, items: Sequence[tuple[bytes, Any]], *, tenants: Sequence[int] | None = None) -> None:
        """Store every ``(key, payload)``; a later duplicate key wins. ``tenants``: per item its
        tenant id (:func:`tieredkv.keys.tenant_id`; None: the default tenant, 0), kept by a tier
        with ``capabilities.tenants``.

        Raises:
            TierFullError: the batch does not fit even after evicting every unpinned record;
                nothing of the batch was stored.
            TierUnavailableError / TierTimeoutError: the medium failed or ran past the deadline.
        """
        checked = check_items("put_many", items, as_readable)
        if tenants is not None:
            tenants = list(tenants)
            if len(tenants) != len(checked):
                raise ValueError(f"put_many: {len(checked)} items but {len(tenants)} tenants")
            for t in tenants:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**64:
                    raise ValueError(f"put_many: tenant {t!r} is not a tenant id (tieredkv.keys.tenant_id)")
        await self.put_checked(checked, tenants)

    async def put_checked(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        """:meth:`put_many` of items already checked: stored keys, flat byte ``memoryview``s, and
        ``tenants`` (per item, or None: all the default tenant). For callers that built them so
        (the pipeline's writer lanes: every key was checked when its job was submitted); a later
        duplicate key still wins."""
        if not items:
            return
        if tenants is not None and not any(tenants):
            tenants = None
        if tenants is None:
            batch = dict(items)
            if len(batch) < len(items):
                items = list(batch.items())
            nbytes = sum(map(len, batch.values()))
        else:
            last = {k: i for i, (k, _) in enumerate(items)}
            if len(last) < len(items):
                keep = sorted(last.values())
                items, tenants = [items[i] for i in keep], [tenants[i] for i in keep]
            nbytes = sum(len(p) for _, p in items)
        await self._ensure_open()
        if tenants is not None and self.capabilities.tenants:
            work = self._put_many(items, tenants)  # type: ignore[call-arg]
        else:
            work = self._put_many(items)
        await self._guard("put_many", len(items), work, nbytes)
        self._count("puts", len(items))
        self._count("put_bytes", nbytes)

    @overload
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...
    @overload
    async def get_many(self, keys: Sequence[bytes], into: Sequence[Any]) -> list[int | None]: ...

    async def get_many(self, keys: Sequence[bytes], into: Sequence[Any] | None = None) -> list[Any]:
        """Read records. With ``into``, copy each payload into the matching writable buffer and
        return its length; without, return new ``bytes``. A miss is ``None``.

        A record that fails verification, or is longer than its buffer, is a miss (counted).
        """
        keys = list(keys)
        for k in keys:
            check_key(k)
        if into is None:
            dsts: list[memoryview | None] = [None] * len(keys)
        else:
            if len(into) != len(keys):
                raise ValueError(f"get_many: {len(keys)} keys but {len(into)} buffers")
            dsts = [as_writable(b) for b in into]
        return await self.get_checked(keys, dsts)

    async def get_checked(self, keys: list[bytes], into: list[memoryview | None]) -> list[Any]:
        """:meth:`get_many` of keys and buffers already checked: stored keys, and per key a flat
        writable byte ``memoryview`` or None (new ``bytes``). For callers that built them so (the
        pipeline's lanes: every key was checked when its job was submitted)."""
        if not keys:
            return []
        await self._ensure_open()
        self.pin_many(keys)
        try:
            out = await self._guard("get_many", len(keys), self._get_many(keys, into))
        finally:
            self.unpin_many(keys)
        hits = len(out) - out.count(None)
        self._count("hits", hits)
        self._count("misses", len(keys) - hits)
        # a hit is a length (read into a buffer) or the bytes read
        self._count("get_bytes", sum(r if type(r) is int else len(r) for r in out if r is not None))
        return out

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a record (not verified; ``get_many`` verifies)."""
        keys = list(keys)
        for k in keys:
            check_key(k)
        if not keys:
            return []
        await self._ensure_open()
        return await self._guard("contains_many", len(keys), self._contains_many(keys))

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete records; pinned keys are skipped. Returns how many records were removed."""
        for k in keys:
            check_key(k)
        todo = [k for k in dict.fromkeys(keys) if not self.is_pinned(k)]
        if not todo:
            return 0
        await self._ensure_open()
        n = await self._guard("delete_many", len(todo), self._delete_many(todo))
        self._count("deletes", n)
        return n

    async def scan(self, namespace: bytes | Namespace | None = None) -> AsyncIterator[RecordInfo]:
        """Every record, or those of one namespace fingerprint (16 bytes, or a Namespace)."""
        fp = namespace.fingerprint if isinstance(namespace, Namespace) else namespace
        if fp is not None and len(fp) != FINGERPRINT_BYTES:
            raise ValueError(f"namespace fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fp)}")
        await self._ensure_open()
        try:
            async for info in self._scan(fp):
                yield info
        except TieredKVError:
            raise
        except Exception as e:
            raise self._translate(e, "scan") from e

    async def fill_stamps(self, infos: list[RecordInfo]) -> list[RecordInfo]:
        """``infos`` with :attr:`RecordInfo.stamp` (last access) filled where the scan left it out.

        The default returns them as they are; a tier whose medium can tell the age on request
        (Redis ``OBJECT IDLETIME``) overrides this. Must not itself change the records' ages.
        """
        return infos

    async def stats(self) -> TierStats:
        await self._ensure_open()
        st: TierStats = await self._guard("stats", 0, self._stats())
        st.counters = {**self.counters_snapshot(), **st.counters}
        st.extra.setdefault("pinned_keys", len(self._pins))
        return st

    def set_quotas(self, quotas: TenantQuotas) -> None:
        """The tenants' quotas this tier applies (with ``capabilities.tenants``; see
        :mod:`tieredkv.tenants`). Set before the tier is used; the store sets them from the
        config's ``tenants`` section."""
        self.quotas = quotas

    async def tenant_usage(self) -> dict[int, int] | None:
        """Bytes held per tenant id (records of the default tenant under 0); None for a tier
        without ``capabilities.tenants``."""
        if not self.capabilities.tenants:
            return None
        await self._ensure_open()
        usage: dict[int, int] = await self._guard("tenant_usage", 0, self._tenant_usage())
        return usage

    async def raw_get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Records exactly as stored (header + payload), unverified — for inspect, verify and migrate."""
        keys = list(keys)
        await self._ensure_open()
        return await self._guard("raw_get_many", len(keys), self._raw_get_many(keys))

    async def delete_if_same(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Compare-and-delete, for repairs: delete each ``(key, record)`` only while the key still
        holds exactly ``record`` (the bytes :meth:`raw_get_many` returned for it). A record
        rewritten, replaced or moved since it was read is kept, whoever wrote it (an engine on
        the same medium, another node). Pinned keys are skipped. Returns how many were deleted.

        Raises ``NotImplementedError`` for a tier that cannot compare and delete as one step
        (then a repair deletes nothing there)."""
        todo: dict[bytes, bytes] = {}
        for k, raw in items:
            check_key(k)
            if not self.is_pinned(k):
                todo[k] = bytes(raw)
        if not todo:
            return 0
        await self._ensure_open()
        n = await self._guard("delete_if_same", len(todo), self._delete_if_same(list(todo.items())))
        self._count("deletes", n)
        return n

    async def raw_put_many(self, items: Sequence[tuple[bytes, Any]]) -> None:
        """Store records exactly as given (no encoding; capacity and eviction as in ``put_many``) —
        for migration of already-encoded records and for fault injection. Reads still verify them."""
        batch = check_items("raw_put_many", items, as_readable)
        await self._ensure_open()
        await self._guard("raw_put_many", len(batch), self._raw_put_many(batch))

    def check_record(self, raw: bytes | memoryview, key: bytes) -> str | None:
        """Why ``raw`` (a record as :meth:`raw_get_many` returned it) is not good for stored key
        ``key``, or None when it is — what a read of this tier would judge (``tieredkv verify`` /
        ``inspect`` ask it). By default the checksum check of :mod:`tieredkv.format`; a tier with
        encryption opens the record (:mod:`tieredkv.sealing`)."""
        try:
            verify_record(raw, key)
        except CorruptRecordError as e:
            return str(e)
        return None

    # ---- helpers for backends --------------------------------------------------------

    def _deliver(self, key: bytes, payload: memoryview, dst: memoryview | None) -> int | bytes | None:
        """Copy a verified payload to its destination; ``None`` (a miss) when it does not fit."""
        if dst is None:
            return bytes(payload)
        n = len(payload)
        if n > len(dst):
            self._oversize(key, n, dst)
            return None
        dst[:n] = payload
        return n

    def _oversize(self, key: bytes, n: int, dst: memoryview) -> None:
        """Count and log a verified payload of ``n`` bytes too large for its buffer: a miss."""
        self._count("oversize")
        log.warning("tier %s: record of %d bytes does not fit a %d-byte buffer; miss", self.name, n, len(dst))

    def _on_corrupt(self, key: bytes, err: BaseException) -> None:
        """Count and log a record that failed verification (the backend deletes it)."""
        self._count("corrupt")
        log.warning("tier %s: corrupt record %s… dropped: %s", self.name, key[:24].hex(), err)
        self._removed((key,))

    def _count(self, name: str, n: int = 1) -> None:
        """Thread-safe counter increment (backends may count from their I/O thread)."""
        with self._counter_lock:
            self.counters[name] += n

    def _translate(self, exc: BaseException, op: str) -> TieredKVError:
        """Map a native error to the tieredkv tree; backends extend this."""
        return TierUnavailableError(f"tier {self.name!r} ({self.kind}): {op} failed: {type(exc).__name__}: {exc}")

    async def _ensure_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"tier {self.name!r} is closed")
        if not self._opened:
            await self.open()

    async def _guard(self, op: str, nkeys: int, coro: Any, nbytes: int = 0) -> Any:
        """Run one hook with the deadline, error translation and observers."""
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            if self.op_timeout:
                async with asyncio.timeout(self.op_timeout):
                    return await coro
            return await coro
        except TimeoutError as e:
            outcome = "TierTimeoutError"
            self._count("timeouts")
            raise TierTimeoutError(
                f"tier {self.name!r} ({self.kind}): {op} of {nkeys} keys ran past its {self.op_timeout}s deadline"
            ) from e
        except TieredKVError as e:
            outcome = type(e).__name__
            raise
        except (asyncio.CancelledError, NotImplementedError):
            outcome = "cancelled"
            raise
        except Exception as e:
            err = self._translate(e, op)
            outcome = type(err).__name__
            self._count("errors")
            raise err from e
        finally:
            if self._observers:
                dt = time.perf_counter() - t0
                for fn in self._observers:
                    try:
                        fn(self.name, op, nkeys, nbytes, dt, outcome)
                    except Exception:
                        log.exception("tier observer failed")

    # ---- hooks -----------------------------------------------------------------------

    async def _open(self) -> None:
        """Allocate / connect."""

    @abstractmethod
    async def _put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        """Store unique ``(key, payload)`` pairs all-or-nothing (raise TierFullError)."""

    @abstractmethod
    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        """Verify and deliver each record with :meth:`_deliver`; corrupt → delete + :meth:`_on_corrupt`."""

    @abstractmethod
    async def _contains_many(self, keys: list[bytes]) -> list[bool]: ...

    @abstractmethod
    async def _delete_many(self, keys: list[bytes]) -> int: ...

    @abstractmethod
    def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]: ...

    @abstractmethod
    async def _stats(self) -> TierStats: ...

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        raise NotImplementedError(f"tier kind {self.kind!r} does not expose raw records")

    async def _delete_if_same(self, items: list[tuple[bytes, bytes]]) -> int:
        """Delete each key whose record is still exactly the given bytes, as one step per key
        (no writer can slip between the comparison and the deletion)."""
        raise NotImplementedError(f"tier kind {self.kind!r} cannot compare and delete a record")

    async def _tenant_usage(self) -> dict[int, int]:
        """Bytes per tenant id (a tier with ``capabilities.tenants`` implements it)."""
        raise NotImplementedError(f"tier kind {self.kind!r} does not keep tenants")

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        raise NotImplementedError(f"tier kind {self.kind!r} does not accept raw records")

    async def _close(self) -> None:
        """Release resources (called once)."""


async def cancel_background(task: asyncio.Task[Any] | None) -> None:
    """Stop a tier's background task (its upkeep) at close: cancelled and awaited when it runs on
    the calling loop, cancelled from outside when the tier is closed from another loop than it
    was opened in (nothing to wait for there)."""
    if task is None or task.done():
        return
    loop = task.get_loop()
    if loop is asyncio.get_running_loop():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)


def check_items(
    what: str, items: Iterable[tuple[bytes, Any]], view: Callable[[Any], memoryview]
) -> list[tuple[bytes, memoryview]]:
    """``items`` checked: each key a stored key, each buffer turned into a flat byte ``memoryview``
    by ``view`` (readable for a write, writable for a read). A bad item raises ``ValueError`` /
    ``TypeError`` naming ``what`` and its index."""
    out: list[tuple[bytes, memoryview]] = []
    for i, (key, buf) in enumerate(items):
        try:
            check_key(key)
            out.append((key, view(buf)))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}: item {i}: {e}") from None
    return out


def check_key(key: Any) -> None:
    """Raise ``ValueError`` unless ``key`` is a stored key's shape (what every tier call takes)."""
    if not isinstance(key, bytes) or len(key) < MIN_STORED_KEY_BYTES:
        raise ValueError(
            f"a tier key must be a stored key (bytes: 16-byte namespace fingerprint + hash + 4-byte group),"
            f" got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
        )


def record_size(payload_len: int) -> int:
    """Bytes a record of ``payload_len`` takes (header + payload)."""
    return HEADER_SIZE + payload_len

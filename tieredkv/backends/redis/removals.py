"""What a Redis server removes by itself — ``maxmemory`` evictions, ``ttl_s`` expiries — reported to
the tier's removal listener (:meth:`~tieredkv.backends.base.Tier.set_removal_listener`; an engine
asks for it for its KV events). :class:`RemovalWatch` runs on the tier's loop from the moment a
listener is set (or the tier opens, if later) until the tier closes; without a listener nothing
here runs, and the data path pays one attribute test per put.

How the removals are observed (``removal_watch``, see :class:`~tieredkv.backends.redis.config.
RedisTierConfig`):

* **Keyspace notifications** (``auto``): on every primary (each master of a cluster: the
  notifications of a key come from the node that holds it), ``CONFIG GET notify-keyspace-events``;
  the flags ``E`` (key-event channel), ``e`` (evicted) and ``x`` (expired) are added where missing
  with ``CONFIG SET`` (flags are only ever added: other clients of the server may rely on theirs;
  nothing is undone at close), then ``SUBSCRIBE __keyevent@<db>__:evicted`` and ``…:expired`` on a
  connection of its own. A message is a Redis key; the tier's own (:func:`~tieredkv.backends.
  redis.keys.parse_redis_key`) are batched — every message already received goes in one batch —
  and reported. On a cluster the list of masters is read again every few seconds, so a replica
  promoted by a failover is watched too. Pub/sub is fire-and-forget: what is removed while a
  subscription is down (a restart, a failover, a network cut) is never heard of.
* **A bounded scan** (``auto`` where ``CONFIG`` is refused — managed services often rename or
  forbid it — and the flags are not already on; or ``scan``): the keys this process stored are
  kept, oldest first, at most ``removal_scan_max_keys`` (past it the oldest are forgotten: their
  removal goes unreported); every ``removal_scan_interval_s`` the oldest ``removal_scan_keys`` of
  them are checked with one pipelined ``EXISTS``, the missing ones reported and forgotten, the
  others moved to the back. So every tracked key is checked once per
  ``max_keys / keys × interval`` seconds at most (256 s with the defaults), and the server sees
  ``keys / interval`` EXISTS per second (1024/s), whatever the traffic.

Either way a key is reported only while ``EXISTS`` says it is gone (the notification's key is
checked first: a key stored again after its eviction, whose reply this process may read before
the eviction's message, is not reported), and a key stored again by this process while its check
was on the wire is not reported either. Records deleted over a tenant's quota
(:mod:`~tieredkv.backends.redis.tenants`) are reported by the tier as it deletes them; deletions
by other clients (``DEL``: ``tieredkv evict`` / ``flush`` from another process) are not observed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tieredkv.backends.redis.keys import parse_redis_key
from tieredkv.errors import TieredKVError

if TYPE_CHECKING:
    from tieredkv.backends.redis.client import RedisTierBase

__all__ = ["RemovalWatch"]

log = logging.getLogger(__name__)

NOTIFY = "notify-keyspace-events"
#: The key-event channels subscribed to (``__keyevent@<db>__:<event>``).
EVENTS = ("evicted", "expired")
#: Seconds before a failed subscription is tried again.
RETRY_S = 1.0
#: Seconds between two reads of a cluster's masters (a failover's new master is then watched).
TOPOLOGY_S = 5.0


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RemovalWatch:
    """The removals a Redis tier's server makes by itself, reported to the tier's listener (see
    the module docstring). Loop thread only."""

    def __init__(self, tier: RedisTierBase) -> None:
        self.tier = tier
        cfg = tier.config
        #: "notify", "scan" or "off" once :attr:`ready` is set.
        self.mode: str | None = None
        #: Set once the watch is in place: notifications subscribed on every primary, or the scan
        #: running (or nothing to do). What the server removes before then is not heard of.
        self.ready = asyncio.Event()
        self._tracked: dict[bytes, None] = {}  # scan mode: keys stored here, oldest first
        self._max = cfg.removal_scan_max_keys
        self._task: asyncio.Task[None] | None = None
        self._subs: dict[str, asyncio.Task[None]] = {}  # node address -> its subscription
        self._subscribed: dict[str, asyncio.Event] = {}
        self._clients: list[Any] = []
        self._nodes_now: dict[str, tuple[Any, int]] = {}
        #: Keys whose EXISTS is on the wire -> stored again by this process meanwhile.
        self._checking: dict[bytes, bool] = {}

    # ---- lifecycle (the tier's loop) ----------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"tieredkv-removals-{self.tier.name}")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._subs.values()) if t is not None]
        self._task = None
        self._subs.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        clients, self._clients = self._clients, []
        for c in clients:
            try:
                await c.aclose()
            except Exception as e:  # noqa: BLE001 - closing
                log.debug("tier %s: closing a notification connection: %s", self.tier.name, e)

    # ---- the data path's one call -----------------------------------------------------------------

    def track(self, keys: Sequence[bytes]) -> None:
        """Keys this process just stored: one being checked is not reported gone; the scan checks
        them later (other modes: nothing more)."""
        if self._checking:
            checking = self._checking
            for k in keys:
                if k in checking:
                    checking[k] = True
        if self.mode != "scan":
            return
        t = self._tracked
        t.update(dict.fromkeys(keys))
        while len(t) > self._max:
            del t[next(iter(t))]

    async def confirm(self, keys: Sequence[bytes]) -> None:
        """Report those of ``keys`` (stored keys) that ``EXISTS`` says are gone and that this
        process did not store again while they were checked (all of them, as heard, when the
        server cannot be asked)."""
        await self._check(list(dict.fromkeys(keys)), gone_if_unknown=True)

    async def _check(self, keys: list[bytes], *, gone_if_unknown: bool) -> None:
        """One pipelined ``EXISTS`` of ``keys``; the missing ones reported, the others (and those
        not answered, unless ``gone_if_unknown``) tracked again at the back (scan mode)."""
        if not keys:
            return
        tier, tracked, checking = self.tier, self._tracked, self._checking
        writing = tier._writing
        for _ in range(8):
            # A put of some of these keys is on the wire: it may have written them before they went
            # (evicted by its own later commands) and it reports them stored when it returns. Wait
            # for it, so a removal is never reported before that store; a put started after this
            # check's EXISTS is a store again (:meth:`track`).
            busy = {writing[k] for k in keys if k in writing}
            if not busy:
                break
            await asyncio.gather(*(asyncio.shield(f) for f in busy), return_exceptions=True)
        was = [tracked.pop(k, 0) is None for k in keys]  # tracked before: taken out while checked
        checking.update(dict.fromkeys(keys, False))
        rkeys = [tier.redis_key(k) for k in keys]
        try:
            replies: list[Any] = await tier._per_key(rkeys, lambda pipe, i: pipe.exists(rkeys[i]))
        except (RedisError, OSError, TieredKVError) as e:
            log.debug("tier %s: removals not checked: %s", tier.name, e)
            replies = [e] * len(keys)
        except BaseException:  # cancelled at close
            for k in keys:
                checking.pop(k, None)
            raise
        gone = []
        for k, r, tracked_before in zip(keys, replies, was):
            if checking.pop(k, False):
                continue  # stored again while it was checked (and tracked anew, in scan mode)
            unknown = isinstance(r, BaseException)
            if r == 0 or (unknown and gone_if_unknown):
                gone.append(k)
            elif tracked_before:
                tracked[k] = None  # there (or unknown): checked again later
        while len(tracked) > self._max:
            del tracked[next(iter(tracked))]
        tier._removed(gone)

    # ---- which way -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        how = self.tier.config.removal_watch
        try:
            if how == "auto" and await self._notifications():
                self.mode = "notify"
            else:
                self.mode = "off" if how == "off" else "scan"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the server may be down at start: scan instead
            log.warning(
                "tier %s: keyspace notifications not set up (%s); checking stored keys instead", self.tier.name, e
            )
            self.mode = "scan"
        log.info("tier %s: removals by the server observed by %s", self.tier.name, self.mode)
        if self.mode == "notify":
            await self._supervise()
        elif self.mode == "scan":
            self.ready.set()
            await self._scan()
        else:
            self.ready.set()

    # ---- notifications -----------------------------------------------------------------------------

    def _nodes(self) -> dict[str, tuple[Any, int]]:
        """Address -> (a client of that primary, its db). One node: the tier's own client."""
        tier = self.tier
        client = tier._client
        if not tier.config.cluster:
            db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
            return {"node": (client, db)}
        out: dict[str, tuple[Any, int]] = {}
        parts = urlsplit(tier.config.url)
        auth = parts.netloc.rpartition("@")[0]
        for node in client.get_primaries():
            addr = f"{node.host}:{node.port}"
            url = f"{parts.scheme}://{auth + '@' if auth else ''}{addr}/0"
            out[addr] = (url, 0)
        return out

    def _client_of(self, ref: Any) -> Any:
        if not isinstance(ref, str):
            return ref
        c = aioredis.Redis.from_url(ref, **self.tier._client_kwargs())
        self._clients.append(c)
        return c

    async def _enable(self, client: Any) -> bool:
        """Whether the server publishes evicted and expired key events (turned on here if it can be)."""
        try:
            got = await client.config_get(NOTIFY)
        except RedisError as e:
            log.info("tier %s: CONFIG GET %s refused (%s)", self.tier.name, NOTIFY, e)
            return False
        flags = next((_str(v) for k, v in got.items() if _str(k) == NOTIFY), "")
        need = {"E", "e", "x"} - ({"e", "x"} if "A" in flags else set())
        missing = "".join(sorted(need - set(flags)))
        if not missing:
            return True
        try:
            await client.config_set(NOTIFY, flags + missing)
        except RedisError as e:
            log.info("tier %s: CONFIG SET %s refused (%s)", self.tier.name, NOTIFY, e)
            return False
        return True

    async def _notifications(self) -> bool:
        """Turn them on on every primary; False (nothing subscribed) when one refuses."""
        nodes = self._nodes()
        for ref, _ in nodes.values():
            if not await self._enable(self._client_of(ref)):
                return False
        self._nodes_now = nodes
        return True

    async def _supervise(self) -> None:
        nodes = self._nodes_now
        while True:
            for addr, (ref, db) in nodes.items():
                if addr not in self._subs:
                    self._subscribed[addr] = asyncio.Event()
                    self._subs[addr] = asyncio.get_running_loop().create_task(self._listen(addr, ref, db))
            for addr in [a for a in self._subs if a not in nodes]:
                self._subs.pop(addr).cancel()
                self._subscribed.pop(addr, None)
            if not self.ready.is_set():
                await asyncio.gather(*(e.wait() for e in self._subscribed.values()))
                self.ready.set()
            if not self.tier.config.cluster:
                await asyncio.gather(*self._subs.values())
                return
            await asyncio.sleep(TOPOLOGY_S)
            try:
                nodes = self._nodes()
            except Exception as e:  # noqa: BLE001 - keep the old list until the next round
                log.debug("tier %s: masters not read: %s", self.tier.name, e)

    async def _listen(self, addr: str, ref: Any, db: int) -> None:
        """One primary's evicted / expired key events, for as long as the tier is open (a dropped
        subscription is set up again, notifications re-enabled, after :data:`RETRY_S`)."""
        channels = [f"__keyevent@{db}__:{e}" for e in EVENTS]
        client = self._client_of(ref)
        prefix = self.tier._prefix
        first = True
        while True:
            ps = client.pubsub()
            try:
                if not first and not await self._enable(client):
                    raise RedisError("notifications could not be turned on again")
                await ps.subscribe(*channels)
                confirmed = 0
                while confirmed < len(channels):  # wait for the server to have subscribed us
                    msg = await ps.get_message(timeout=None)
                    if msg is not None and _str(msg.get("type")) == "subscribe":
                        confirmed += 1
                self._subscribed[addr].set()
                while True:
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=None)
                    batch = [msg] if msg is not None else []
                    while (more := await ps.get_message(ignore_subscribe_messages=True, timeout=0)) is not None:
                        batch.append(more)
                    keys = [
                        sk
                        for m in batch
                        if _str(m.get("type")) == "message" and (sk := parse_redis_key(prefix, m["data"])) is not None
                    ]
                    if keys:
                        await self.confirm(keys)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                log.warning(
                    "tier %s: key-event subscription on %s lost (%s); what the server removes meanwhile is"
                    " not reported; again in %.0fs",
                    self.tier.name,
                    addr,
                    e,
                    RETRY_S,
                )
            finally:
                try:
                    await ps.aclose()
                except Exception as e:  # noqa: BLE001 - closing a broken subscription
                    log.debug("tier %s: closing a subscription: %s", self.tier.name, e)
            first = False
            await asyncio.sleep(RETRY_S)

    # ---- the scan -----------------------------------------------------------------------------------

    async def _scan(self) -> None:
        cfg = self.tier.config
        while True:
            await asyncio.sleep(cfg.removal_scan_interval_s)
            await self.scan_round(cfg.removal_scan_keys)

    async def scan_round(self, n: int) -> None:
        """Check the ``n`` oldest tracked keys: report the missing ones, move the others back."""
        tracked = self._tracked
        it = iter(tracked)
        await self._check([next(it) for _ in range(min(n, len(tracked)))], gone_if_unknown=False)

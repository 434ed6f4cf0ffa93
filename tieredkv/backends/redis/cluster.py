"""Redis Cluster batches of :class:`~tieredkv.backends.redis.RedisTier`: a pipeline per node, run
concurrently, that follows the cluster's redirections with bounded retries.

Primitives:

* :class:`ClusterBatches` — runs one batch (``add(pipe, i)`` queues key ``i``'s commands).
* :class:`AskingPipeline` — a redis-py cluster pipeline that sends each command to one node with
  ``ASKING`` just before it, on the same connection.

A batch is split by the node that owns each key's slot (redis-py's slot map) and each node's share
goes out as one redis-py ``ClusterPipeline`` with ``allow_redirections=False``, so every reply
comes back as it is, and each key is then handled by its reply:

* ``-MOVED slot host:port`` (the slot has a new owner): the slot map is patched
  (``NodesManager.move_slot``, as redis-py does) and the key resent at once to the new owner.
* ``-ASK slot host:port`` (the slot is migrating and the key is not on the source any more): the
  key is resent to that node as ``ASKING`` + the command, on one connection, in one pipeline per
  node for every asked key of the round. The slot map is left as it is (the source still owns it).
* ``-TRYAGAIN`` (a multi-key command whose keys are split by a migration in progress): resent
  after a backoff (10 ms, doubling, at most 100 ms) to where it went. A key redirected more than
  three times (masters whose views of the slot disagree for a moment) waits the same way.
* a node that cannot be reached, times out or answers ``CLUSTERDOWN``: its keys are resent after
  a topology refresh, but a node is sent to at most :data:`NODE_TRIES` times after it failed, so
  a dead master fails fast and costs only its own keys.

Bounded: at most :data:`ROUNDS` sends of a key, and no retry round starts after the batch's
budget (half the tier's ``op_timeout_s``: what is left of the deadline then bounds the last round,
each send bounded by the socket timeouts). A key still unserved keeps its last reply (an error).

Why not redis-py's own redirect handling (``allow_redirections=True``, the default): it resends
each redirected command alone (a round trip per key) through ``RedisCluster._execute_command``,
whose ``ASK`` branch sends ``ASKING`` as a command of its own, on a connection taken from the
node's free list and put back at its end, then the command on the next free connection. With two
or more free connections the command goes out without its ``ASKING``: the importing node answers
``MOVED`` back to the source, which answers ``ASK`` again, until ``ClusterError: TTL exhausted``
after 16 sends, unless the rotation happens to land the command on a connection where an earlier
``ASKING`` was left (redis-py 8.2.0: a plain ``RedisCluster.get`` of a migrated key fails every
time the importing node has an even number of free connections, never with an odd number). Its
``TRYAGAIN`` branch spins through its 16 sends in about 0.4 s (no pause for the first 8), shorter
than a slot holding large records takes to migrate. Under the reshard drill's load it failed about
200 operations per migration window, against none here; its connection-error retry holds an
operation on a dead master for seconds (``benchmarks/results/cluster-retry-20261206T0351Z.md``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.cluster import PRIMARY
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["NODE_TRIES", "ROUNDS", "AskingPipeline", "ClusterBatches"]

log = logging.getLogger(__name__)

#: Sends of one key at most (the first and the retries): as redis-py's ``RedisClusterRequestTTL``
#: (16) plus room for a slot that asks to TRYAGAIN for longer than redis-py's 16 quick sends.
ROUNDS = 24
#: Sends to one node after it failed, at most: the first retry after a topology refresh (a pooled
#: connection that died with a restarted node is replaced; a failed-over slot is routed to its new
#: master, which counts as another node), then none.
NODE_TRIES = 2
#: Backoff before resending keys answered TRYAGAIN, or redirected more than :data:`_FREE_HOPS`
#: times (masters whose views of a slot disagree for a moment): first, cap (doubling).
BACKOFF_S = (0.01, 0.1)
#: Redirections of a key resent at once (a MOVED, then an ASK, then one more).
_FREE_HOPS = 3

#: Replies that mean the node did not get to answer (retried like a node that failed).
_NODE_FAILED = (RedisConnectionError, RedisTimeoutError, ClusterDownError)


class AskingPipeline(ClusterPipeline):
    """A redis-py cluster pipeline whose every command goes to ``node`` with ``ASKING`` queued just
    before it: a pipeline sends all of a node's commands in order on one connection, so each
    command carries the ``ASKING`` that the importing node requires (it applies to the next
    command only). Replies come in pairs (``ASKING``'s, the command's)."""

    def __init__(self, client: RedisCluster, node: ClusterNode) -> None:
        super().__init__(client)
        self._node = node

    def execute_command(self, *args: Any, **kwargs: Any) -> ClusterPipeline:
        super().execute_command("ASKING", target_nodes=self._node)
        return super().execute_command(*args, **kwargs, target_nodes=self._node)


class ClusterBatches:
    """Runs the tier's batches on a Redis Cluster (see the module docstring).

    Args:
        client: the tier's redis-py ``RedisCluster`` (open).
        name: the tier's name, for logs.
        budget_s: no retry round of a batch starts later than this after the batch began.
        count: ``count(counter, n)``: the tier's counters (``cluster_moved``, ``cluster_ask``,
            ``cluster_tryagain``: keys redirected so).
        pipeline: makes the pipeline of a node's keys (default: ``client.pipeline()``).
    """

    def __init__(
        self,
        client: RedisCluster,
        *,
        name: str,
        budget_s: float,
        count: Callable[[str, int], None],
        pipeline: Callable[[], ClusterPipeline] | None = None,
    ) -> None:
        self.client = client
        self.name = name
        self.budget_s = budget_s
        self._count = count
        self._pipeline = pipeline or (lambda: client.pipeline())

    def by_node(self, rkeys: list[bytes], todo: list[int]) -> dict[str, list[int]]:
        """Indices ``todo`` of ``rkeys`` grouped by the name of the node owning their slot, from the
        client's slot map (``"?"``: a slot no node covers)."""
        groups: dict[str, list[int]] = {}
        for i in todo:
            try:
                node = self.client.get_node_from_key(rkeys[i])  # type: ignore[arg-type]  # bytes keys
                name = node.name if node is not None else "?"
            except RedisClusterException:
                name = "?"
            groups.setdefault(name, []).append(i)
        return groups

    async def refresh(self, failed_node: str | None = None) -> None:
        """Re-read the cluster's slot map (redis-py marks pooled connections for a lazy reconnect,
        never closing one in use). A failure is left to the retry that follows to report."""
        nodes = self.client.nodes_manager
        try:
            try:
                await nodes.initialize(last_failed_node_name=failed_node)
            except TypeError:  # redis-py without last_failed_node_name
                await nodes.initialize()
        except (RedisError, OSError) as e:
            log.debug("tier %s: cluster topology refresh failed: %s", self.name, e)

    def _asked_node(self, host: str, port: int) -> ClusterNode:
        """The node an ASK names; one the client does not know (a master added without slots, the
        usual target of a reshard, is in no slot map) is added to its nodes, as redis-py's
        ``move_slot`` does for MOVED."""
        nodes = self.client.nodes_manager
        host, port = nodes.remap_host_port(host, port)
        node: ClusterNode | None = self.client.get_node(host=host, port=port)
        if node is None:
            node = ClusterNode(host, port, PRIMARY, **nodes.connection_kwargs)
            nodes.set_nodes(nodes.nodes_cache, {node.name: node})
        return node

    async def run(
        self, rkeys: list[bytes], add: Callable[[Any, int], Any], *, ncmd: int = 1
    ) -> tuple[list[Any], dict[int, BaseException]]:
        """``ncmd`` commands per key (``add(pipe, i)`` queues them for ``rkeys[i]``).

        Returns each key's reply (a tuple of ``ncmd`` replies when ``ncmd > 1``; an exception
        object for a command the server refused or that could not be served), and the keys whose
        node failed on their last send, with the error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget_s
        out: list[Any] = [None] * len(rkeys)
        down: dict[int, BaseException] = {}  # key index -> its node's failure (last send)
        failures: dict[str, int] = {}  # node name -> sends to it that failed
        asked: dict[int, tuple[str, int]] = {}  # key index -> the node an ASK sent it to
        todo = list(range(len(rkeys)))
        hops: dict[int, int] = {}  # key index -> MOVED / ASK redirections so far
        waits = 0  # backoffs so far
        for rnd in range(ROUNDS):
            groups: dict[tuple[str, bool], list[int]] = {}  # (node name, asking) -> key indices
            targets: dict[str, ClusterNode] = {}
            plain: list[int] = []
            for i in todo:
                if i in asked:
                    node = self._asked_node(*asked[i])
                    targets[node.name] = node
                    groups.setdefault((node.name, True), []).append(i)
                else:
                    plain.append(i)
            for name, idx in self.by_node(rkeys, plain).items():
                groups[(name, False)] = idx
            groups = {k: v for k, v in groups.items() if failures.get(k[0], 0) < NODE_TRIES}
            if not groups:
                break

            results = await asyncio.gather(
                *(self._send(targets[n] if a else None, idx, add) for (n, a), idx in groups.items()),
                return_exceptions=True,
            )
            again: list[int] = []
            failed: list[str] = []
            moved: dict[int, tuple[MovedError, str]] = {}  # slot -> a MOVED for it, the node that sent it
            pause = False  # a TRYAGAIN, or a key redirected over and over (nodes that disagree)
            for ((name, _), idx), res in zip(groups.items(), results, strict=True):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                if isinstance(res, BaseException):
                    for i in idx:
                        out[i] = down[i] = res
                        asked.pop(i, None)
                    failed.append(name)
                    again.extend(idx)
                    continue
                node_failed = False
                for j, i in enumerate(idx):
                    v = res[j] if ncmd == 1 else tuple(res[j * ncmd : (j + 1) * ncmd])
                    out[i] = v
                    down.pop(i, None)
                    replies = v if ncmd > 1 else (v,)
                    if mv := next((x for x in replies if isinstance(x, MovedError)), None):
                        moved[mv.slot_id] = (mv, name)
                        asked.pop(i, None)
                        hops[i] = hops.get(i, 0) + 1
                        pause |= hops[i] > _FREE_HOPS
                        self._count("cluster_moved", 1)
                    elif ask := next((x for x in replies if isinstance(x, AskError)), None):
                        asked[i] = (ask.host or self._host_of(name), ask.port)
                        hops[i] = hops.get(i, 0) + 1
                        pause |= hops[i] > _FREE_HOPS
                        self._count("cluster_ask", 1)
                    elif any(isinstance(x, TryAgainError) for x in replies):
                        pause = True
                        self._count("cluster_tryagain", 1)
                    elif any(_node_failed(x) for x in replies):
                        node_failed = True
                        asked.pop(i, None)
                    else:
                        continue
                    again.append(i)
                if node_failed:
                    failed.append(name)
            for name in set(failed):
                failures[name] = failures.get(name, 0) + 1
            if not again or rnd == ROUNDS - 1 or loop.time() >= deadline:
                break
            for e, sender in moved.values():
                if not e.host:  # a node with an unknown endpoint redirects with only a port
                    e.host = self._host_of(sender)
                await self.client.nodes_manager.move_slot(e)
            if failed:
                await self.refresh(failed[0])
            if pause:
                first, cap = BACKOFF_S
                await asyncio.sleep(max(0.0, min(first * 2**waits, cap, deadline - loop.time())))
                waits += 1
            todo = again
        return out, down

    async def _send(self, asking: ClusterNode | None, idx: list[int], add: Callable[[Any, int], Any]) -> list[Any]:
        """One pipeline of the keys ``idx``: routed by the slot map, or to ``asking`` with ASKING."""
        # (redis-py's typing marks a base attribute abstract that ClusterPipeline sets at runtime)
        pipe = AskingPipeline(self.client, asking) if asking is not None else self._pipeline()  # type: ignore[abstract]
        for i in idx:
            add(pipe, i)
        res: list[Any] = await pipe.execute(raise_on_error=False, allow_redirections=False)
        return res[1::2] if asking is not None else res

    @staticmethod
    def _host_of(node_name: str) -> str:
        return node_name.rpartition(":")[0]


def _node_failed(reply: Any) -> bool:
    return isinstance(reply, _NODE_FAILED) and not isinstance(reply, RedisCluster.NOT_NODE_FAILURE_ERRORS)

"""Slot migration by hand on a test Redis Cluster: plain connections to each node for ``CLUSTER
SETSLOT`` / ``GETKEYSINSLOT``, ``MIGRATE`` and ``INFO errorstats`` (which counts the ``MOVED`` /
``ASK`` / ``TRYAGAIN`` replies a node sent, so a test can tell that it met them)."""

from __future__ import annotations

import redis

from tieredkv.testing.servers import HOST, RedisCluster


class ClusterAdmin:
    """Admin connections to every node of ``cluster`` (``close()`` them)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.ports = [p for _, p in cluster.nodes]
        self.r = {p: redis.Redis(host=HOST, port=p, socket_timeout=10.0) for p in self.ports}
        self.ids = {p: self.r[p].execute_command("CLUSTER", "MYID").decode() for p in self.ports}

    def slots(self, port: int | None = None) -> dict[int, list[tuple[int, int]]]:
        """``{master port: its slot ranges}`` as node ``port`` (the first by default) sees them."""
        out: dict[int, list[tuple[int, int]]] = {}
        for line in self.r[port or self.ports[0]].execute_command("CLUSTER", "NODES").decode().splitlines():
            f = line.split()
            ranges = out.setdefault(int(f[1].split("@")[0].rsplit(":", 1)[1]), [])
            for s in f[8:]:
                if not s.startswith("["):  # "[slot->-id]": a slot being migrated or imported
                    a, _, b = s.partition("-")
                    ranges.append((int(a), int(b or a)))
        return out

    def owner(self, slot: int, port: int | None = None) -> int:
        """The port of the master that node ``port`` (the first by default) says owns ``slot``."""
        for p, ranges in self.slots(port).items():
            if any(a <= slot <= b for a, b in ranges):
                return p
        raise AssertionError(f"no node owns slot {slot}")

    def errorstats(self, ports: list[int] | None = None) -> dict[str, int]:
        """``{error code: replies}`` summed over ``ports`` (every node by default)."""
        out: dict[str, int] = {}
        for p in ports or self.ports:
            for name, v in self.r[p].info("errorstats").items():
                code = name.removeprefix("errorstat_")
                out[code] = out.get(code, 0) + int(v["count"])
        return out

    def start(self, slot: int, src: int, dst: int) -> None:
        """``slot`` IMPORTING on ``dst``, MIGRATING on ``src``."""
        self.r[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[src])
        self.r[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[dst])

    def migrate(self, src: int, dst: int, keys: list[bytes]) -> None:
        if keys:
            self.r[src].execute_command("MIGRATE", HOST, dst, "", 0, 10_000, "KEYS", *keys)

    def finish(self, slot: int, src: int, dst: int) -> None:
        """The rest of ``slot``'s keys to ``dst``, then the slot given to ``dst`` on every node."""
        while rest := sorted(self.keys_in_slot(src, slot)):
            self.migrate(src, dst, rest)
        for p in [dst, src, *(p for p in self.ports if p not in (src, dst))]:
            self.r[p].execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[dst])

    def keys_in_slot(self, port: int, slot: int) -> set[bytes]:
        """The keys of ``slot`` that node ``port`` holds itself (no redirection)."""
        return set(self.r[port].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000))

    def close(self) -> None:
        for r in self.r.values():
            r.close()

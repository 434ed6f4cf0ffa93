"""Local Redis Clusters on loopback: :class:`RedisCluster` (owned by a Python object, for
tests and benchmarks) and the detached cluster behind ``tieredkv cluster up`` / ``down``
(recorded in a state directory). Built on :mod:`tieredkv.localredis`;
:mod:`tieredkv.testing.servers` re-exports it.

Primitives:

* :class:`RedisCluster` — a 3-master Redis Cluster on local ports, created with
  ``redis-cli --cluster create``; ready when every node says ``cluster_state:ok``.
* :func:`start_detached_cluster` / :func:`stop_detached_cluster` /
  :func:`detached_cluster_state` — the cluster behind ``tieredkv cluster up`` / ``down``.

Every wait is bounded; a node that does not come up raises :class:`RuntimeError` with
the tail of its log. Nothing here needs redis-py: readiness checks speak RESP over a plain
socket. A missing ``redis-server`` / ``redis-cli`` is an error, never a skip.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tieredkv.localredis import HOST, RedisServer, free_port, log_tail, redis_command, which_or_fail

__all__ = [
    "CLUSTER_STATE_FILE",
    "RedisCluster",
    "detached_cluster_state",
    "start_detached_cluster",
    "stop_detached_cluster",
]

CLUSTER_BUS_OFFSET = 10000


class RedisCluster:
    """A Redis Cluster of ``masters`` primaries (no replicas) on 127.0.0.1.

    Ports are at most 55535 so each node's cluster bus (``port + 10000``) is a valid port.

    Example::

        with RedisCluster() as c:
            tier = RedisTier(RedisTierConfig(url=c.url, cluster=True))
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        extra_args: list[str] | None = None,
        startup_timeout: float = 20.0,
        node_timeout_ms: int = 5000,
    ) -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        self.masters = masters
        self.extra_args = list(extra_args or [])
        self.startup_timeout = startup_timeout
        self.node_timeout_ms = node_timeout_ms
        self.servers: list[RedisServer] = []

    @property
    def nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node."""
        return [(s.host, s.port) for s in self.servers]

    @property
    def url(self) -> str:
        """URL of the first node; a cluster client discovers the others from it."""
        if not self.servers:
            raise RuntimeError("RedisCluster is not started")
        host, port = self.nodes[0]
        return f"redis://{host}:{port}"

    def start(self) -> RedisCluster:
        """Start the nodes, create the cluster and wait for ``cluster_state:ok`` everywhere.

        Raises:
            RuntimeError: a tool is missing, a node did not start, cluster creation failed,
                or the cluster did not converge in time.
        """
        if self.servers:
            return self
        cli = which_or_fail("redis-cli")
        which_or_fail("redis-server")
        try:
            for _ in range(self.masters):
                self.servers.append(self._node().start())
            self._create(cli)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _node(self) -> RedisServer:
        # A cache keeps serving the slots still covered when a master is gone.
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-require-full-coverage",
            "no",
        ]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms), *self.extra_args]
        srv = RedisServer(extra_args=args, startup_timeout=self.startup_timeout)
        srv._bus_offset = CLUSTER_BUS_OFFSET
        return srv

    def _create(self, cli: str) -> None:
        argv = [cli, "--cluster", "create", *(f"{h}:{p}" for h, p in self.nodes)]
        argv += ["--cluster-replicas", "0", "--cluster-yes"]
        try:
            res = subprocess.run(
                argv, capture_output=True, timeout=self.startup_timeout, stdin=subprocess.DEVNULL, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"redis-cli --cluster create timed out after {self.startup_timeout}s") from e
        out = (res.stdout + res.stderr).decode(errors="replace")
        if res.returncode != 0 or "All 16384 slots covered" not in out:
            raise RuntimeError(f"redis-cli --cluster create failed (rc={res.returncode}):\n{out[-2000:]}")

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pending = list(self.servers)
        info = ""
        while pending and time.monotonic() < deadline:
            srv = pending[0]
            try:
                info = redis_command(srv.port, "CLUSTER", "INFO", timeout=1.0).decode(errors="replace")
            except OSError as e:
                info = str(e)
            if "cluster_state:ok" in info and f"cluster_known_nodes:{self.masters}" in info:
                pending.pop(0)
            else:
                time.sleep(0.05)
        if pending:
            srv = pending[0]
            raise RuntimeError(
                f"Redis Cluster node {srv.port} not ok within {self.startup_timeout}s:\n{info}\n"
                f"log tail:\n{log_tail(srv.log_path)}"
            )

    def stop(self) -> None:
        """Stop every node and remove their dirs."""
        servers, self.servers = self.servers, []
        for srv in servers:
            srv.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisCluster(nodes={[p for _, p in self.nodes]})"


# ---- detached cluster (``tieredkv cluster up`` / ``down``) -------------------------------
#
# Unlike RedisServer / RedisCluster (owned by a Python object, killed when it goes away),
# these nodes are daemonized ``redis-server`` processes that outlive the command that
# started them. Their pids and ports are kept in ``<state_dir>/cluster.json`` so that
# ``stop_detached_cluster`` can stop exactly those processes, by pid, later.

CLUSTER_STATE_FILE = "cluster.json"


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _is_our_redis(pid: int, port: int) -> bool:
    """Whether ``pid`` is a redis-server listening on ``port`` (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"redis-server" in cmdline and f":{port}".encode() in cmdline


def _listenable(port: int, host: str = HOST) -> bool:
    """Whether a server could listen on ``port`` now (as redis-server does, with SO_REUSEADDR,
    so sockets of a just-stopped server in TIME_WAIT do not count as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def detached_cluster_state(state_dir: str | Path) -> dict[str, Any] | None:
    """The saved state of a detached cluster in ``state_dir``, or ``None`` if there is none."""
    import json

    path = Path(state_dir) / CLUSTER_STATE_FILE
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def start_detached_cluster(
    state_dir: str | Path,
    masters: int = 3,
    base_port: int | None = 7001,
    *,
    host: str = HOST,
    startup_timeout: float = 20.0,
    node_timeout_ms: int = 5000,
) -> dict[str, Any]:
    """Start a ``masters``-node Redis Cluster of daemonized servers; return its saved state.

    Nodes listen on ``base_port .. base_port + masters - 1`` (``None`` or ``0``: free ports),
    keep their files under ``state_dir/node-PORT`` and survive this process. The state
    (``url``, ``nodes`` with ``port`` and ``pid``) is written to ``state_dir/cluster.json``.

    Raises:
        RuntimeError: a cluster is already recorded in ``state_dir`` and running, a port is
            taken, a tool is missing, or the cluster did not come up (nodes already started
            are stopped again).
    """
    import json

    if masters < 3:
        raise RuntimeError(f"a Redis Cluster needs at least 3 masters, got {masters}")
    state_dir = Path(state_dir).resolve()
    old = detached_cluster_state(state_dir)
    if old and any(_pid_alive(n["pid"]) and _is_our_redis(n["pid"], n["port"]) for n in old.get("nodes", [])):
        raise RuntimeError(f"a cluster recorded in {state_dir} is still running ({old.get('url')}); stop it first")
    exe = which_or_fail("redis-server")
    cli = which_or_fail("redis-cli")
    ports: list[int] = []
    for i in range(masters):
        if base_port:
            port = base_port + i
            if port + CLUSTER_BUS_OFFSET > 65535:
                raise RuntimeError(f"port {port}: its cluster bus port {port + CLUSTER_BUS_OFFSET} is above 65535")
            if not (_listenable(port, host) and _listenable(port + CLUSTER_BUS_OFFSET, host)):
                raise RuntimeError(
                    f"port {port} or its cluster bus port {port + CLUSTER_BUS_OFFSET} is in use on {host};"
                    " choose another --base-port (or 0 for free ports)"
                )
        else:
            port = free_port(bus_offset=CLUSTER_BUS_OFFSET)
            while port in ports:
                port = free_port(bus_offset=CLUSTER_BUS_OFFSET)
        ports.append(port)
    state_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"host": host, "url": f"redis://{host}:{ports[0]}/0", "nodes": []}
    try:
        for port in ports:
            state["nodes"].append(_start_daemon(exe, state_dir, host, port, node_timeout_ms, startup_timeout))
            (state_dir / CLUSTER_STATE_FILE).write_text(json.dumps(state, indent=2))
        argv = [cli, "--cluster", "create", *(f"{host}:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"]
        res = subprocess.run(argv, capture_output=True, timeout=startup_timeout, stdin=subprocess.DEVNULL, check=False)
        text = (res.stdout + res.stderr).decode(errors="replace")
        if res.returncode != 0 or "All 16384 slots covered" not in text:
            raise RuntimeError(f"redis-cli --cluster create failed (rc={res.returncode}):\n{text[-2000:]}")
        _wait_cluster_ok(host, ports, masters, startup_timeout)
    except BaseException:
        stop_detached_cluster(state_dir)
        raise
    return state


def _start_daemon(
    exe: str, state_dir: Path, host: str, port: int, node_timeout_ms: int, timeout: float
) -> dict[str, Any]:
    node_dir = state_dir / f"node-{port}"
    node_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("nodes.conf", "redis.pid"):
        (node_dir / stale).unlink(missing_ok=True)
    log_path = node_dir / "redis.log"
    argv = [
        exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
        "--dir", str(node_dir), "--logfile", str(log_path), "--pidfile", str(node_dir / "redis.pid"),
        "--daemonize", "yes", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no",
    ]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"redis-server on port {port} failed to start:\n{log_tail(log_path)}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int((node_dir / "redis.pid").read_text().strip())
            if redis_command(port, "PING", host=host, timeout=1.0).startswith(b"+PONG"):
                return {"port": port, "pid": pid, "dir": str(node_dir)}
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout}s:\n{log_tail(log_path)}")


def _wait_cluster_ok(host: str, ports: list[int], masters: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(ports)
    info = ""
    while pending and time.monotonic() < deadline:
        try:
            info = redis_command(pending[0], "CLUSTER", "INFO", host=host, timeout=1.0).decode(errors="replace")
        except OSError as e:
            info = str(e)
        if "cluster_state:ok" in info and f"cluster_known_nodes:{masters}" in info:
            pending.pop(0)
        else:
            time.sleep(0.05)
    if pending:
        raise RuntimeError(f"Redis Cluster node {pending[0]} not ok within {timeout}s:\n{info}")


def stop_detached_cluster(state_dir: str | Path, timeout: float = 10.0) -> list[int]:
    """Stop the nodes recorded in ``state_dir`` (SIGTERM, then SIGKILL) and remove their files.

    Only a pid that is still a ``redis-server`` on its recorded port is signalled. Returns
    the pids that were running and are now stopped; ``[]`` when nothing was recorded.
    """
    import os

    state_dir = Path(state_dir)
    state = detached_cluster_state(state_dir)
    if state is None:
        return []
    stopped: list[int] = []
    nodes = state.get("nodes", [])
    for node in nodes:
        pid, port = int(node["pid"]), int(node["port"])
        if _pid_alive(pid) and _is_our_redis(pid, port):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
    deadline = time.monotonic() + timeout
    for pid in stopped:
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            kill_deadline = time.monotonic() + timeout
            while _pid_alive(pid) and time.monotonic() < kill_deadline:
                time.sleep(0.02)
    for node in nodes:
        shutil.rmtree(node.get("dir") or state_dir / f"node-{node['port']}", ignore_errors=True)
    (state_dir / CLUSTER_STATE_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        state_dir.rmdir()  # only if now empty
    return stopped

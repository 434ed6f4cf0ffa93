"""Redis processes on loopback: throw-away servers for tests, free ports, and a tiny RESP
command helper. Lives outside :mod:`tieredkv.testing` because the CLI uses it (through
:mod:`tieredkv.localcluster`); :mod:`tieredkv.testing.servers` re-exports it.

Primitives:

* :func:`free_port` — a TCP port on 127.0.0.1 that is free now (optionally with its
  cluster-bus twin ``port + 10000`` free too).
* :class:`RedisServer` — one ``redis-server`` in its own temp dir, no persistence; start,
  stop, SIGKILL (for fault tests) and restart on the same port; a context manager.
* :func:`redis_command` — one command over a fresh socket, for readiness checks and setup.

The local Redis Cluster (:class:`~tieredkv.localcluster.RedisCluster`) and the detached
``tieredkv cluster up`` / ``down`` cluster live in :mod:`tieredkv.localcluster`.

Every wait is bounded; a server that does not come up raises :class:`RuntimeError` with
the tail of its log. Nothing here needs redis-py: readiness checks speak RESP over a plain
socket. A missing ``redis-server`` / ``redis-cli`` is an error, never a skip.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

__all__ = [
    "RedisServer",
    "free_port",
    "redis_command",
]

INSTALL_HINT = "apt-get install -y redis-server redis-tools"
HOST = "127.0.0.1"
_MIN_PORT = 10000


def which_or_fail(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name!r} is not on PATH; install it with: {INSTALL_HINT}")
    return path


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """Lowest port of the kernel's ephemeral range (outgoing connections take those)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(max_port: int = 55535, *, bus_offset: int | None = None) -> int:
    """A port on 127.0.0.1 that is free now, at most ``max_port``.

    Ports are drawn at random (below the ephemeral range when there is room), so parallel
    test runs rarely collide. With ``bus_offset`` the port ``port + bus_offset`` must be free
    too (Redis Cluster's bus uses ``port + 10000``).

    Raises:
        RuntimeError: no free port found after many tries.
    """
    high = min(max_port, _ephemeral_low() - 1)
    if high - _MIN_PORT < 1000:
        high = max_port
    for _ in range(500):
        port = random.randint(_MIN_PORT, high)
        if bus_offset is not None and port + bus_offset > 65535:
            continue
        if _bindable(port) and (bus_offset is None or _bindable(port + bus_offset)):
            return port
    raise RuntimeError(f"no free TCP port found in {_MIN_PORT}..{high}")


def _encode_command(args: Sequence[str | bytes | int]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _read_reply(sock: socket.socket) -> bytes:
    """Read one RESP reply of a simple kind (status, error, integer or bulk string)."""
    buf = b""
    while b"\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before a reply")
        buf += chunk
    line, _, rest = buf.partition(b"\r\n")
    if line[:1] != b"$":
        return line
    n = int(line[1:])
    if n < 0:
        return b""
    while len(rest) < n + 2:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed inside a bulk reply")
        rest += chunk
    return rest[:n]


def redis_command(
    port: int,
    *args: str | bytes | int,
    host: str = HOST,
    password: str | None = None,
    timeout: float = 2.0,
) -> bytes:
    """Send one command over a fresh connection and return its raw reply.

    Status and error replies come back with their ``+`` / ``-`` marker; bulk strings come
    back as their content. Meant for readiness checks and test setup, not for data.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        if password is not None:
            sock.sendall(_encode_command(["AUTH", password]))
            reply = _read_reply(sock)
            if not reply.startswith(b"+OK"):
                return reply
        sock.sendall(_encode_command(args))
        return _read_reply(sock)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _stop_process(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def _kill_quietly(proc: subprocess.Popen[bytes]) -> None:
    """Finalizer: never leave a server running after the interpreter exits."""
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 with no persistence, in its own temp dir.

    Args:
        maxmemory: ``maxmemory`` value (``"2mb"``); ``None`` leaves it unlimited.
        maxmemory_policy: e.g. ``"noeviction"`` or ``"allkeys-lru"``.
        requirepass: password clients must AUTH with.
        extra_args: more ``redis-server`` arguments (``["--user", "alice on >pw ~* +@all"]``).
        port: fixed port; by default a free one is chosen (and re-chosen if taken at start).
        startup_timeout: seconds to wait for PING to answer.

    Example::

        with RedisServer(maxmemory="4mb", maxmemory_policy="noeviction") as srv:
            tier = RedisTier(RedisTierConfig(url=srv.url))
    """

    def __init__(
        self,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        requirepass: str | None = None,
        extra_args: list[str] | None = None,
        *,
        port: int | None = None,
        startup_timeout: float = 15.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.host = HOST
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.requirepass = requirepass
        self.extra_args = list(extra_args or [])
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._fixed_port = port is not None
        self._port: int | None = port
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._bus_offset: int | None = None  # set by RedisCluster

    # ---- properties ------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisServer is not started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (no credentials; pass ``password`` in the tier config)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def dir(self) -> Path:
        """The server's working directory (log, cluster config)."""
        if self._dir is None:
            raise RuntimeError("RedisServer is not started")
        return self._dir

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; returns ``self``.

        Raises:
            RuntimeError: ``redis-server`` is missing, or it did not come up in time
                (the message carries the log tail).
        """
        if self.running:
            return self
        exe = which_or_fail("redis-server")
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="tieredkv-redis-"))
        attempts = 1 if self._fixed_port else 5
        for attempt in range(attempts):
            if self._port is None:
                self._port = free_port(bus_offset=self._bus_offset)
            try:
                self._launch(exe)
                return self
            except _PortTaken:
                if attempt == attempts - 1:
                    raise RuntimeError(
                        f"redis-server could not bind port {self._port}:\n{log_tail(self.log_path)}"
                    ) from None
                self._port = None
        return self  # pragma: no cover - loop always returns or raises

    def _argv(self, exe: str) -> list[str]:
        argv = [
            exe,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.maxmemory is not None:
            argv += ["--maxmemory", str(self.maxmemory)]
        if self.maxmemory_policy is not None:
            argv += ["--maxmemory-policy", self.maxmemory_policy]
        if self.requirepass is not None:
            argv += ["--requirepass", self.requirepass]
        return argv + self.extra_args

    def _launch(self, exe: str) -> None:
        self.log_path.write_bytes(b"")
        self._proc = subprocess.Popen(
            self._argv(exe),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
        )
        self._finalizer = weakref.finalize(self, _kill_quietly, self._proc)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = ""
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                log = log_tail(self.log_path)
                if "Address already in use" in log and not self._fixed_port:
                    raise _PortTaken
                raise RuntimeError(f"redis-server exited with code {self._proc.returncode}:\n{log}")
            try:
                reply = redis_command(self.port, "PING", password=self.requirepass, timeout=1.0)
                if reply.startswith(b"+PONG"):
                    return
                last = reply.decode(errors="replace")
            except OSError as e:
                last = str(e)
            time.sleep(0.02)
        _stop_process(self._proc, self.stop_timeout)
        raise RuntimeError(
            f"redis-server on port {self._port} did not answer PING within {self.startup_timeout}s"
            f" (last: {last}):\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``stop_timeout``) and remove its dir."""
        self._halt()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _halt(self) -> None:
        _stop_process(self._proc, self.stop_timeout)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests); its dir and port are kept for restart."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=self.stop_timeout)
        self._halt()

    def restart(self) -> RedisServer:
        """Stop the process if it runs, then start it again on the same port (data is lost)."""
        self._halt()
        fixed = self._fixed_port
        self._fixed_port = True
        try:
            return self.start()
        finally:
            self._fixed_port = fixed

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer(port={self._port}, {state})"


class _PortTaken(Exception):
    pass

"""Helpers shared by the drills: deterministic keys and payloads, the drill report line, and a
child process whose output lines are collected as they come."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tieredkv.keys import Namespace

NS = Namespace(model="drills/reliability")
_HEAD = struct.Struct("<QQ")  # seq, key index


def skey(i: int, group: int | None = None, ns: Namespace = NS) -> bytes:
    """The stored key of index ``i`` (group defaults to ``i % 3``); block hashes look random, as
    real ones do, so Redis hash-tag buckets and cluster slots spread."""
    return ns.key(block_hash(i), i % 3 if group is None else group)


def block_hash(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest()


def payload(i: int, seq: int, size: int | None = None) -> bytes:
    """Deterministic bytes for key ``i`` written at version ``seq``; the first 16 bytes say which."""
    n = size if size is not None else 256 + (i * 7919 + seq * 104729) % (12 << 10)
    return _HEAD.pack(seq, i) + random.Random(i * 1_000_003 + seq).randbytes(max(n - _HEAD.size, 0))


def check_payload(i: int, data: bytes) -> int:
    """The version of ``data`` if it is exactly what :func:`payload` wrote for key ``i``; else raise."""
    if len(data) < _HEAD.size:
        raise AssertionError(f"key {i}: {len(data)} bytes is shorter than the drill header")
    seq, idx = _HEAD.unpack_from(data)
    if idx != i:
        raise AssertionError(f"key {i}: holds the bytes of key {idx} (seq {seq})")
    if data != payload(i, seq, len(data)):
        raise AssertionError(f"key {i}: bytes differ from what seq {seq} wrote")
    return seq


def report(name: str, **counts: object) -> str:
    """Print (and optionally append to $TIEREDKV_DRILL_REPORT) one drill summary line."""
    line = f"DRILL {name}: " + " ".join(f"{k}={v}" for k, v in counts.items())
    print(line)
    path = os.environ.get("TIEREDKV_DRILL_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return line


@contextlib.contextmanager
def small_fs(tmp_path: Path, size: str = "8m", options: str = "") -> Iterator[tuple[Path | None, str]]:
    """A tmpfs of ``size`` mounted under ``tmp_path`` (yields its path), or (None, why not).

    Root only (the drills run as root here); ``TIEREDKV_DRILL_NO_MOUNT=1`` forces the fallback."""
    mnt = tmp_path / f"smallfs{options.replace(',', '')}"
    mnt.mkdir()
    if os.environ.get("TIEREDKV_DRILL_NO_MOUNT"):
        yield None, "TIEREDKV_DRILL_NO_MOUNT is set"
        return
    if os.geteuid() != 0:
        yield None, "not root: cannot mount a small filesystem"
        return
    opts = f"size={size}" + (f",{options}" if options else "")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    if r.returncode != 0:
        yield None, f"mount -t tmpfs refused: {r.stderr.strip() or r.returncode}"
        return
    try:
        yield mnt, ""
    finally:
        umount = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=10, check=False)
        if umount.returncode:  # still busy: detach it lazily rather than leave it mounted
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10, check=False)


def wait_jobs(p: Any, ids: set[int], timeout: float = 15.0) -> dict[int, Any]:
    """Poll a pipeline until every job in ``ids`` has a result; fail (a hang or a deadlock) after ``timeout``."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while not ids <= got.keys():
        for r in p.poll_finished():
            got[r.job_id] = r
        assert time.monotonic() < deadline, f"jobs {sorted(ids - got.keys())} never finished: a hang or deadlock"
        time.sleep(0.002)
    return got


class Child:
    """A drill's child process (a writer): its stdout lines (stripped) collected by a thread as
    they come; ``ready`` is set at its ``READY`` line."""

    def __init__(self, argv: list[str], *, stdin: bool = False, stderr: bool = True, cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr else subprocess.DEVNULL,
            text=True,
            cwd=cwd,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("READY"):
                self.ready.set()

    def running(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        """What it wrote to stderr (once it has exited; "" while it runs or when not kept)."""
        if self.proc.stderr is None or self.running():
            return ""
        return self.proc.stderr.read()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait for its READY line; fail naming its last lines (and stderr, if it exited)."""
        if not self.ready.wait(timeout):
            raise AssertionError(f"the child never got ready: {self.lines[-3:]} {self.stderr()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL it (if it still runs), reap it and let its output reader finish."""
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

"""The ``fs`` tier's shared usage ledger: the bytes and records the directory holds, for every
node that mounts it.

One 48-byte file (``<path>/ledger``): magic, version, bytes used, records, when the directory
was last recounted, and an xxh3-64 of the rest. A writer takes the ledger's POSIX record lock
(``fcntl.lockf``: NFSv3 through lockd, NFSv4 natively, Lustre and CephFS with their lock
managers), reads it, makes room by evicting (its own process's view of what to evict), adds
what it is about to write, writes the ledger back, and lets go; then writes its records. So the
cap holds across nodes up to what is being written at that moment, and a deletion counts only
where ``unlink`` succeeded (two nodes evicting one record count it once).

Drift, and how it ends: a writer killed between its reservation and its rename leaves bytes
counted that are not there (the cap then holds with room to spare); a record overwritten by two
nodes at once may be counted twice. Neither makes the directory pass the cap by more than the
writes in flight. A **recount** (:meth:`~tieredkv.backends.fs.tier.FSTier.reconcile`) sets the
ledger to what the directory holds, records being written included (their size is in their
temporary name; a batch makes its temporary files before it reserves, so a reservation the
recount sees has its files seen), holding the lock through the walk (exact, where a walk without
it would miss other nodes' deletions and count their writes twice): when the ledger is missing
or damaged, when it says full and there is nothing left to evict, and every
``reconcile_interval_s`` (an hour) on whichever node notices first.

POSIX record locks belong to a process, not to a descriptor: the first ``close`` of any
descriptor of the file drops them all. So each process keeps one descriptor per ledger, shared
by all of its tiers on the directory (:func:`acquire`), and a thread lock beside it orders the
process's own writers. A lock that another node holds past ``lock_timeout_s`` refuses the store
(counted): a stuck node never hangs this one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import xxhash

__all__ = ["LedgerBusyError", "LedgerState", "SharedLedger", "acquire", "release"]

_MAGIC = b"TKVFSLDG"
_VERSION = 1
_BODY = struct.Struct("<8sIIqqd")
_SUM = struct.Struct("<Q")
SIZE = _BODY.size + _SUM.size
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class LedgerBusyError(Exception):
    """The ledger's lock was not had within the timeout."""


@dataclass(frozen=True, slots=True)
class LedgerState:
    used: int
    records: int
    reconciled_at: float


def pack(state: LedgerState) -> bytes:
    body = _BODY.pack(_MAGIC, _VERSION, 0, state.used, state.records, state.reconciled_at)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def unpack(raw: bytes) -> LedgerState | None:
    """The state in ``raw``, or None when it is not a whole, good ledger."""
    if len(raw) < SIZE:
        return None
    body = raw[: _BODY.size]
    if _SUM.unpack_from(raw, _BODY.size)[0] != xxhash.xxh3_64_intdigest(body):
        return None
    magic, version, _, used, records, at = _BODY.unpack(body)
    if magic != _MAGIC or version != _VERSION or used < 0 or records < 0:
        return None
    return LedgerState(used, records, at)


class SharedLedger:
    """One process's descriptor of one directory's ledger (see the module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.users = 0
        self.thread_lock = threading.Lock()
        #: Why the ledger is read-only here (a read-only mount, no permission), else None.
        self.read_only: str | None = None
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in _READ_ONLY:
                raise
            self.read_only = f"{e.strerror} ({path})"
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read(self) -> LedgerState | None:
        return unpack(os.pread(self.fd, SIZE, 0))

    def write(self, state: LedgerState) -> None:
        data = pack(state)
        if os.pwrite(self.fd, data, 0) != len(data):
            raise OSError(errno.EIO, f"short write of the usage ledger {self.path}")

    @contextmanager
    def locked(self, timeout: float) -> Iterator[None]:
        """Hold the ledger for this thread, against this process's other threads and every other
        process on any node; :class:`LedgerBusyError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if not self.thread_lock.acquire(timeout=timeout):
            raise LedgerBusyError(f"usage ledger {self.path}: busy in this process for {timeout}s")
        try:
            pause = 0.001
            while True:
                try:
                    fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EACCES, errno.EAGAIN):
                        raise
                if time.monotonic() >= deadline:
                    raise LedgerBusyError(f"usage ledger {self.path}: locked by another process for {timeout}s")
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)
        finally:
            self.thread_lock.release()


_open: dict[str, SharedLedger] = {}
_registry_lock = threading.Lock()


def acquire(path: str) -> SharedLedger:
    """This process's :class:`SharedLedger` of ``path``, opened on first use."""
    with _registry_lock:
        led = _open.get(path)
        if led is None:
            led = _open[path] = SharedLedger(path)
        led.users += 1
        return led


def release(led: SharedLedger) -> None:
    """One user fewer; the last one closes the descriptor."""
    with _registry_lock:
        led.users -= 1
        if led.users <= 0 and _open.get(led.path) is led:
            del _open[led.path]
            os.close(led.fd)

"""Disk space for the LMDB tier: telling a full disk from a failing one, and when spares may stay.

A full disk reaches the tier as ``ENOSPC`` or ``EDQUOT`` (a record file's write, its ``fdatasync``,
LMDB's commit), and also as ``EIO``: LMDB reports a short write at commit as ``EIO`` (its page
flush writes what fits, then fails), and some filesystems report a delayed allocation that found
no room at ``fsync`` as ``EIO``. An ``EIO`` is a full disk only when the filesystem's free space
(``os.statvfs``) is below what the write needed: a disk that fails with room to spare is an
outage, and is reported as one.

On a full disk nothing can commit, deletions included (LMDB copies the pages it changes), unless
the data file has blocks to write them to: :func:`preallocate` keeps some allocated past its end
(:func:`index_reserve`), so a full tier can still be emptied. Spare record files stay only while
the disk has room to spare (:func:`spares_fit`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from typing import Any

import lmdb

__all__ = [
    "COMMIT_MARGIN",
    "INDEX_RESERVE",
    "SPARE_FREE_FLOOR",
    "disk_full",
    "free_bytes",
    "index_reserve",
    "libc_fallocate",
    "preallocate",
    "spares_fit",
]

_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Bytes a commit may write beyond its values (copied B-tree pages, the free list, the meta
#: page): an EIO with less than this free (plus the values) is taken for a full disk.
COMMIT_MARGIN = 1 << 20
#: Spares are kept only while the filesystem has at least this much free, and at least four
#: times what they hold: on a disk short of room they are given back (see ``spares_fit``).
SPARE_FREE_FLOOR = 256 << 20
_SPARE_FREE_FACTOR = 4
#: Disk blocks kept allocated past the end of LMDB's data file (``fallocate`` with
#: ``FALLOC_FL_KEEP_SIZE``: the file's size, all LMDB sees, stays): the pages the next commits
#: write there need no new blocks, so on a full disk a deletion or an eviction still commits
#: (and frees room) where it would otherwise fail like the stores. At most this much, and at
#: most 1/32 of the filesystem (:func:`index_reserve`).
INDEX_RESERVE = 4 << 20
_INDEX_RESERVE_MIN = 256 << 10
_FALLOC_FL_KEEP_SIZE = 1


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still take on the filesystem holding ``path`` (None:
    unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _errno_of(exc: BaseException) -> int | None:
    """The errno a write failed with: an OSError's, or the one LMDB names in its message."""
    if isinstance(exc, OSError):
        return exc.errno
    if isinstance(exc, lmdb.DiskError):
        return errno.ENOSPC
    if isinstance(exc, lmdb.Error):
        text = str(exc)
        for code in (*_FULL, errno.EIO):
            if os.strerror(code) in text:
                return code
    return None


def disk_full(exc: BaseException, path: str, need: int = 0) -> bool:
    """Whether ``exc``, raised by a write of about ``need`` bytes under ``path``, means the disk
    is full: ``ENOSPC``/``EDQUOT``, or ``EIO`` while the filesystem has less free than the write
    needed (plus :data:`COMMIT_MARGIN`)."""
    code = _errno_of(exc)
    if code in _FULL:
        return True
    if code != errno.EIO:
        return False
    free = free_bytes(path)
    return free is not None and free < need + COMMIT_MARGIN


def index_reserve(path: str) -> int:
    """The bytes to keep allocated past LMDB's data file on the filesystem holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return INDEX_RESERVE
    return max(_INDEX_RESERVE_MIN, min(INDEX_RESERVE, st.f_blocks * st.f_frsize // 32))


def spares_fit(free: int | None, held: int) -> bool:
    """Whether spare files holding ``held`` bytes may stay on a filesystem with ``free`` bytes
    free: at least :data:`SPARE_FREE_FLOOR` and four times what they hold. (Unknown free space:
    they stay.)"""
    return free is None or free >= max(SPARE_FREE_FLOOR, _SPARE_FREE_FACTOR * held)


@functools.cache
def libc_fallocate() -> Any:
    """libc's ``fallocate`` (None where there is none)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def preallocate(path: str, at: int, n: int) -> int:
    """Allocate the disk blocks of ``n`` bytes at ``at`` of file ``path``, its size unchanged;
    0 when done, else the errno (``EOPNOTSUPP``: the filesystem cannot; ``ENOSPC``: the disk is
    full)."""
    fallocate = libc_fallocate()
    if fallocate is None:
        return errno.EOPNOTSUPP
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        return e.errno or errno.EIO
    try:
        if fallocate(fd, _FALLOC_FL_KEEP_SIZE, at, n) != 0:
            return ctypes.get_errno() or errno.EIO
        return 0
    finally:
        os.close(fd)

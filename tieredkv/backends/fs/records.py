"""One record file of the ``fs`` tier, written and read through ``aiofiles``.

* :func:`publish` — write a record under a temporary name in ``tmp/`` (``O_EXCL``), ``fsync``
  it in durable mode, and ``rename`` it into place: a reader on any node opens the old record or
  the whole new one, never part of one (rename is atomic on POSIX filesystems and on NFS, where
  the server does it). A write that fails removes its temporary file.
* :func:`read_into` — open (``O_NOFOLLOW``: a symlink planted in the tree is not followed),
  read header and payload into place, and hand both back for the check; a file that is gone
  (deleted or evicted by another node, ``ENOENT``/``ESTALE``) is a miss.

Each ``await`` here is one operation on the tier's I/O threads (aiofiles runs it with
``run_in_executor``): a process keeps as many file operations in flight as it has threads,
which is what a network filesystem's round trips need, and the loop never blocks on the medium.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import aiofiles
import aiofiles.os

from tieredkv.format import HEADER_SIZE

__all__ = ["GONE", "ReadResult", "publish", "read_into", "read_whole"]

#: errnos of a file that is no longer there for this reader: removed (``ENOENT``), or removed on
#: another NFS client while this one held its handle (``ESTALE``).
GONE = (errno.ENOENT, errno.ESTALE)

_fsync = aiofiles.os.wrap(os.fsync)


def _excl(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


async def _write_all(f: Any, buf: memoryview) -> None:
    while len(buf):
        n = await f.write(buf)
        if not n:
            raise OSError(errno.EIO, "write wrote nothing")
        buf = buf[n:]


async def _read_full(f: Any, buf: memoryview) -> int:
    """Fill ``buf`` from ``f``; how many bytes there were (less at the end of the file)."""
    got = 0
    while got < len(buf):
        n = await f.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


async def publish(
    tmp: str, final: str, parts: Sequence[memoryview], *, durable: bool, executor: Executor
) -> int | None:
    """Write ``parts`` as file ``final`` through ``tmp`` (see the module doc). Returns the size of
    the record it replaced (None: there was none)."""
    try:
        async with aiofiles.open(tmp, "wb", buffering=0, opener=_excl, executor=executor) as f:
            for p in parts:
                await _write_all(f, p)
            if durable:
                await _fsync(f.fileno(), executor=executor)
        try:
            old: int | None = (await aiofiles.os.stat(final, follow_symlinks=False, executor=executor)).st_size
        except FileNotFoundError:
            old = None
        try:
            await aiofiles.os.rename(tmp, final, executor=executor)
        except FileNotFoundError:  # the first record of its fan-out directory
            await aiofiles.os.makedirs(os.path.dirname(final), exist_ok=True, executor=executor)
            await aiofiles.os.rename(tmp, final, executor=executor)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return old


@dataclass(slots=True)
class ReadResult:
    """A record file read: its header, where its payload landed, how many payload bytes the file
    held, and its access and change times."""

    head: bytearray
    payload: memoryview | None  # None: the payload does not fit the destination (not read)
    size: int  # payload bytes the file holds (its size less the header)
    atime: float
    mtime: float
    short: bool  # the file ended before its size said (it cannot: a torn file is corrupt)


async def read_into(path: str, dst: memoryview | None, executor: Executor) -> ReadResult | None:
    """Read the record file ``path``: its payload into ``dst`` (into new memory when None).
    None when the file is not there; other errors (``ESTALE`` among them) raise."""
    try:
        f = await aiofiles.open(path, "rb", buffering=0, opener=_nofollow, executor=executor)
    except FileNotFoundError:
        return None  # (a stale handle raises: the tier counts it)
    try:
        st = os.fstat(f.fileno())
        n = st.st_size - HEADER_SIZE
        head = bytearray(HEADER_SIZE)
        got = await _read_full(f, memoryview(head))
        if n < 0 or got < HEADER_SIZE:
            return ReadResult(head, None, max(n, 0), st.st_atime, st.st_mtime, True)
        if dst is None:
            landed: memoryview | None = memoryview(bytearray(n))
        else:
            landed = dst[:n] if n <= len(dst) else None
        short = False
        if landed is not None:
            short = await _read_full(f, landed) != n
        return ReadResult(head, landed, n, st.st_atime, st.st_mtime, short)
    finally:
        await f.close()


async def read_whole(path: str, executor: Executor) -> bytes | None:
    """The whole file ``path`` as it is (for admin tools and repairs), None when it is not there."""
    try:
        async with aiofiles.open(path, "rb", opener=_nofollow, executor=executor) as f:
            data: bytes = await f.read()
            return data
    except FileNotFoundError:
        return None

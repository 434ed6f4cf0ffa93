"""Record files of the ``fs`` tier: written under a temporary name and renamed into place, read
and checked, a slice of a batch at a time on one of the tier's I/O threads.

* :func:`create_temps` — a batch's temporary files in ``tmp/`` made empty (``O_EXCL``), before
  the batch reserves its room: a recount that sees the reservation sees its files.
* :func:`write_slice` — each record written to its temporary file, its header and payload in
  one ``pwritev``, ``fsync``'d in durable mode, and renamed into place: a
  reader on any node opens the old record or the whole new one, never part of one (rename is
  atomic on POSIX filesystems and on NFS, where the server does it). A write that fails removes
  its temporary file.
* :func:`read_slice` — each record opened with ``O_NOFOLLOW`` (a symlink planted in the tree is
  not followed; ``O_NOATIME`` too for admin reads, which must not make a record look used),
  header and payload read in one ``preadv`` straight into the destination, and checked there (a
  damaged payload zeroed where it landed). A file that is gone (deleted or evicted by another
  node) is a miss.

The tier hands each slice to an I/O thread through aiofiles (``aiofiles.os.wrap``): one hand-off
for a slice of records, not one per file call. aiofiles' own file objects make every call a
hand-off, four for a loaded record and six for a stored one, which measured three quarters of a
64 KiB load here (``benchmarks/bench_fs_hops.py``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tieredkv.errors import CorruptRecordError
from tieredkv.format import HEADER_SIZE, decode_header, verify_parts

__all__ = ["GONE", "Loaded", "create_temps", "read_raw_slice", "read_slice", "unlink_all", "write_slice"]

#: errnos of a file that is no longer there for this reader: removed (``ENOENT``), or removed on
#: another NFS client while this one held its handle (``ESTALE``).
GONE = (errno.ENOENT, errno.ESTALE)
_O_NOATIME = getattr(os, "O_NOATIME", 0)


def _open_record(path: str, passive: bool) -> int:
    """A read descriptor of record file ``path``; ``passive``: without moving its access time
    where the kernel lets this user (``O_NOATIME``: the file's owner, or root)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    if passive and _O_NOATIME:
        try:
            return os.open(path, flags | _O_NOATIME)
        except PermissionError:
            pass
    return os.open(path, flags)


def _writev_all(fd: int, parts: Sequence[memoryview]) -> None:
    """Write ``parts`` one after another from the start of ``fd`` (a short write resumed)."""
    todo = [p for p in parts if len(p)]
    off = 0
    while todo:
        n = os.pwritev(fd, todo, off)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        off += n
        while todo and n >= len(todo[0]):
            n -= len(todo[0])
            todo.pop(0)
        if todo and n:
            todo[0] = todo[0][n:]


def write_record(tmp: str, final: str, parts: Sequence[memoryview], durable: bool) -> int | None:
    """Write ``parts`` as file ``final`` through ``tmp`` (made by :func:`create_temps`; see the
    module doc). Returns the size of the record it replaced (None: there was none)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _writev_all(fd, parts)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            old: int | None = os.lstat(final).st_size
        except FileNotFoundError:
            old = None
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # the first record of its fan-out directory
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.rename(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return old


def create_temps(paths: Sequence[str]) -> None:
    """Create each temporary file, empty; none is left when one cannot be made."""
    made: list[str] = []
    try:
        for p in paths:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
            made.append(p)
    except BaseException:
        unlink_all(made)
        raise


def unlink_all(paths: Sequence[str]) -> None:
    """Remove each file; one already gone is skipped."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def write_slice(
    items: Sequence[tuple[str, str, Sequence[memoryview]]], durable: bool
) -> list[int | None | BaseException]:
    """:func:`write_record` of each ``(tmp, final, parts)``: the size each replaced, or what it
    raised (one failure does not stop the others)."""
    out: list[int | None | BaseException] = []
    for tmp, final, parts in items:
        try:
            out.append(write_record(tmp, final, parts, durable))
        except Exception as e:  # noqa: BLE001 - handed back, the tier raises it
            out.append(e)
    return out


@dataclass(slots=True)
class Loaded:
    """One record read: the payload's length, whether it fit its destination (a record longer
    than its destination, with a good header, is not read), the new bytes when there was no
    destination, and the file's access time."""

    n: int
    fits: bool
    data: bytes | None
    atime: float


def read_record(path: str, key: bytes, dst: memoryview | None, max_payload: int) -> Loaded | None:
    """Read and check record file ``path`` for ``key``: into ``dst``, or into new bytes when None.
    None when the file is not there; :class:`CorruptRecordError` when it is not good for ``key``
    (its destination zeroed where it landed) or holds more than ``max_payload`` bytes past its
    header (no record of the tier can: nothing is allocated for it); other ``OSError``s
    (``ESTALE``) raise."""
    try:
        fd = _open_record(path, False)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        n = st.st_size - HEADER_SIZE
        if n < 0:
            raise CorruptRecordError(f"record file of {st.st_size} bytes is shorter than its header")
        if n > max_payload:
            raise CorruptRecordError(f"record file of {st.st_size} bytes is larger than the tier holds")
        head = memoryview(bytearray(HEADER_SIZE))
        buf = None
        if dst is None:
            buf = bytearray(n)
            landed: memoryview | None = memoryview(buf)
        else:
            landed = dst[:n] if n <= len(dst) else None
        got = os.preadv(fd, [head] if landed is None else [head, landed], 0)
    finally:
        os.close(fd)
    if got < HEADER_SIZE:
        raise CorruptRecordError(f"record file ends {got} bytes into its header")
    if landed is None:
        decode_header(head, n)  # a good header of a payload too long for its destination: a miss
        return Loaded(n, False, None, st.st_atime)
    try:
        if got != HEADER_SIZE + n:
            raise CorruptRecordError(f"record file holds {got - HEADER_SIZE} of its {n} payload bytes")
        verify_parts(head, landed, key)
    except CorruptRecordError:
        landed[:] = bytes(len(landed))
        raise
    return Loaded(n, True, None if buf is None else bytes(buf), st.st_atime)


def read_slice(
    items: Sequence[tuple[str, bytes, memoryview | None]], max_payload: int
) -> list[Loaded | None | BaseException]:
    """:func:`read_record` of each ``(path, key, dst)``: what it returned, or what it raised."""
    out: list[Loaded | None | BaseException] = []
    for path, key, dst in items:
        try:
            out.append(read_record(path, key, dst, max_payload))
        except Exception as e:  # noqa: BLE001 - handed back: a miss, counted, or the tier raises it
            out.append(e)
    return out


def read_raw_slice(paths: Sequence[str], max_bytes: int) -> list[bytes | None | BaseException]:
    """Each file as it is (for admin tools and repairs), without moving its access time where
    the kernel allows: None when it is not there, or what reading it raised. A file larger than
    ``max_bytes`` (no record of the tier can be: something planted or grown) gives its first
    ``max_bytes + 1`` bytes, which no check takes for a record: memory stays bounded whatever
    sits at a record's name."""
    out: list[bytes | None | BaseException] = []
    for path in paths:
        try:
            fd = _open_record(path, True)
        except FileNotFoundError:
            out.append(None)
            continue
        except OSError as e:
            out.append(e)
            continue
        try:
            size = min(os.fstat(fd).st_size, max_bytes + 1)
            data = os.pread(fd, size, 0)
            while len(data) < size:
                more = os.pread(fd, size - len(data), len(data))
                if not more:
                    break
                data += more
            out.append(data)
        except OSError as e:
            out.append(e)
        finally:
            os.close(fd)
    return out

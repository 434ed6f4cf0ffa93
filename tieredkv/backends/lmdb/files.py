"""Record files of the LMDB tier on disk: who owns one, spares, and sweeping what no one owns.

**Ownership is a lock.** A record file gets its name under ``files/`` (its token, 32 hex digits)
only from a writer that holds an exclusive ``flock`` on it, and the writer keeps the lock until the
transaction that names the file has committed, or the file is gone. Every file comes in by a rename
from ``files/spare/``, taken with the lock held (:func:`take`): a spare, or a new empty file
created there first (:func:`create`), so no file is ever under its name unlocked before its
commit. A sweeper (:func:`sweep`) removes a file no committed record names only once it holds the
file's lock (non-blocking: a locked file is skipped) and has looked again, in a transaction begun
after taking it: a writer lets go only after its commit named the file, so a file still unnamed
then is one no one will name. A writer that dies (SIGKILL included) loses its locks with its
process, so what it left is swept at once — never a file a live writer still owns, however long
its write takes. (The age rule this replaces, "unnamed and older than 60 s", removed a slow
writer's file, and one written over a spare, whose age is the spare's, at once.)

``flock`` locks belong to an open file description: they hold between processes and between
threads of one process alike, and closing another descriptor of the file (the C helper opens the
file again to write it, readers map it) leaves them alone, unlike ``fcntl`` record locks. (On NFS
``flock`` is emulated with record locks; LMDB itself does not support network filesystems.)

**Spares** (``files/spare/``): files whose records all went, kept to be written over by a later
batch. A spare is given back (removed) when it has not been taken for a while (no writer is
churning here), when the filesystem is short of free space
(:func:`~tieredkv.backends.lmdb.space.spares_fit`), and on any disk-full error. Removing one is
always safe: a writer taking it has it locked and renames it away; one that loses the race takes
another.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterable

__all__ = ["create", "give_back", "lock", "spares", "sweep", "take"]

_TOKEN_HEX = 32
_CREATE_TRIES = 16


def is_token(name: str) -> bool:
    """Whether ``name`` is a record file's name (a token in hex), not ``spare`` or anything else."""
    if len(name) != _TOKEN_HEX:
        return False
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return True


def lock(path: str) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock, or None: the file is gone, or
    someone holds it (a writer, or another sweeper)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def take(spare_dir: str, path: str, names: Iterable[str] | None = None) -> tuple[int, str] | None:
    """Rename a spare (of ``names``, else any in ``spare_dir``) to ``path`` with its lock held;
    the locked descriptor and the spare's name, or None when none could be taken (none left, or
    all taken by others)."""
    if names is None:
        try:
            names = os.listdir(spare_dir)
        except FileNotFoundError:
            return None
    for name in names:
        src = os.path.join(spare_dir, name)
        fd = lock(src)
        if fd is None:
            continue
        try:
            os.rename(src, path)
        except FileNotFoundError:  # taken (or given back) by someone else, who then let go of it
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return fd, name
    return None


def create(spare_dir: str, path: str) -> int:
    """A new empty file at ``path``, its lock held (the descriptor is returned): created in
    ``spare_dir`` under a name of its own, then taken from there like a spare. If someone takes
    or removes it first, another is made."""
    for _ in range(_CREATE_TRIES):
        name = os.urandom(_TOKEN_HEX // 2).hex()
        fd = os.open(os.path.join(spare_dir, name), os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        got = take(spare_dir, path, [name])
        if got is not None:
            return got[0]
    raise OSError(errno.EAGAIN, f"no record file could be created in {spare_dir}: each was taken first", path)


def sweep(files_dir: str, named: Callable[[], set[str]], limit: int | None = None) -> int:
    """Remove up to ``limit`` record files of ``files_dir`` that no committed record names
    (``named()``: the names the files DB holds, read in a new transaction) and no one holds;
    how many went."""
    try:
        names = [n for n in os.listdir(files_dir) if is_token(n)]
    except FileNotFoundError:
        return 0
    if not names:
        return 0
    known = named()
    held: list[tuple[str, int]] = []
    removed = 0
    try:
        for name in names:
            if limit is not None and len(held) >= limit:
                break
            if name in known:
                continue
            fd = lock(os.path.join(files_dir, name))
            if fd is not None:
                held.append((name, fd))
        if held:
            known = named()  # begun after the locks: a writer lets go only once its commit named its file
            for name, _ in held:
                if name not in known:
                    try:
                        os.unlink(os.path.join(files_dir, name))
                        removed += 1
                    except FileNotFoundError:
                        pass
    finally:
        for _, fd in held:
            os.close(fd)
    return removed


def spares(spare_dir: str) -> list[tuple[str, int, float]]:
    """Each spare: its name, the disk bytes it holds, and when it last changed hands (ctime:
    a rename sets it)."""
    out = []
    try:
        names = os.listdir(spare_dir)
    except FileNotFoundError:
        return []
    for name in names:
        try:
            st = os.stat(os.path.join(spare_dir, name))
        except FileNotFoundError:
            continue
        out.append((name, st.st_blocks * 512, st.st_ctime))
    return out


def give_back(spare_dir: str, names: Iterable[str]) -> tuple[int, int]:
    """Remove the spares ``names`` that no one is taking right now; (how many, disk bytes freed)."""
    n = freed = 0
    for name in names:
        path = os.path.join(spare_dir, name)
        fd = lock(path)
        if fd is None:
            continue
        try:
            held = os.fstat(fd).st_blocks * 512
            os.unlink(path)
            n += 1
            freed += held
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return n, freed


def idle(entries: list[tuple[str, int, float]], older_than_s: float) -> list[str]:
    """The spares of ``entries`` (from :func:`spares`) that no one took for ``older_than_s``."""
    cutoff = time.time() - older_than_s
    return [name for name, _, ctime in entries if ctime < cutoff]

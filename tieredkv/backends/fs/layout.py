"""Where the ``fs`` tier keeps things in its directory, and who owns a temporary file.

::

    <path>/
      FSTIER                      marker: {"format": "tieredkv-fs", "version": 1} (JSON)
      ledger                      the shared usage ledger (:mod:`~tieredkv.backends.fs.ledger`)
      tmp/<owner>.<seq>.<size>.<key tag>.tmp   records being written (renamed into place when whole)
      ns/<fingerprint, 32 hex>/<fan>/<chunk key, hex>.kv   one record per file

* **Fan-out.** ``fan`` is the first three hex digits of the xxh3-64 of the stored key: 4,096
  directories per namespace, made on first use, so 20 million records (1.3 TiB of 64 KiB
  chunks) put ~5,000 entries in a directory, and a small tier does not pay a directory per
  record (two levels, 65,536 directories, measured 17,000 directories for 20,000 records: 147 MB
  of directory blocks). A namespace is one subtree: ``scan(namespace)`` and
  ``tieredkv evict --namespace`` walk only it.
* **Names.** A record's file name is its chunk key (hash + group, as stored) in lower-case hex,
  so a directory listing gives back every key without opening a file. Nothing a caller passes
  becomes a path: keys are hex-encoded, and a listing takes only names of this exact shape
  (anything else under ``ns/`` is ignored: it cannot be a record of this tier).
* **Owners.** A temporary file's name starts with its writer's owner token: this host's token
  (hostname, boot id and PID namespace, hashed), the writer's PID and that process's start
  time. A sweeper on the same host can tell a dead writer's file (no such process, or another
  process under the PID) and removes it at once; a file of another host goes by age only
  (``temp_max_age_s``), as a live writer's file is never that old. The size in the name is the
  record's: a recount of the directory counts a record being written as if it were there.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import stat
from dataclasses import dataclass

import xxhash

from tieredkv.keys import FINGERPRINT_BYTES

__all__ = [
    "FORMAT",
    "MAX_NAME_KEY_BYTES",
    "Layout",
    "TempName",
    "host_token",
    "key_tag",
    "owner_alive",
    "owner_token",
]

FORMAT = {"format": "tieredkv-fs", "version": 1}
#: The longest chunk key (hash + group) a file name can hold: 2 hex digits a byte, 255-byte names.
MAX_NAME_KEY_BYTES = 120
_RECORD = re.compile(r"^([0-9a-f]{2,240})\.kv$")
_NS = re.compile(r"^[0-9a-f]{32}$")
_FAN = re.compile(r"^[0-9a-f]{3}$")
_TEMP = re.compile(r"^([0-9a-f]{16})-(\d+)-(\d+)\.(\d+)\.(\d+)(?:\.([0-9a-f]{16}))?\.tmp$")


def key_tag(key: bytes) -> str:
    """16 hex digits of the stored key's xxh3-64: its fan-out directory is the first three."""
    return xxhash.xxh3_64_hexdigest(key)


@functools.cache
def host_token() -> str:
    """16 hex digits naming this host and PID namespace: two containers on one host, or two
    hosts of one name, never share one."""
    parts = [socket.gethostname()]
    for p in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(p) if p.endswith("/pid") else open(p).read().strip())  # noqa: SIM115
        except OSError:
            parts.append("?")
    return xxhash.xxh3_64_hexdigest("\0".join(parts).encode())


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks after boot; /proc/<pid>/stat field 22), None when there
    is no such process or it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2 :].split()
    if not rest or rest[0] == b"Z":
        return None
    return int(rest[19])


def owner_token() -> str:
    """This process's owner token: ``<host>-<pid>-<start time>``."""
    pid = os.getpid()
    return f"{host_token()}-{pid}-{_start_time(pid) or 0}"


def owner_alive(host: str, pid: int, start: int) -> bool | None:
    """Whether the writer of a temporary file lives: True / False on this host, None for a file
    of another host (only its age can tell)."""
    if host != host_token():
        return None
    return _start_time(pid) == start


@dataclass(frozen=True, slots=True)
class TempName:
    """A temporary file's name taken apart."""

    host: str
    pid: int
    start: int
    seq: int
    size: int
    #: The record's :func:`key_tag` (None: a file that becomes no record: a write probe, a record
    #: moved aside by a repair).
    tag: str | None = None

    @classmethod
    def parse(cls, name: str) -> TempName | None:
        m = _TEMP.match(name)
        if m is None:
            return None
        return cls(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6])


class Layout:
    """Paths of one tier directory (absolute, symlinks in ``path`` itself resolved once)."""

    def __init__(self, path: str) -> None:
        self.root = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
        self.marker = os.path.join(self.root, "FSTIER")
        self.ledger = os.path.join(self.root, "ledger")
        self.tmp = os.path.join(self.root, "tmp")
        self.ns = os.path.join(self.root, "ns")

    def record_dir(self, key: bytes) -> str:
        return os.path.join(self.ns, key[:FINGERPRINT_BYTES].hex(), key_tag(key)[:3])

    def record_path(self, key: bytes) -> str:
        return os.path.join(self.record_dir(key), key[FINGERPRINT_BYTES:].hex() + ".kv")

    @staticmethod
    def fits(key: bytes) -> bool:
        """Whether ``key``'s file name fits a directory entry."""
        return len(key) - FINGERPRINT_BYTES <= MAX_NAME_KEY_BYTES

    def temp_path(self, owner: str, seq: int, size: int, key: bytes | None = None) -> str:
        """A temporary file's path: its owner, a sequence number, the size of the record it will
        be and, for a record, its key's :func:`key_tag` (a recount that counts the file does not
        count the record again if the file is renamed into place while the recount walks)."""
        tag = f".{key_tag(key)}" if key is not None else ""
        return os.path.join(self.tmp, f"{owner}.{seq}.{size}{tag}.tmp")

    # ---- the marker ------------------------------------------------------------------

    def ensure(self) -> None:
        """Create the directory's skeleton (idempotent; several nodes may race to)."""
        os.makedirs(self.tmp, exist_ok=True)
        os.makedirs(self.ns, exist_ok=True)
        if not os.path.exists(self.marker):
            tmp = f"{self.marker}.{owner_token()}"
            with open(tmp, "w") as f:
                json.dump(FORMAT, f)
            os.replace(tmp, self.marker)

    def check_marker(self) -> str | None:
        """Why this directory is not an ``fs`` tier of this format (None: it is, or has no marker yet)."""
        try:
            with open(self.marker) as f:
                got = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None  # (not a directory: creating the tree says so)
        except (OSError, ValueError) as e:
            return f"unreadable marker {self.marker}: {e}"
        if not isinstance(got, dict) or got.get("format") != FORMAT["format"]:
            return f"{self.root} is not a tieredkv fs tier (marker {got!r})"
        if got.get("version") != FORMAT["version"]:
            return f"{self.root} holds fs tier format version {got.get('version')}; this tieredkv reads version {FORMAT['version']}"
        return None

    # ---- listings --------------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """The namespace subtrees (32-hex names) under ``ns/``."""
        return sorted(e.name for e in _dirs(self.ns) if _NS.match(e.name))

    def walk(self, fingerprint: bytes | None = None) -> list[tuple[bytes, str, os.stat_result]]:
        """Every record file of one namespace (or all): ``(key, path, lstat)``; only regular files
        whose name is a record name and whose fan-out directory is the key's. Files that vanish
        during the walk are left out."""
        out: list[tuple[bytes, str, os.stat_result]] = []
        spaces = [fingerprint.hex()] if fingerprint is not None else self.namespaces()
        for ns in spaces:
            fp = bytes.fromhex(ns)
            top = os.path.join(self.ns, ns)
            for b in _dirs(top):
                if not _FAN.match(b.name):
                    continue
                for e in _entries(b.path):
                    m = _RECORD.match(e.name)
                    if m is None or len(m[1]) % 2:
                        continue
                    key = fp + bytes.fromhex(m[1])
                    if self.record_dir(key) != b.path:
                        continue  # a name in the wrong place: not one this tier wrote
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if _is_regular(st):
                        out.append((key, e.path, st))
        return out

    def temps(self) -> list[tuple[str, TempName | None, os.stat_result]]:
        """The files in ``tmp/``: ``(path, parsed name or None, lstat)``."""
        out = []
        for e in _entries(self.tmp):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append((e.path, TempName.parse(e.name), st))
        return out


def _is_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def _dirs(path: str) -> list[os.DirEntry[str]]:
    return [e for e in _entries(path) if e.is_dir(follow_symlinks=False)]


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []

"""The LMDB tier's layout: what each named DB holds, and the structs that pack its entries.

Named DB ``records`` (stored key → payload, a whole record, or a record's place in a record
file), named DB ``access`` (stored key → ``<d Q`` last-access Unix time, record bytes, then the
record's 64-byte header when the record is stored apart, or its place when it is in a record
file), named DB ``files`` (record file token → ``<Q`` records it still holds), named DB
``tenants`` (per-tenant bytes and records: :mod:`~tieredkv.backends.lmdb.tenants`) and, in the
main DB, ``tieredkv:used-bytes`` (``<Q``: the sum of every record's bytes, kept in the same write
transaction as the records it counts) and ``tieredkv:tenants-at`` (the transaction that last left
the tenant counters exact).

* **A record stored apart** (``put_many``): its payload alone in ``records``, its header
  (:mod:`tieredkv.format`, checksum over key, header and payload) after its access stamp. The
  two are written in one transaction, and a read checks the payload against that header. Stored
  so, py-lmdb copies each payload once, straight from the caller's buffer: a whole record would
  first have to be copied beside its header, because py-lmdb takes a value as one buffer and
  cannot reserve one to fill (measured, raw py-lmdb puts in 16 MiB transactions, 12 reps
  alternating: whole records 0.83-0.91x the bare payloads' put, apart 0.91-0.93x).
* **A record in a record file** (``put_many`` of a batch whose payloads add up to
  ``file_batch_bytes`` or more): the batch is written as one file under ``files/`` (its name a
  random 16-byte token in hex: never used twice), each record's header then its payload, one
  after another, before the transaction that enters them. A record's ``records`` value and the
  tail of its access entry name its place (:data:`PLACE`: token, offset); the ``files`` DB counts
  the records each file still holds. LMDB copies a value into a dirty page and again into the
  page cache at commit; a file is written once (measured in ``tieredkv bench``: 64 KiB-4 MiB
  stores 1.13-1.33x py-lmdb's put, against 0.68-0.79x stored apart). How the files are written,
  freed and kept: :mod:`~tieredkv.backends.lmdb.records`.
* **A record stored whole** (``raw_put_many``: migrations and tools write records as they are
  given, damaged ones included): the whole record in ``records``, the access entry its stamp
  alone. A read of any kind delivers only a payload that its header vouches for.
* **A record's tenant** is in its header (a record of the default tenant is version 1, as
  before) and, for a record in a record file, after its place in its ``records`` value
  (:mod:`~tieredkv.backends.lmdb.tenants`).

(Versions before records were stored apart cannot open an environment that holds one: they read
every access entry as 16 bytes.)
"""

from __future__ import annotations

import struct
from typing import Any

from tieredkv.format import HEADER_SIZE

__all__ = [
    "ACCESS",
    "FILED",
    "FILED_LAYOUT",
    "FILES",
    "LIVE",
    "PLACE",
    "SPARE",
    "TOKEN",
    "USED",
    "USED_KEY",
    "head_of",
    "place_of",
]

ACCESS = struct.Struct("<dQ")
USED = struct.Struct("<Q")
USED_KEY = b"tieredkv:used-bytes"  # main DB: sum of record bytes in the environment
TOKEN = 16  # bytes of a record file's name token (random: a name is never used twice)
PLACE = struct.Struct("<16sQ")  # where a record in a file is: the file's token, the record's offset
FILED = struct.Struct(ACCESS.format + PLACE.format[1:])  # a filed record's access entry: ACCESS, then PLACE
# For format.read_placed_into: a filed access entry's size, and where its record's size, file token
# and offset are in it.
FILED_LAYOUT = (FILED.size, struct.calcsize("<d"), ACCESS.size, ACCESS.size + struct.calcsize("<16s"))
LIVE = struct.Struct("<Q")  # files DB: a record file's token -> how many records it still holds
FILES = "files"  # record files, under the environment's directory
SPARE = "spare"  # record files that lost their last record, kept (in files/spare/) to be written again


def head_of(meta: Any) -> memoryview | None:
    """The record header kept in an access entry ``meta`` (None: the record is stored whole)."""
    if meta is None or len(meta) != ACCESS.size + HEADER_SIZE:
        return None
    return memoryview(meta)[ACCESS.size :]


def place_of(meta: Any) -> tuple[bytes, int] | None:
    """Where the record of access entry ``meta`` is in a record file: (the file's token, the
    record's offset); None: the record is in LMDB."""
    if meta is None or len(meta) != FILED.size:
        return None
    token, at = PLACE.unpack_from(meta, ACCESS.size)
    return token, at

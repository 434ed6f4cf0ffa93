"""The stored block record: a fixed 64-byte header, then the payload.

Header layout (little-endian, :data:`HEADER` ``struct``)::

    offset size field
    0      4    magic            b"TKVR"
    4      2    format version   1 (the default tenant) or 2 (a tenant)
    6      2    header size      64
    8      16   namespace fingerprint
    24     4    group index
    28     4    flags            bit 0: sealed (see below); others 0
    32     8    payload length
    40     8    checksum         xxh3_64 over (stored key, header bytes 0..32, [version 2: bytes
                                 48..64], payload)
    48     8    tenant           version 2: the record's tenant (:func:`tieredkv.keys.tenant_id`);
                                 version 1: zero
    56     8    reserved         (zero; a record with anything else there is corrupt)

This module is the one place the layout is written down: the optional C helper
(``tieredkv._fastrec``, docs/native.md) holds no offset of its own and takes it from
:func:`native_layout` at import.

A record of the default tenant (0) is written as version 1, byte for byte what every earlier
tieredkv wrote, so records move both ways between versions; a record with a tenant is version 2,
its tenant covered by the checksum.

A **sealed** record (version 2, flag bit 0; :mod:`tieredkv.sealing`) carries AES-256-GCM
ciphertext in place of the payload, followed by the 16-byte tag (:data:`SEAL_TAG`); its payload
length field is the plaintext's; bytes 40..47 and 56..59 hold the 96-bit nonce
(:data:`SEAL_NONCE_AT`), bytes 60..63 the id of the master key that sealed it
(:data:`SEAL_KEY_ID_AT`), and the tenant stays at 48..55. The tag, over the stored key and the
whole header as associated data, does the checksum's job. The checksum paths here refuse a
sealed record (it is corrupt to a reader without the keys).

The checksum covers the stored key as well as the payload, so a record copied or renamed
under another key fails verification: a tier can never serve bytes that were not written
for that key. Decoding never trusts the length field beyond the buffer it was given.
Stored bytes are never turned into Python objects here or anywhere in tieredkv (no object
serialization of any kind; tests/drills/test_security.py checks the source).

Buffer helpers turn bytes, bytearrays, memoryviews, NumPy arrays and contiguous CPU torch
tensors into flat writable/readable ``memoryview``\\ s of unsigned bytes without copying.
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import Any

import xxhash

from tieredkv.errors import CorruptRecordError
from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, key_fingerprint, key_group, key_header_ids

try:  # the optional C helper (setup.py, docs/native.md): faster checked copies, the same bytes
    from tieredkv import _fastrec
except ImportError:  # not built here (no C compiler at install): pure Python
    _fastrec = None

__all__ = [
    "FLAG_SEALED",
    "FORMAT_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "NATIVE",
    "SEAL_KEY_ID_AT",
    "SEAL_NONCE",
    "SEAL_NONCE_AT",
    "SEAL_TAG",
    "TENANT_AT",
    "TENANT_VERSION",
    "RecordHeader",
    "as_readable",
    "as_writable",
    "decode_header",
    "encode_heads_into",
    "encode_record",
    "encode_record_into",
    "encode_records_into",
    "make_header",
    "native_layout",
    "read_placed_into",
    "read_records_into",
    "verify_into",
    "verify_many_into",
    "verify_many_parts_into",
    "verify_parts",
    "verify_record",
    "write_records",
]

# ---- the layout: written down here only (the pure-Python paths and the C helper read it) --------

MAGIC = b"TKVR"
FORMAT_VERSION = 1
#: The version of a record with a tenant (and of a sealed record).
TENANT_VERSION = 2
#: Flag bit 0: the record is sealed (AES-256-GCM; :mod:`tieredkv.sealing`).
FLAG_SEALED = 1
HEADER = struct.Struct("<4sHH16sIIQQ16x")  # as version 1 reads it (bytes 48..63 reserved)
_HEADER2 = struct.Struct("<4sHH16sIIQQQ8x")  # every version: bytes 48..55 the tenant
HEADER_SIZE = HEADER.size
_VERSION_AT, _HSIZE_AT, _IDS_AT = 4, 6, 8  # version (u16), header size (u16), fingerprint + group
_FLAGS_AT, _LEN_AT, _SUM_AT = 28, 32, 40  # flags (u32), payload length (u64), checksum (u64)
TENANT_AT = 48  # the tenant (version 2)
_PREFIX = 32  # header bytes covered by the checksum (magic .. flags)
assert HEADER_SIZE == 64 and _HEADER2.size == HEADER_SIZE
# each offset is where _HEADER2 puts its field (the struct's format up to that field, measured)
assert [struct.calcsize(_HEADER2.format[:i]) for i in (3, 4, 5, 9, 10, 11, 12)] == [
    _VERSION_AT,
    _HSIZE_AT,
    _IDS_AT,
    _FLAGS_AT,
    _LEN_AT,
    _SUM_AT,
    TENANT_AT,
]
#: Per version: the header ranges its checksum covers (after the stored key, before the payload),
#: the range that must read back as zeros, and the flag that makes it sealed (its checksum paths
#: refuse it; a sealed record has no zero range and its payload is followed by :data:`SEAL_TAG`).
_VERSIONS: dict[int, tuple[tuple[tuple[int, int], ...], tuple[int, int], int]] = {
    FORMAT_VERSION: (((0, _PREFIX),), (TENANT_AT, HEADER_SIZE), 0),
    TENANT_VERSION: (((0, _PREFIX), (TENANT_AT, HEADER_SIZE)), (TENANT_AT + 8, HEADER_SIZE), FLAG_SEALED),
}
#: Header bytes 0..8 (magic, version, header size) of each version, to its rule as
#: :func:`verify_parts` reads it: (hashed ranges, zero range start, end, its zeros, sealed flag).
_LEADS = {
    struct.pack("<4sHH", MAGIC, v, HEADER_SIZE): (hashed, za, zb, bytes(zb - za), sealed)
    for v, (hashed, (za, zb), sealed) in _VERSIONS.items()
}
_FLAGS_LEN_SUM = struct.Struct("<IQQ")  # flags, payload length, checksum (at _FLAGS_AT)
assert _FLAGS_AT + 4 == _LEN_AT and _LEN_AT + 8 == _SUM_AT
_U64 = struct.Struct("<Q")
#: Bytes after a sealed record's ciphertext: the AES-GCM tag.
SEAL_TAG = 16
#: A sealed record's nonce: 96 bits, in header bytes 40..47 then 56..59 (around the tenant, which
#: stays where every version 2 reader looks for it).
SEAL_NONCE = 12
SEAL_NONCE_AT = ((40, 48), (56, 60))
#: Where a sealed record names the master key that sealed it: header bytes 60..63, a u32
#: (little-endian) key id (:class:`tieredkv.sealing.Keyring`).
SEAL_KEY_ID_AT = 60


def native_layout() -> dict[str, Any]:
    """The record layout as the C helper takes it (``_fastrec.set_layout(**native_layout())``, at
    import): the header's size, its magic and where it is, the (offset, width) of each integer
    field, the (start, end) of the fingerprint and the group (little-endian in the header, the
    key's last bytes big-endian), and per version its :data:`_VERSIONS` rule. The C code holds no
    offset of its own; ``_fastrec.layout()`` hands back what it took (a test compares the two)."""
    group_at = _IDS_AT + FINGERPRINT_BYTES
    return {
        "header": HEADER_SIZE,
        "magic": MAGIC,
        "magic_at": 0,
        "version": (_VERSION_AT, 2),
        "header_size": (_HSIZE_AT, 2),
        "fingerprint": (_IDS_AT, group_at),
        "group": (group_at, group_at + GROUP_BYTES),
        "flags": (_FLAGS_AT, 4),
        "length": (_LEN_AT, 8),
        "checksum": (_SUM_AT, 8),
        "versions": tuple((v, hashed, zero, sealed) for v, (hashed, zero, sealed) in _VERSIONS.items()),
    }


if _fastrec is not None:
    try:
        _fastrec.set_layout(**native_layout())
    except (AttributeError, TypeError, ValueError) as e:  # a build older (or newer) than this file
        warnings.warn(
            f"tieredkv._fastrec does not take this record layout ({e}); the pure-Python path serves "
            "until it is rebuilt (pip install -e .)",
            RuntimeWarning,
            stacklevel=1,
        )
        _fastrec = None

#: Whether records are checked by the C helper ``tieredkv._fastrec`` (checked copies of records in
#: memory and in record files, the GIL released for the copy and the checksum from 16 KiB).
NATIVE = _fastrec is not None
#: Copies at least this large go through NumPy (one memcpy, the GIL released); smaller ones are a
#: memoryview assignment (a memcpy with the GIL held, less fixed cost). Pure-Python path only.
_NUMPY_AT = 16 << 10
_np: Any = None  # NumPy, imported at the first large copy: the admin paths that import format never need it


def _copy_into(dst: Any, src: memoryview) -> None:
    """Copy ``src`` to the start of ``dst`` (a writable byte view at least as long)."""
    n = len(src)
    if n < _NUMPY_AT:
        dst[:n] = src
        return
    global _np
    if _np is None:
        import numpy

        _np = numpy
    _np.copyto(_np.frombuffer(dst, _np.uint8, n), _np.frombuffer(src, _np.uint8, n))


class RecordHeader(tuple):  # type: ignore[type-arg]
    """Decoded header fields: ``(version, fingerprint, group, flags, payload_len, checksum, tenant)``."""

    __slots__ = ()

    def __new__(
        cls, version: int, fingerprint: bytes, group: int, flags: int, payload_len: int, checksum: int, tenant: int = 0
    ):
        return tuple.__new__(cls, (version, fingerprint, group, flags, payload_len, checksum, tenant))

    version = property(lambda self: self[0])
    fingerprint = property(lambda self: self[1])
    group = property(lambda self: self[2])
    flags = property(lambda self: self[3])
    payload_len = property(lambda self: self[4])
    checksum = property(lambda self: self[5])
    tenant = property(lambda self: self[6])


def as_readable(buf: Any) -> memoryview:
    """A flat ``memoryview`` of unsigned bytes over ``buf`` (no copy).

    Accepts bytes-like objects, NumPy arrays and contiguous CPU torch tensors.
    """
    if isinstance(buf, memoryview):
        mv = buf
    elif isinstance(buf, (bytes, bytearray)):
        return memoryview(buf)
    elif hasattr(buf, "data_ptr") and hasattr(buf, "numpy"):  # torch.Tensor
        mv = memoryview(_torch_bytes(buf))
    else:
        mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def as_writable(buf: Any) -> memoryview:
    """Like :func:`as_readable` but the view must be writable (a destination buffer)."""
    mv = as_readable(buf)
    if mv.readonly:
        raise ValueError("destination buffer is read-only; pass a bytearray, memoryview or tensor")
    return mv


def _torch_bytes(t: Any) -> Any:
    if t.device.type != "cpu":
        raise ValueError(f"tiers read and write host memory only; got a tensor on {t.device} (stage it first)")
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    import torch

    if t.dtype != torch.uint8:
        t = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
    return t.reshape(-1).numpy()


def _checksum(key: bytes, head: Any, hashed: tuple[tuple[int, int], ...], payload: Any) -> int:
    """The checksum of a record whose header is ``head`` (its version's ``hashed`` ranges)."""
    h = xxhash.xxh3_64(key)
    for a, b in hashed:
        h.update(head[a:b])
    h.update(payload)
    return h.intdigest()


def make_header(key: bytes, payload: memoryview, *, flags: int = 0, tenant: int = 0) -> bytes:
    """The 64-byte header for ``payload`` stored under ``key`` (checksum included): version 1 for
    the default tenant (0), else version 2 with ``tenant`` in it.

    ``key`` is a stored key (fingerprint + hash + group); fingerprint and group come from it.
    """
    hdr = bytearray(HEADER_SIZE)
    _header_into(memoryview(hdr), key, payload, flags, tenant)
    return bytes(hdr)


def _header_into(out: memoryview, key: bytes, payload: Any, flags: int, tenant: int) -> None:
    """:func:`make_header` written into ``out`` (at least a header long)."""
    version = TENANT_VERSION if tenant else FORMAT_VERSION
    group = int.from_bytes(key[-GROUP_BYTES:], "big")
    _HEADER2.pack_into(
        out, 0, MAGIC, version, HEADER_SIZE, key[:FINGERPRINT_BYTES], group, flags, len(payload), 0, tenant
    )
    _U64.pack_into(out, _SUM_AT, _checksum(key, out, _VERSIONS[version][0], payload))


def encode_record_into(dst: memoryview, key: bytes, payload: memoryview, *, flags: int = 0, tenant: int = 0) -> int:
    """Write header + payload for ``key`` into ``dst``; return the record length. The payload is
    copied, then hashed where it landed (still in cache): the checksum covers what the record holds."""
    total = HEADER_SIZE + len(payload)
    if len(dst) < total:
        raise ValueError(f"destination of {len(dst)} bytes is smaller than the record ({total})")
    landed = dst[HEADER_SIZE:total]
    _copy_into(landed, payload)
    _header_into(dst, key, landed, flags, tenant)
    return total


def encode_records_into(dst: memoryview, items: list[Any]) -> list[int]:
    """Write the record of each (key, payload) or (key, payload, tenant) of ``items`` one after
    another from the start of ``dst``; return where each ends. A destination too small for all of
    them gets nothing."""
    total = sum(HEADER_SIZE + len(p) for _, p, *_ in items)
    if len(dst) < total:
        raise ValueError(f"destination of {len(dst)} bytes is smaller than the records ({total})")
    ends = []
    off = 0
    dv = memoryview(dst)
    for key, payload, *tenant in items:
        off += encode_record_into(dv[off:], key, payload, tenant=tenant[0] if tenant else 0)
        ends.append(off)
    return ends


def encode_heads_into(dst: memoryview, items: list[Any]) -> None:
    """Write the 64-byte header of each (key, payload) or (key, payload, tenant) of ``items`` one
    after another from the start of ``dst``, the payloads left where they are: a record kept as
    header and payload apart (the LMDB tier stores them so: py-lmdb then copies each payload once,
    from where it is). The payloads must not change until they are stored."""
    if len(dst) < HEADER_SIZE * len(items):
        raise ValueError(f"destination of {len(dst)} bytes is smaller than the headers ({HEADER_SIZE * len(items)})")
    dv = memoryview(dst)
    if _fastrec is None or len(items) < 2:
        for i, (key, payload, *tenant) in enumerate(items):
            _header_into(dv[i * HEADER_SIZE :], key, payload, 0, tenant[0] if tenant else 0)
        return
    # The helper hashes the whole batch with the GIL let go once (the xxhash package holds it up
    # to 64 KiB), by the layout above: the default tenant's headers it writes whole, headers with a
    # tenant are packed here and summed there.
    if all(len(item) == 2 or not item[2] for item in items):
        _fastrec.heads_many(dv, [item[0] for item in items], [item[1] for item in items], FORMAT_VERSION)
        return
    keys = []
    payloads = []
    for i, (key, payload, *tenant) in enumerate(items):
        t = tenant[0] if tenant else 0
        _HEADER2.pack_into(
            dv,
            i * HEADER_SIZE,
            MAGIC,
            TENANT_VERSION if t else FORMAT_VERSION,
            HEADER_SIZE,
            key[:FINGERPRINT_BYTES],
            int.from_bytes(key[-GROUP_BYTES:], "big"),
            0,
            len(payload),
            0,
            t,
        )
        keys.append(key)
        payloads.append(payload)
    _fastrec.sum_heads(dv, keys, payloads)


def encode_record(key: bytes, payload: Any, *, flags: int = 0, tenant: int = 0) -> bytearray:
    """A new ``bytearray`` holding the record for ``key`` (one copy of the payload)."""
    mv = as_readable(payload)
    out = bytearray(HEADER_SIZE + len(mv))
    encode_record_into(memoryview(out), key, mv, flags=flags, tenant=tenant)
    return out


def decode_header(record: memoryview | bytes, payload_len: int | None = None) -> RecordHeader:
    """Parse and sanity-check a header without verifying the checksum.

    ``payload_len`` is the payload size actually present; by default the rest of ``record``.

    Raises:
        CorruptRecordError: short buffer, bad magic, unknown version, or a length that
            disagrees with the bytes present.
    """
    if len(record) < HEADER_SIZE:
        raise CorruptRecordError(f"record of {len(record)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, hsize, fp, group, flags, n, csum, tenant = _HEADER2.unpack_from(record, 0)
    if magic != MAGIC:
        raise CorruptRecordError(f"bad magic {magic!r}; expected {MAGIC!r}")
    if version not in _VERSIONS or hsize != HEADER_SIZE:
        raise CorruptRecordError(f"unsupported record format version {version} (header {hsize} bytes)")
    _, (za, zb), sealed_flag = _VERSIONS[version]
    sealed = flags & sealed_flag
    present = len(record) - HEADER_SIZE if payload_len is None else payload_len
    if n != present - (SEAL_TAG if sealed else 0):
        raise CorruptRecordError(f"payload length field {n} disagrees with the {present} payload bytes present")
    if not sealed and any(record[za:zb]):
        raise CorruptRecordError(f"reserved header bytes {za}..{zb - 1} are not zero")
    return RecordHeader(version, fp, group, flags, n, csum, tenant)


def verify_parts(header: memoryview | bytes, payload: memoryview, key: bytes) -> memoryview:
    """Verify a header and its payload (held apart) for stored key ``key``; return ``payload``.

    Raises:
        CorruptRecordError: any header field, the namespace, the group or the checksum is wrong.
    """
    head = bytes(header[:HEADER_SIZE])  # the common case on 64 bytes of bytes; any doubt takes the long way
    rule = _LEADS.get(head[:_IDS_AT])
    if rule is not None and len(head) == HEADER_SIZE:
        hashed, za, zb, zeros, sealed_flag = rule
        flags, n, csum = _FLAGS_LEN_SUM.unpack_from(head, _FLAGS_AT)
        if (
            n == len(payload)
            and head[_IDS_AT:_FLAGS_AT] == key_header_ids(key)
            and not flags & sealed_flag
            and head[za:zb] == zeros
        ):
            if _checksum(key, head, hashed, payload) != csum:
                raise CorruptRecordError("payload checksum mismatch")
            return payload
    hdr = decode_header(header[:HEADER_SIZE], len(payload))  # raises, naming what is wrong
    if hdr.fingerprint != key_fingerprint(key):
        raise CorruptRecordError("record belongs to another namespace")
    if hdr.group != key_group(key):
        raise CorruptRecordError(f"record is for group {hdr.group}, key says another")
    if hdr.flags & _VERSIONS[hdr.version][2]:
        raise CorruptRecordError("record is sealed (encrypted): only a tier with its keys can open it")
    raise CorruptRecordError("record header does not verify")


def verify_record(record: memoryview | bytes, key: bytes) -> memoryview:
    """Verify ``record`` (header + payload) was written for stored key ``key``; return its payload."""
    mv = record if isinstance(record, memoryview) else memoryview(record)
    if len(mv) < HEADER_SIZE:
        raise CorruptRecordError(f"record of {len(mv)} bytes is shorter than the {HEADER_SIZE}-byte header")
    return verify_parts(mv[:HEADER_SIZE], mv[HEADER_SIZE:], key)


def verify_into(record: memoryview | bytes, key: bytes, dst: memoryview) -> int:
    """Deliver ``record``'s payload into the start of ``dst`` if it was written for stored key
    ``key``; return the payload's length, or -1 when it does not fit ``dst`` (nothing copied).
    ``record`` must not change during the call (a record in an LMDB read transaction, or bytes
    of this process).

    Raises:
        CorruptRecordError: as :func:`verify_record`. A payload found damaged after its copy is
            zeroed where it landed: no damaged byte stays in a destination.
    """
    mv = record if isinstance(record, memoryview) else memoryview(record)
    if len(mv) < HEADER_SIZE:
        raise CorruptRecordError(f"record of {len(mv)} bytes is shorter than the {HEADER_SIZE}-byte header")
    return _parts_into(mv[:HEADER_SIZE], mv[HEADER_SIZE:], key, dst)


def verify_many_into(
    records: list[memoryview | bytes], keys: list[bytes], dsts: list[memoryview]
) -> list[int | CorruptRecordError]:
    """:func:`verify_into` for each (record, key, dst): the payload's length, -1 when it does
    not fit (nothing copied), or the :class:`CorruptRecordError` naming what is wrong with a
    record that is not good for its key (its destination zeroed where it landed). With the C
    helper, one call: the GIL is let go once for every check and copy."""
    if _fastrec is None:
        out: list[int | CorruptRecordError] = []
        for record, key, dst in zip(records, keys, dsts, strict=True):
            try:
                out.append(verify_into(record, key, dst))
            except CorruptRecordError as e:
                out.append(e)
        return out
    got: list[int | CorruptRecordError] = _fastrec.verify_many(records, keys, dsts)
    for i, n in enumerate(got):
        if isinstance(n, int) and n < 0:
            try:
                got[i] = _native_refusal(n, records[i], keys[i])
            except CorruptRecordError as e:
                got[i] = e
    return got


def verify_many_parts_into(
    heads: list[Any], payloads: list[Any], keys: list[bytes], dsts: list[Any], *, head_at: int = 0
) -> list[int | CorruptRecordError]:
    """:func:`verify_many_into` for records kept as header and payload apart: ``heads[i]``
    holds the header of ``payloads[i]`` (as :func:`encode_heads_into` wrote it) at ``head_at``,
    and nothing after it (a stored entry with the header at its end, passed without a copy)."""
    if _fastrec is None:
        out: list[int | CorruptRecordError] = []
        for head, payload, key, dst in zip(heads, payloads, keys, dsts, strict=True):
            try:
                out.append(_parts_into(memoryview(head)[head_at:], payload, key, dst))
            except CorruptRecordError as e:
                out.append(e)
        return out
    got: list[int | CorruptRecordError] = _fastrec.verify_parts_many(heads, payloads, keys, dsts, head_at)
    for i, n in enumerate(got):
        if isinstance(n, int) and n < 0:
            try:
                got[i] = _native_refusal(n, bytes(heads[i])[head_at:] + bytes(payloads[i]), keys[i])
            except CorruptRecordError as e:
                got[i] = e
    return got


def _parts_into(head: memoryview | bytes, payload: memoryview | bytes, key: bytes, dst: Any) -> int:
    """Pure-Python checked copy of one record kept as header and payload: the payload copied, then
    checked where it landed (still in cache: faster than checking it where it is, then copying
    it, measured), so what is delivered is what was checked; a damaged one is zeroed there."""
    pv = payload if isinstance(payload, memoryview) else memoryview(payload)
    if len(head) != HEADER_SIZE:
        raise CorruptRecordError(f"header of {len(head)} bytes; a header is {HEADER_SIZE}")
    n = len(pv)
    dv = dst if type(dst) is memoryview else as_writable(dst)
    if n > len(dv):
        verify_parts(head, pv, key)  # a damaged record is corrupt, not merely too large
        return -1
    landed = dv[:n]
    _copy_into(landed, pv)
    try:
        verify_parts(head, landed, key)
    except CorruptRecordError:
        _zero(landed)
        raise
    return n


def _zero(view: memoryview) -> None:
    """Zero ``view`` (no damaged byte stays where it landed)."""
    view[:] = bytes(len(view))


def _native_refusal(n: int, record: memoryview | bytes, key: bytes) -> int:
    """What the C helper's negative answer ``n`` for ``record`` means: -1 when the payload does
    not fit its destination (-2 from C; a damaged record is still corrupt, not merely too large),
    else the :class:`CorruptRecordError` naming what is wrong, raised."""
    verify_record(record, key)  # raises, naming what is wrong
    if n == -2:
        return -1
    raise CorruptRecordError("payload checksum mismatch")  # the record changed under the check


# ---- record files --------------------------------------------------------------------------------


def write_records(
    path: str, heads: memoryview | bytearray, payloads: list[Any], *, sync: bool, reuse: bool = False
) -> None:
    """Create the file ``path`` (never an existing one; with ``reuse``, overwrite the existing
    file from its start, never shortening it: a reader may have it mapped) holding, one after
    another, each record: the i-th 64-byte header of ``heads`` (as :func:`encode_heads_into`
    wrote them), then ``payloads[i]``; ``fdatasync``'d when ``sync``. Record i starts at the sum
    of the records before it. One ``pwritev`` per 1024 buffers, the GIL let go for each.

    Raises:
        OSError: the file could not be written (it is removed: never a partial file).
    """
    hv = memoryview(heads)
    if len(hv) < HEADER_SIZE * len(payloads):
        raise ValueError(f"heads of {len(hv)} bytes is short of {len(payloads)} headers")
    parts: list[memoryview] = []
    for i, payload in enumerate(payloads):
        parts.append(hv[i * HEADER_SIZE : (i + 1) * HEADER_SIZE])
        parts.append(memoryview(payload).cast("B"))
    flags = os.O_WRONLY | os.O_CLOEXEC if reuse else os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        _pwritev_all(fd, parts)
        if sync:
            os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


_IOV_BATCH = 1024  # buffers per pwritev (Linux's IOV_MAX)


def _pwritev_all(fd: int, parts: list[memoryview]) -> None:
    """Write ``parts`` one after another from the start of ``fd``, ``_IOV_BATCH`` buffers per
    ``pwritev`` (the GIL let go for each), a short write resumed where it stopped."""
    off = 0
    i = 0
    while i < len(parts):
        batch = parts[i : i + _IOV_BATCH]
        want = sum(len(b) for b in batch)
        done = os.pwritev(fd, batch, off)
        off += done
        if done == want:
            i += len(batch)
            continue
        for b in batch:  # a short write: skip what went out, resume inside the part it stopped in
            if done < len(b):
                parts[i] = b[done:]
                break
            done -= len(b)
            i += 1


def read_records_into(
    paths: list[str], offsets: list[int], sizes: list[int], keys: list[bytes], dsts: list[Any]
) -> list[int | CorruptRecordError | OSError]:
    """Deliver the record of ``sizes[i]`` bytes (header and payload) at ``offsets[i]`` of file
    ``paths[i]`` (as :func:`write_records` wrote it) into ``dsts[i]``, checked for stored key
    ``keys[i]``: per item the payload's length, -1 when it does not fit (its header good), the
    :class:`CorruptRecordError` of a record that is not good for its key (a wrong header or
    size, a file that ends early, a checksum that differs: its destination zeroed where it
    landed), or the :class:`OSError` that opening or reading the file raised
    (``FileNotFoundError``: removed meanwhile). With the C helper, one call: the GIL is let go
    once, and the part of a file that a run of items in it spans is mapped once; in Python, one
    ``preadv`` per record (header, and payload straight into its destination) through one
    descriptor per file, the payload then checked where it landed.

    No writer may change a record while it is read: the C helper hashes each piece of a payload
    in the map, then streams it out, so a piece changed in between would be delivered as
    checked. A caller whose files other writers change (punch, write over) confirms afterwards
    that each record is still where it was read (as the LMDB tier does)."""
    if _fastrec is not None:
        out: list[int | CorruptRecordError | OSError] = _fastrec.read_records(paths, offsets, sizes, keys, dsts)
        for i, n in enumerate(out):
            if isinstance(n, int) and n < 0:
                out[i] = -1 if n == -2 else CorruptRecordError("record in its file is not good for its key")
        return out
    return _read_runs(list(zip(paths, offsets, sizes, keys, dsts, strict=True)))


#: Where an index entry names a record's place for :func:`read_placed_into`: (the entry's size,
#: and the byte offsets of the record's size (u64), its file's 16-byte token and its offset (u64),
#: little-endian).
PlaceLayout = tuple[int, int, int, int]


def read_placed_into(
    directory: str, entries: list[Any], keys: list[bytes], dsts: list[Any], layout: PlaceLayout
) -> list[int | CorruptRecordError | OSError | None]:
    """:func:`read_records_into` for records whose place is in an index entry: ``entries[i]`` (a
    buffer, or None), laid out as ``layout`` says, names the record's size, its file
    (``directory/<token as 32 hex digits>``) and its offset. Per item None where ``entries[i]`` is
    not of the layout's size or ``dsts[i]`` is None (nothing read), else what
    :func:`read_records_into` answers for it. With the C helper, one call that parses the entries
    too: a caller reading many small records in files spends no Python per record on their
    places (the LMDB tier, in its read transaction). The same caveat as :func:`read_records_into`
    on files other writers change."""
    size, size_at, token_at, offset_at = layout
    if _fastrec is not None:
        out: list[int | CorruptRecordError | OSError | None] = _fastrec.read_placed(
            os.fsencode(directory), entries, keys, dsts, layout
        )
        for i, n in enumerate(out):
            if type(n) is int and n < 0:
                out[i] = -1 if n == -2 else CorruptRecordError("record in its file is not good for its key")
        return out
    found: list[int | CorruptRecordError | OSError | None] = [None] * len(entries)
    which: list[int] = []
    items: list[tuple[str, int, int, bytes, Any]] = []
    for i, (entry, key, dst) in enumerate(zip(entries, keys, dsts, strict=True)):
        if entry is None or dst is None or len(entry) != size:
            continue
        e = bytes(entry)
        path = os.path.join(directory, e[token_at : token_at + 16].hex())
        at = _U64.unpack_from(e, offset_at)[0]
        items.append((path, at, _U64.unpack_from(e, size_at)[0], key, dst))
        which.append(i)
    for i, got in zip(which, _read_runs(items), strict=True):
        found[i] = got
    return found


def _read_runs(items: list[tuple[str, int, int, bytes, Any]]) -> list[int | CorruptRecordError | OSError]:
    """Pure-Python :func:`read_records_into` of ``(path, offset, size, key, dst)`` items: each run
    of items in one file read through one descriptor."""
    out: list[int | CorruptRecordError | OSError] = []
    i = 0
    while i < len(items):
        path = items[i][0]
        end = i + 1
        while end < len(items) and items[end][0] == path:
            end += 1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            out += [type(e)(e.errno, e.strerror, path) for _ in range(i, end)]
            i = end
            continue
        try:
            for _, at, size, key, dst in items[i:end]:
                out.append(_read_record(fd, at, size, key, dst))
        finally:
            os.close(fd)
        i = end
    return out


def _read_record(fd: int, at: int, size: int, key: bytes, dst: Any) -> int | CorruptRecordError | OSError:
    """Pure-Python :func:`read_records_into` of one record of the open file ``fd``: header and
    payload read in one ``preadv`` (the payload straight into its destination), then checked
    where it landed (a damaged payload zeroed there)."""
    view = as_writable(dst)
    n = size - HEADER_SIZE
    if n < 0:
        return CorruptRecordError(f"a record of {size} bytes is shorter than its header")
    head = memoryview(bytearray(HEADER_SIZE))
    landed = view[:n] if n <= len(view) else None
    try:
        got = os.preadv(fd, [head] if landed is None else [head, landed], at)
    except OSError as e:
        return e
    try:
        if got < HEADER_SIZE:
            raise CorruptRecordError(f"record file ends {got} bytes into a header")
        hdr = decode_header(head, n)
        if landed is None:
            return -1  # a good header, a payload longer than the destination
        if got != size:
            raise CorruptRecordError(f"record file holds {got - HEADER_SIZE} of the record's {n} payload bytes")
        verify_parts(head, landed, key)
    except CorruptRecordError as e:
        if landed is not None:
            _zero(landed)
        return e
    return hdr.payload_len

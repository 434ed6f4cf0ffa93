"""The Redis tier's key layout: :func:`redis_key` and its inverse :func:`parse_redis_key`.

Key layout (ASCII bytes)::

    {key_prefix}:{<fingerprint hex>.<bucket hex>}:<block hash + group, hex>

The part in braces is the Redis Cluster *hash tag*: ``bucket`` is the first 4 bytes of the
block hash (big-endian) modulo ``hash_tag_buckets``, so one namespace's batch touches at most
``hash_tag_buckets`` slots, while different blocks still spread over the cluster. Every
group of a block lands in the same slot. Hex keeps keys printable and unambiguous, and
``parse_redis_key`` recovers the stored key for ``scan`` (whose ``MATCH`` pattern
:func:`scan_match` builds).
"""

from __future__ import annotations

from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, chunk_key_of, key_fingerprint, key_hash, stored_key

__all__ = ["parse_redis_key", "redis_key", "scan_match"]

_GLOB_SPECIAL = frozenset(b"*?[]\\")


def _bucket(block_hash: bytes, buckets: int) -> int:
    return int.from_bytes(block_hash[:4], "big") % buckets


def redis_key(prefix: bytes, key: bytes, buckets: int) -> bytes:
    """The Redis key of stored key ``key`` (see the module docstring for the layout)."""
    fp = key_fingerprint(key)
    rest = chunk_key_of(key)
    bucket = _bucket(key_hash(rest), buckets)
    return b"%s:{%s.%x}:%s" % (prefix, fp.hex().encode(), bucket, rest.hex().encode())


def parse_redis_key(prefix: bytes, rkey: bytes) -> bytes | None:
    """The stored key behind Redis key ``rkey``, or ``None`` if it is not one of ours."""
    head = prefix + b":{"
    if not rkey.startswith(head):
        return None
    end = rkey.find(b"}:", len(head))
    if end < 0:
        return None
    fp_hex, dot, _bucket_hex = rkey[len(head) : end].partition(b".")
    try:
        fp = bytes.fromhex(fp_hex.decode("ascii"))
        rest = bytes.fromhex(rkey[end + 2 :].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not dot or len(fp) != FINGERPRINT_BYTES or len(rest) <= GROUP_BYTES:
        return None
    return stored_key(fp, rest)


def _glob_escape(raw: bytes) -> bytes:
    return b"".join(b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c]) for c in raw)


def scan_match(prefix: bytes, fingerprint: bytes | None) -> bytes:
    """The ``SCAN ... MATCH`` pattern of the keys under ``prefix`` (of one namespace, by its
    fingerprint, or of all)."""
    head = _glob_escape(prefix) + b":{"
    return head + (fingerprint.hex().encode() + b".*" if fingerprint is not None else b"*")

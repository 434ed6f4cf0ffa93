"""Chunk keys and namespaces.

Primitives:

* **chunk key** — ``block_hash + group.to_bytes(4, "big")``: byte-compatible with vLLM's
  ``OffloadKey`` (raw hash bytes followed by the KV group index, 4 bytes big-endian).
* **namespace** — everything that makes stored bytes reusable: model name and revision,
  dtype, per-group geometry, parallel layout, record format version and an optional tenant
  salt. Its 16-byte :attr:`Namespace.fingerprint` prefixes every stored key, so two models
  never share a record even on a shared Redis.
* **stored key** — ``fingerprint + chunk key``: what tiers take and return. It is
  self-describing: :func:`split_stored_key` recovers fingerprint, hash and group.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tieredkv.errors import ConfigError

if TYPE_CHECKING:
    from tieredkv.groups import GroupSpec

__all__ = [
    "FINGERPRINT_BYTES",
    "GROUP_BYTES",
    "MIN_STORED_KEY_BYTES",
    "PARTIAL_MARK",
    "GroupGeometry",
    "Namespace",
    "ParallelLayout",
    "chunk_key_of",
    "group_suffix",
    "key_fingerprint",
    "key_group",
    "key_hash",
    "make_chunk_key",
    "partial_chunk_key",
    "partial_valid_from",
    "split_stored_key",
    "stored_key",
    "stored_key_group",
    "tenant_id",
    "with_group",
]

FINGERPRINT_BYTES = 16
GROUP_BYTES = 4
#: ``key[GROUP_SUFFIX]``: the group suffix of a chunk or stored key (one slice, no int made; a
#: per-key hot path can key a dict by it).
GROUP_SUFFIX = slice(-GROUP_BYTES, None)
#: The shortest stored key: a namespace fingerprint, a block hash of at least one byte, a group.
MIN_STORED_KEY_BYTES = FINGERPRINT_BYTES + 1 + GROUP_BYTES
_MAX_GROUP = 2**32 - 1


def tenant_id(tenant: str | bytes | None) -> int:
    """The 64-bit id a record carries for ``tenant`` (vLLM: the request's ``cache_salt``; the
    library: the ``tenant=`` of a call): 0 for no tenant (``None`` or empty), else a BLAKE2b of
    the name, never 0. Records carry the id, never the name."""
    if not tenant:
        return 0
    raw = tenant.encode() if isinstance(tenant, str) else bytes(tenant)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"tieredkv-tenant").digest(), "little") or 1


def group_suffix(group: int) -> bytes:
    """The last bytes of every key of ``group``: its index, 4 bytes big-endian."""
    if not 0 <= group <= _MAX_GROUP:
        raise ValueError(f"group index {group!r} out of range 0..{_MAX_GROUP}")
    return group.to_bytes(GROUP_BYTES, "big")


def make_chunk_key(block_hash: bytes, group: int) -> bytes:
    """Build a chunk key: the block hash followed by ``group`` as 4 bytes big-endian."""
    return bytes(block_hash) + group_suffix(group)


def with_group(chunk_key: bytes, group: int) -> bytes:
    """The same hash's chunk key in another group."""
    return bytes(chunk_key[:-GROUP_BYTES]) + group_suffix(group)


def key_hash(chunk_key: bytes) -> bytes:
    """The block-hash part of a chunk key."""
    return chunk_key[:-GROUP_BYTES]


def key_group(chunk_key: bytes) -> int:
    """The group index of a chunk key (also works on a stored key)."""
    return int.from_bytes(chunk_key[-GROUP_BYTES:], "big")


PARTIAL_MARK = b"\xffP"
"""Marks a partial chunk key: ``hash + PARTIAL_MARK + valid_from (1 byte) + group``."""


def partial_chunk_key(chunk_key: bytes, valid_from: int) -> bytes:
    """The key of a chunk whose sub-blocks ``0 .. valid_from - 1`` were never written.

    vLLM stores sliding-window chunks whose leading blocks are out of the window (block ids
    ``[0, 0, x, y]``) and Mamba chunks that hold one state block in their last slot. Such a chunk
    is stored under this key, so the record itself says which sub-blocks are valid (the checksum
    covers the key) and a load can refuse to read an unwritten one. ``valid_from == 0`` is the
    whole chunk: the plain key.
    """
    if valid_from == 0:
        return bytes(chunk_key)
    if not 0 < valid_from < 256:
        raise ValueError(f"valid_from must be in 0..255, got {valid_from}")
    return bytes(chunk_key[:-GROUP_BYTES]) + PARTIAL_MARK + bytes((valid_from,)) + bytes(chunk_key[-GROUP_BYTES:])


def partial_valid_from(key: bytes, whole_len: int) -> int:
    """``valid_from`` of ``key`` (stored or chunk key) when it is the :func:`partial_chunk_key` of a
    whole key ``whole_len`` bytes long; 0 when it is the whole key itself."""
    if len(key) == whole_len + 3 and key[-GROUP_BYTES - 3 : -GROUP_BYTES - 1] == PARTIAL_MARK:
        return key[-GROUP_BYTES - 1]
    return 0


def stored_key(fingerprint: bytes, chunk_key: bytes) -> bytes:
    """The key a tier stores: namespace fingerprint + chunk key."""
    return bytes(fingerprint) + bytes(chunk_key)


def key_fingerprint(key: bytes) -> bytes:
    """The namespace fingerprint a stored key starts with."""
    return bytes(key[:FINGERPRINT_BYTES])


def key_header_ids(key: bytes) -> bytes:
    """The 20 bytes a record header holds for stored key ``key`` (header bytes 8..27): the
    namespace fingerprint, then the group little-endian (big-endian in the key)."""
    return key[:FINGERPRINT_BYTES] + key[-GROUP_BYTES:][::-1]


def chunk_key_of(key: bytes) -> bytes:
    """The chunk key (``hash + group``) inside a stored key: :func:`stored_key` undone."""
    return bytes(key[FINGERPRINT_BYTES:])


def stored_key_group(key: bytes) -> int:
    """Group index of a stored key."""
    return key_group(key)


def split_stored_key(key: bytes) -> tuple[bytes, bytes, int]:
    """Split a stored key into ``(fingerprint, block_hash, group)``.

    Raises:
        ValueError: the key is too short to hold a fingerprint, a hash byte and a group.
    """
    if len(key) < MIN_STORED_KEY_BYTES:
        raise ValueError(f"stored key of {len(key)} bytes is too short")
    return (
        key[:FINGERPRINT_BYTES],
        key[FINGERPRINT_BYTES:-GROUP_BYTES],
        int.from_bytes(key[-GROUP_BYTES:], "big"),
    )


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """What a KV group's bytes look like: enough to tell two layouts apart."""

    kind: str = "full"
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    bytes_per_block: int = 0
    window_tokens: int = 0

    @classmethod
    def from_spec(cls, spec: GroupSpec, *, exact: bool = True) -> GroupGeometry:
        """The namespace's record of a :class:`~tieredkv.groups.GroupSpec` (the group model).
        ``exact=False``: the spec's tokens per block and window are placeholders (a group
        registered by index), recorded as 0 = unknown."""
        return cls(
            kind=spec.kind.value,
            tokens_per_block=spec.tokens_per_block if exact else 0,
            blocks_per_chunk=spec.blocks_per_chunk,
            bytes_per_block=spec.bytes_per_block,
            window_tokens=(spec.window_tokens or 0) if exact else 0,
        )


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """How the KV cache is split across workers; each worker's bytes differ."""

    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Namespace:
    """Identity of reusable bytes. Two namespaces with any field different never share a record."""

    model: str
    revision: str = ""
    dtype: str = "bfloat16"
    groups: tuple[GroupGeometry, ...] = ()
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    format_version: int = 1
    tenant_salt: str = ""
    generation: str = ""
    """Cache generation: empty until the engine's cache is reset (vLLM ``reset_cache`` on sleep or a
    weight update); then a fresh random token, so nothing stored before the reset can be hit."""
    weights: str = ""
    """Content fingerprint of the model's weights and config (:func:`tieredkv.weights.weights_fingerprint`).
    When set it names the model: ``model`` and ``revision`` are then labels, left out of the
    fingerprint (the same checkpoint under another path or name shares records). Empty when
    unknown: then only the name and revision tell two checkpoints apart."""
    _fp: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("namespace.model: got '' — a model name is required (e.g. 'meta-llama/Llama-3.1-8B')")
        # Computed once: every key conversion reads it (several per lookup on the scheduler path).
        object.__setattr__(self, "_fp", _fingerprint(self))

    @property
    def fingerprint(self) -> bytes:
        """16-byte BLAKE2b digest of the canonical JSON form of every field."""
        return self._fp

    def key(self, block_hash: bytes, group: int) -> bytes:
        """The stored key for ``block_hash`` in ``group`` under this namespace."""
        return stored_key(self.fingerprint, make_chunk_key(block_hash, group))

    def stored_key(self, chunk_key: bytes) -> bytes:
        """The stored key of a chunk key (``hash + group``) under this namespace."""
        return stored_key(self.fingerprint, chunk_key)

    def keys(self, block_hashes: Sequence[bytes], group: int) -> list[bytes]:
        """Stored keys for several hashes of one group."""
        fp = self.fingerprint
        suffix = group_suffix(group)
        return [fp + bytes(h) + suffix for h in block_hashes]

    def describe(self) -> dict[str, Any]:
        """Plain dict of the namespace (for logs, JSON and the CLI)."""
        return _canonical(self)


def _canonical(ns: Namespace) -> dict[str, Any]:
    return {
        "model": ns.model,
        "revision": ns.revision,
        "dtype": ns.dtype,
        "groups": [
            {
                "kind": g.kind,
                "tokens_per_block": g.tokens_per_block,
                "blocks_per_chunk": g.blocks_per_chunk,
                "bytes_per_block": g.bytes_per_block,
                "window_tokens": g.window_tokens,
            }
            for g in ns.groups
        ],
        "parallel": {
            "tp_size": ns.parallel.tp_size,
            "pp_size": ns.parallel.pp_size,
            "pcp_size": ns.parallel.pcp_size,
            "dcp_size": ns.parallel.dcp_size,
            "rank": ns.parallel.rank,
        },
        "format_version": ns.format_version,
        "tenant_salt": ns.tenant_salt,
        # Only when set: a namespace that was never reset (or has no weights fingerprint) keeps its
        # fingerprint across versions.
        **({"generation": ns.generation} if ns.generation else {}),
        **({"weights": ns.weights} if ns.weights else {}),
    }


def _fingerprint(ns: Namespace) -> bytes:
    identity = _canonical(ns)
    if ns.weights:
        # The weights (and their config) name the model: its name and revision are labels, so
        # nodes that keep the same checkpoint under other paths or names share its records.
        del identity["model"], identity["revision"]
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=FINGERPRINT_BYTES, person=b"tieredkv-ns").digest()

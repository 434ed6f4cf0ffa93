"""The namespace catalog: what a namespace fingerprint stands for, kept in each persistent tier.

A record's header names its namespace by fingerprint only (16 bytes of BLAKE2b); ``tieredkv
inspect`` shows what that fingerprint is (model, revision, the weights fingerprint) by reading
the namespace's *catalog record*: an ordinary record (checksummed, verified on read, copied by
``migrate``, evicted like any other) under a reserved stored key — the namespace fingerprint,
the marker hash :data:`CATALOG_HASH`, the reserved group :data:`CATALOG_GROUP` — whose payload is
JSON::

    {"tieredkv_catalog": 1, "fingerprint": "<32 hex>", "namespace": Namespace.describe(),
     "weights": "<weights fingerprint or ''>", "written_at": <unix seconds>}

A :class:`~tieredkv.store.TieredStore` that builds its tiers from the config (``open_store``,
the vLLM integrations, the demo; one handed its tier objects only with ``catalog=True``) writes
the catalog record of its namespace in every tier outside the engine's process the first time
it stores under that namespace (:func:`write_catalog`, in the background: best effort, a
failure is logged). The admin CLI
hides catalog records from ``ls``, ``status`` and ``evict`` (they are not the engine's records);
``verify``, ``migrate`` and ``flush`` treat them as records.

Reading one (:func:`parse_catalog`) never unpickles or evaluates anything: JSON of at most
:data:`MAX_BYTES`, checked field by field.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tieredkv.errors import TieredKVError
from tieredkv.keys import FINGERPRINT_BYTES, GROUP_BYTES, group_suffix

if TYPE_CHECKING:
    from tieredkv.backends.base import Tier
    from tieredkv.keys import Namespace

__all__ = [
    "CATALOG_GROUP",
    "CATALOG_HASH",
    "MAX_BYTES",
    "catalog_key",
    "catalog_payload",
    "is_catalog_key",
    "parse_catalog",
    "write_catalog",
]

log = logging.getLogger(__name__)

#: The block-hash part of every catalog key (no engine hash is this string).
CATALOG_HASH = b"\x00tieredkv:namespace-catalog\x00"
#: The group of every catalog key (the largest group index; engines number theirs from 0).
CATALOG_GROUP = 2**32 - 1
#: The largest catalog payload read.
MAX_BYTES = 64 << 10
_SUFFIX = CATALOG_HASH + group_suffix(CATALOG_GROUP)
_VERSION = 1


def catalog_key(fingerprint: bytes) -> bytes:
    """The stored key of the catalog record of namespace ``fingerprint``."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"a namespace fingerprint is {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return bytes(fingerprint) + _SUFFIX


def is_catalog_key(key: bytes) -> bool:
    """Whether stored key ``key`` is a catalog record's."""
    return len(key) == FINGERPRINT_BYTES + len(CATALOG_HASH) + GROUP_BYTES and key.endswith(_SUFFIX)


def catalog_payload(namespace: Namespace) -> bytes:
    """The catalog record's payload for ``namespace``."""
    doc = {
        "tieredkv_catalog": _VERSION,
        "fingerprint": namespace.fingerprint.hex(),
        "namespace": namespace.describe(),
        "weights": namespace.weights,
        "written_at": round(time.time(), 3),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_catalog(payload: bytes | memoryview, fingerprint: bytes) -> dict[str, Any]:
    """The catalog document in a (verified) catalog payload for namespace ``fingerprint``.
    Raises ``ValueError`` naming what is wrong: too large, not JSON, not a catalog document, or
    one of another namespace."""
    if len(payload) > MAX_BYTES:
        raise ValueError(f"catalog record of {len(payload)} bytes is larger than {MAX_BYTES}")
    try:
        doc = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"catalog record is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("tieredkv_catalog") != _VERSION:
        raise ValueError("not a tieredkv catalog document (version 1)")
    if doc.get("fingerprint") != fingerprint.hex():
        raise ValueError(f"catalog record names namespace {str(doc.get('fingerprint'))[:40]!r}, not this one")
    ns = doc.get("namespace")
    weights = doc.get("weights", "")
    if not isinstance(ns, dict) or not isinstance(ns.get("model"), str) or not isinstance(weights, str):
        raise ValueError("catalog record has no namespace description (model, weights) of the right types")  # noqa: TRY004 - bad data
    written = doc.get("written_at")
    return {
        "model": ns["model"],
        "revision": str(ns.get("revision", "")),
        "weights": weights,
        "written_at": written if isinstance(written, (int, float)) else None,
        "namespace": ns,
    }


async def write_catalog(tiers: Sequence[Tier], namespace: Namespace) -> None:
    """Write ``namespace``'s catalog record in every tier outside the engine's process. Best
    effort: a tier that refuses is logged and skipped."""
    key, payload = catalog_key(namespace.fingerprint), catalog_payload(namespace)
    for tier in tiers:
        if tier.capabilities.in_process or tier.closed:
            continue
        try:
            await tier.put_many([(key, payload)])
        except (TieredKVError, ValueError) as e:
            log.info("tier %s: namespace catalog record not written: %s", tier.name, e)

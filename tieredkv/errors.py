"""The tieredkv exception tree.

Every error raised by tieredkv derives from :class:`TieredKVError`; each leaf also
subclasses the nearest builtin, so callers that only know the standard library can
still catch it (``except ValueError`` catches a :class:`ConfigError`).

Backends translate native errors (``lmdb.Error``, ``redis.RedisError``, ``OSError``)
at the tier boundary with ``raise ... from e``; nothing native leaks past a tier.
"""

from __future__ import annotations

__all__ = [
    "BackendNotFoundError",
    "ConfigError",
    "CorruptBlockError",
    "CorruptRecordError",
    "TierClosedError",
    "TierFullError",
    "TierTimeoutError",
    "TierUnavailableError",
    "TieredKVError",
]


class TieredKVError(Exception):
    """Root of every error tieredkv raises."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is invalid.

    The message names the field path, the bad value and what is allowed.
    """


class BackendNotFoundError(ConfigError, ImportError):
    """A tier ``kind`` is unknown, or its optional dependency is not installed."""


class TierUnavailableError(TieredKVError, ConnectionError):
    """A tier cannot be reached (server down, connection refused, I/O error)."""


class TierTimeoutError(TierUnavailableError, TimeoutError):
    """A tier operation ran past its deadline."""


class TierFullError(TieredKVError, MemoryError):
    """A tier has no room left and nothing can be evicted (everything pinned)."""


class TierClosedError(TieredKVError, RuntimeError):
    """An operation was attempted on a tier after ``close()``."""


class CorruptRecordError(TieredKVError, ValueError):
    """A stored record failed verification (bad magic, version, namespace, length or checksum).

    Tiers never raise this out of ``get_many``: a corrupt record is a miss, it is deleted
    and counted. It is raised by :func:`tieredkv.format.decode_header` and friends.
    """


# Name used in ARCHITECTURE.md; same class.
CorruptBlockError = CorruptRecordError

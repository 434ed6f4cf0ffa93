"""DirTier: a sample third-party tieredkv tier — one file per record in a directory.

Everything a tier kind needs is here: the config model (a ``TierConfigBase`` subclass, so a
YAML config names ``kind: dir`` like a built-in kind), the ``Tier`` subclass with its
``kind``, ``config_model`` and ``capabilities``, and the underscore hooks. The
``pyproject.toml`` entry point (``dir = "tieredkv_dirtier:DirTier"``) is what makes tieredkv
find it. Capacity is enforced here, in process, through the shared eviction seam
(``make_policy(config.eviction_policy)``), so ``capabilities.local_eviction`` is true.

A record is ``<root>/<stored key hex>``: the 64-byte tieredkv header + payload, written to a
temporary name and renamed (a reader never sees half a file). All work runs on the event loop:
a sample, not a fast tier.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ByteSize, Field

from tieredkv.backends.base import RecordInfo, Tier, TierCapabilities, TierStats
from tieredkv.config import EvictionPolicyName, Size, TierConfigBase
from tieredkv.errors import CorruptRecordError, TierFullError
from tieredkv.eviction import make_policy
from tieredkv.format import HEADER_SIZE, encode_record, verify_record

__all__ = ["DirTier", "DirTierConfig"]


class DirTierConfig(TierConfigBase):
    """A directory holding one file per record."""

    kind: Literal["dir"] = Field("dir", description="Tier kind (selects the backend).")
    root: str = Field(description="Directory of the record files (created if missing).")
    capacity_bytes: Size = Field(ByteSize(1 << 30), description="Record bytes (headers included) kept at most.")
    eviction_policy: EvictionPolicyName = Field("lru", description="Which records go first when the tier is full.")


class DirTier(Tier):
    """``DirTier(DirTierConfig(root="/var/cache/kv", capacity_bytes="1GiB"))``."""

    kind = "dir"
    config_model = DirTierConfig
    capabilities = TierCapabilities(access_stamps=True, local_eviction=True)
    config: DirTierConfig

    def __init__(self, config: DirTierConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.root = os.path.abspath(os.path.expanduser(config.root))
        self._cap = int(config.capacity_bytes)
        self._policy = make_policy(config.eviction_policy)  # key -> record bytes: the index

    def _path(self, key: bytes) -> str:
        return os.path.join(self.root, key.hex())

    async def _open(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        infos = []
        for name in os.listdir(self.root):
            if not name.endswith(".tmp"):
                st = os.stat(os.path.join(self.root, name))
                infos.append(RecordInfo(bytes.fromhex(name), st.st_size - HEADER_SIZE, st.st_mtime))
        for info in self._policy.rank(infos):  # oldest access first
            self._policy.insert(info.key, info.size + HEADER_SIZE)

    async def _put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._write([(k, encode_record(k, p)) for k, p in items])

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self._write(items)

    async def _write(self, records: list[tuple[bytes, Any]]) -> None:
        """Evict to fit under the capacity (all or nothing), then write every record."""
        sizes = {k: len(r) for k, r in records}
        used = self._policy.total_bytes - sum(self._size(k) for k in sizes)
        excess = used + sum(sizes.values()) - self._cap
        victims: list[bytes] = []
        for key in self._policy.victims():
            if excess <= 0:
                break
            if key not in sizes and not self.is_pinned(key):
                victims.append(key)
                excess -= self._size(key)
        if excess > 0:
            raise TierFullError(f"tier {self.name!r}: no room under {self._cap} bytes; the rest is pinned")
        for key in victims:
            self._remove(key)
            self._count("evictions")
        for key, rec in records:
            _write_file(self._path(key), rec)
            self._policy.insert(key, sizes[key])

    def _size(self, key: bytes) -> int:
        try:
            return os.path.getsize(self._path(key)) if key in self._policy else 0
        except FileNotFoundError:
            return 0

    def _remove(self, key: bytes) -> bool:
        self._policy.remove(key)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return False
        return True

    def _read(self, key: bytes) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[int | bytes | None]:
        out: list[int | bytes | None] = []
        for key, dst in zip(keys, into):
            rec = self._read(key)
            if rec is None:
                out.append(None)
                continue
            try:
                payload = verify_record(rec, key)
            except CorruptRecordError as e:
                self._on_corrupt(key, e)
                self._remove(key)
                out.append(None)
                continue
            os.utime(self._path(key))  # the access stamp scan() reports
            self._policy.touch(key)
            out.append(self._deliver(key, payload, dst))
        return out

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        return [k in self._policy for k in keys]

    async def _delete_many(self, keys: list[bytes]) -> int:
        return sum(self._remove(k) for k in keys if k in self._policy)

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        prefix = fingerprint.hex() if fingerprint is not None else ""
        for key in list(self._policy.victims()):
            if key.hex().startswith(prefix):
                try:
                    st = os.stat(self._path(key))
                except FileNotFoundError:
                    continue
                yield RecordInfo(key, st.st_size - HEADER_SIZE, st.st_mtime)

    async def _stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity_bytes=self._cap,
            used_bytes=self._policy.total_bytes,
            records=len(self._policy),
            extra={"path": self.root, "checked_at": time.time()},
        )

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [self._read(k) for k in keys]


def _write_file(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` whole: a temporary name, then an atomic rename."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)

"""FaultyTier: wraps a real tier and injects delays or native errors, for fault tests.

It is the only fake the test suite uses, and it always wraps the real thing: every
operation that is not faulted runs on the inner tier unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from tieredkv.backends.base import RecordInfo, RemovalListener, Tier, TierStats

__all__ = ["FaultyTier"]


class FaultyTier(Tier):
    """``FaultyTier(inner, delay_s=0.5, fail_with=OSError("disk gone"), ops={"put_many"})``.

    Knobs may be changed at any time; ``ops`` limits them to the named hook operations
    (``put_many``, ``get_many``, ``contains_many``, ``delete_many``, ``stats``), all when empty.
    """

    def __init__(
        self,
        inner: Tier,
        *,
        delay_s: float = 0.0,
        fail_with: BaseException | None = None,
        ops: set[str] | None = None,
        op_timeout_s: float | None = None,
    ) -> None:
        super().__init__(inner.config, name=f"faulty-{inner.name}")
        self.kind = inner.kind  # type: ignore[misc]
        # What the inner tier can do, less what this wrapper does not pass through: the slot
        # API (reserve/borrow) and the synchronous probe.
        self.capabilities = dataclasses.replace(inner.capabilities, slots=False, sync_probe=False)  # type: ignore[misc]
        self.quotas = inner.quotas
        self.evicts_locally = inner.evicts_locally  # type: ignore[misc]
        self.inner = inner
        self.delay_s = delay_s
        self.fail_with = fail_with
        self.ops = ops or set()
        self.op_timeout = op_timeout_s if op_timeout_s is not None else inner.op_timeout
        self.calls: dict[str, int] = {}
        self.put_sizes: list[int] = []  # items per put_many call, in call order

    async def _fault(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.ops and op not in self.ops:
            return
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            raise self.fail_with

    async def _open(self) -> None:
        await self.inner.open()

    async def _close(self) -> None:
        await self.inner.close()

    async def _put_many(self, items: list[tuple[bytes, memoryview]], tenants: list[int] | None = None) -> None:
        self.put_sizes.append(len(items))
        await self._fault("put_many")
        if tenants is None:
            await self.inner._put_many(items)
        else:
            await self.inner._put_many(items, tenants)  # type: ignore[call-arg]  # (capabilities.tenants)

    async def _get_many(self, keys: list[bytes], into: list[memoryview | None]) -> list[Any]:
        await self._fault("get_many")
        return await self.inner._get_many(keys, into)

    async def _contains_many(self, keys: list[bytes]) -> list[bool]:
        await self._fault("contains_many")
        return await self.inner._contains_many(keys)

    async def _delete_many(self, keys: list[bytes]) -> int:
        await self._fault("delete_many")
        return await self.inner._delete_many(keys)

    async def _scan(self, fingerprint: bytes | None) -> AsyncIterator[RecordInfo]:
        await self._fault("scan")
        async for info in self.inner._scan(fingerprint):
            yield info

    async def _stats(self) -> TierStats:
        await self._fault("stats")
        return await self.inner._stats()

    async def _raw_get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self.inner._raw_get_many(keys)

    async def _raw_put_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        await self.inner._raw_put_many(items)

    def set_quotas(self, quotas: Any) -> None:
        super().set_quotas(quotas)
        self.inner.set_quotas(quotas)

    def set_removal_listener(self, fn: RemovalListener | None) -> None:
        super().set_removal_listener(fn)
        self.inner.set_removal_listener(fn)

    async def _tenant_usage(self) -> dict[int, int]:
        return await self.inner._tenant_usage()

"""Reaching tiers from the CLI: which configured tiers a command may touch, opening them for
admin work, and the batched helpers every operation shares.

Branches on :class:`~tieredkv.backends.base.TierCapabilities` (resolved through the registry),
never on a tier's ``kind``: a new tier kind needs no change here.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tieredkv.backends.base import RecordInfo, Tier, TierCapabilities, runs
from tieredkv.backends.registry import build_tier, get_tier_class
from tieredkv.catalog import is_catalog_key
from tieredkv.cli.exits import EXIT_BAD_INPUT, CLIError
from tieredkv.config import TierConfigBase, TieredKVConfig
from tieredkv.errors import BackendNotFoundError, ConfigError, TierUnavailableError
from tieredkv.format import HEADER_SIZE

__all__ = [
    "BATCH_BYTES",
    "BATCH_RECORDS",
    "DELETE_BATCH",
    "batches",
    "capabilities",
    "delete_keys",
    "local_path",
    "open_tier",
    "record_bytes",
    "scan_records",
    "select_tiers",
    "with_data_dir",
]

BATCH_BYTES = 32 << 20
BATCH_RECORDS = 256
DELETE_BATCH = 1024


def tier_class(kind: str) -> type[Tier]:
    """The registered tier class of ``kind`` (``BackendNotFoundError`` with the install hint)."""
    cls: type[Tier] = get_tier_class(kind)
    return cls


def capabilities(tcfg: Any) -> TierCapabilities | None:
    """What the tier class of ``tcfg`` can do; ``None`` when it cannot be loaded here (a missing
    extra: the caller reports the registry's install hint)."""
    try:
        return tier_class(tcfg.kind).capabilities
    except BackendNotFoundError:
        return None


def _reachable(tcfg: Any) -> bool:
    caps = capabilities(tcfg)
    return caps is not None and not caps.in_process


def select_tiers(cfg: TieredKVConfig, names: Sequence[str] | None, *, allow_in_process: bool = False) -> list[Any]:
    """Tier configs named by ``--tier`` (default: every tier the CLI can reach)."""
    if not names:
        chosen = [t for t in cfg.tiers if allow_in_process or _reachable(t)]
        if not chosen:
            raise CLIError(
                EXIT_BAD_INPUT,
                "the config has no tier the CLI can reach (only in-process tiers such as cpu live inside"
                " the engine); configure an lmdb, fs or redis tier",
            )
        return chosen
    chosen = []
    for name in names:
        try:
            t = cfg.tier(name)
        except ConfigError as e:
            raise CLIError(EXIT_BAD_INPUT, f"--tier: {e}") from None
        if not allow_in_process:
            try:
                in_process = tier_class(t.kind).capabilities.in_process
            except BackendNotFoundError as e:
                raise CLIError(EXIT_BAD_INPUT, f"--tier {name}: {e}") from None
            if in_process:
                raise CLIError(
                    EXIT_BAD_INPUT,
                    f"--tier {name}: a {t.kind} tier lives inside the engine process; the CLI reaches"
                    " out-of-process tiers only, such as lmdb, fs and redis (see the engine's metrics for this one)",
                )
        chosen.append(t)
    return chosen


def local_path(tcfg: TierConfigBase) -> str | None:
    """The local directory a tier keeps its data in (the field its config model names in
    ``local_dir_field``), else ``None``."""
    path = tcfg.local_dir
    return os.path.abspath(os.path.expanduser(path)) if path is not None else None


def with_data_dir(cfg: TieredKVConfig, data_dir: Path) -> TieredKVConfig:
    """``cfg`` with every tier that keeps a local directory moved to ``data_dir/<tier name>``."""
    return cfg.model_copy(update={"tiers": [t.with_local_dir(data_dir / t.label) for t in cfg.tiers]})


@asynccontextmanager
async def open_tier(tcfg: Any, *, create: bool = False) -> AsyncIterator[Tier]:
    """Open one tier for admin work. A tier whose class says its config points at no data of
    it yet (:meth:`~tieredkv.backends.base.Tier.missing`), or whose local directory holds
    nothing, is "unreachable" unless ``create``: a typo in a path must not create an empty store,
    nor a tier's skeleton in a directory that holds something else. Scans are passive: listing
    records must not count as reading them (a tier that can tell sets ``passive_scans``). No
    tenant quotas are set: an admin write (``migrate``) copies records as they are."""
    if not create:
        path = local_path(tcfg)
        why = tier_class(tcfg.kind).missing(tcfg)
        if why is None and path is not None and not (os.path.isdir(path) and os.listdir(path)):
            why = f"no data at {path}"
        if why is not None:
            raise TierUnavailableError(f"tier {tcfg.label!r} ({tcfg.kind}): {why}; check the path")
    tier: Tier = build_tier(tcfg)
    tier.passive_scans = True
    try:
        await tier.open()
        yield tier
    finally:
        await tier.close()


async def scan_records(
    tier: Tier, namespace: bytes | None, group: int | None, *, catalog: bool = False
) -> AsyncGenerator[RecordInfo, None]:
    """The records of ``tier`` in ``namespace`` / ``group``, lazily (stop early for a bounded job);
    namespace catalog records (:mod:`tieredkv.catalog`) only with ``catalog``."""
    async for info in tier.scan(namespace):
        if (group is None or info.group == group) and (catalog or not is_catalog_key(info.key)):
            yield info


def record_bytes(info: RecordInfo) -> int:
    """Bytes a record takes in its tier (header + payload)."""
    return HEADER_SIZE + info.size


async def delete_keys(tier: Tier, keys: Sequence[bytes], progress: Callable[[int], None] | None = None) -> int:
    n = 0
    for start in range(0, len(keys), DELETE_BATCH):
        run = keys[start : start + DELETE_BATCH]
        n += await tier.delete_many(run)
        if progress is not None:
            progress(len(run))
    return n


def batches(infos: Iterable[RecordInfo], max_bytes: int, max_records: int) -> Iterable[list[RecordInfo]]:
    """Runs of records of at most ``max_bytes`` / ``max_records`` each (never empty)."""
    return runs(infos, record_bytes, max_bytes, max_records)

"""Tenants and their quotas, as the tiers apply them.

A *tenant* is who a record belongs to: vLLM's ``cache_salt`` of the request that stored it, or
the ``tenant=`` of a library call. vLLM folds the salt into its block hashes, so tenants never
share a prefix; they share capacity. A record carries its tenant's 64-bit id
(:func:`tieredkv.keys.tenant_id`; 0 is the default tenant, records without one) in its header
(:mod:`tieredkv.format`, version 2).

:class:`TenantQuotas` is the config's ``tenants`` section made runtime: the quota of a tenant id
in a tier of a given capacity. A tier that bounds tenants (``TierCapabilities.tenants``) keeps
each tenant's bytes and, when a tenant's store would take it over its quota, evicts that
tenant's own records first (its eviction policy's order among them); when the tier itself is
full, records of tenants over their quota go before anyone else's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tieredkv.keys import tenant_id

if TYPE_CHECKING:
    from tieredkv.config import TenantsConfig

__all__ = ["DEFAULT_TENANT", "TenantQuotas", "tenant_label"]

#: The id of records without a tenant: no quota bounds it.
DEFAULT_TENANT = 0


def tenant_label(tid: int, names: Mapping[int, str] | None = None) -> str:
    """How a tenant id is shown (status, ls, metrics): its name when known, else its id in hex;
    ``-`` for the default tenant."""
    if tid == DEFAULT_TENANT:
        return "-"
    if names and tid in names:
        return names[tid]
    return f"{tid:016x}"


def _bytes_of(quota: object, capacity: int | None) -> int | None:
    if isinstance(quota, str) and quota.endswith("%"):
        if capacity is None:
            return None  # a share of an unknown capacity: unbounded here
        return int(capacity * float(quota[:-1]) / 100)
    return int(quota)  # type: ignore[call-overload]


@dataclass(frozen=True)
class TenantQuotas:
    """The quotas of the config's ``tenants`` section, by tenant id."""

    default: object | None = None  # bytes or "NN%"
    by_id: Mapping[int, object] = field(default_factory=dict)
    names: Mapping[int, str] = field(default_factory=dict)  # the tenants the config names
    report_top: int = 20

    @classmethod
    def from_config(cls, cfg: TenantsConfig | None) -> TenantQuotas:
        if cfg is None:
            return cls()
        names = {tenant_id(n): n for n in cfg.quotas}
        return cls(cfg.default_quota, {tenant_id(n): q for n, q in cfg.quotas.items()}, names, cfg.report_top)

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a quota."""
        return self.default is not None or bool(self.by_id)

    def limit(self, tid: int, capacity: int | None) -> int | None:
        """The bytes tenant ``tid`` may hold in a tier of ``capacity`` bytes (None: unbounded)."""
        if tid == DEFAULT_TENANT:
            return None
        quota = self.by_id.get(tid, self.default)
        return None if quota is None else _bytes_of(quota, capacity)

    def label(self, tid: int) -> str:
        return tenant_label(tid, self.names)

    def reported(self, usage: Mapping[int, int]) -> Iterable[int]:
        """The tenant ids worth a metric series: those the config names, and the ``report_top``
        largest by usage (a deployment may have thousands of tenants)."""
        top = sorted(
            (t for t in usage if t not in self.names and t != DEFAULT_TENANT), key=usage.__getitem__, reverse=True
        )
        return [*self.names, *top[: self.report_top]]

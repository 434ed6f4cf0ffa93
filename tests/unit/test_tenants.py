"""Tenant ids and quotas as the config states them."""

from __future__ import annotations

import pytest

from tieredkv.config import load_config
from tieredkv.errors import ConfigError
from tieredkv.keys import tenant_id
from tieredkv.tenants import DEFAULT_TENANT, TenantQuotas, tenant_label


def test_tenant_ids_are_stable_distinct_and_never_the_default() -> None:
    assert tenant_id(None) == tenant_id("") == DEFAULT_TENANT == 0
    a, b = tenant_id("acme"), tenant_id("globex")
    assert a != b and a != 0 and b != 0
    assert tenant_id("acme") == a == tenant_id(b"acme")
    assert 0 < a < 2**64
    assert tenant_label(0) == "-" and tenant_label(a) == f"{a:016x}" and tenant_label(a, {a: "acme"}) == "acme"


def test_quotas_in_bytes_or_a_share_of_each_tiers_capacity() -> None:
    cfg = load_config(
        {"tenants": {"default_quota": "25%", "quotas": {"acme": "1GiB", "globex": "50%"}, "report_top": 2}}
    )
    q = TenantQuotas.from_config(cfg.tenants)
    assert q.enabled
    assert q.limit(tenant_id("acme"), 100 << 30) == 1 << 30
    assert q.limit(tenant_id("acme"), None) == 1 << 30  # bytes need no capacity
    assert q.limit(tenant_id("globex"), 1000) == 500
    assert q.limit(tenant_id("anyone"), 1000) == 250  # the default
    assert q.limit(tenant_id("anyone"), None) is None  # a share of an unknown capacity: unbounded
    assert q.limit(DEFAULT_TENANT, 1000) is None  # records without a tenant: never bounded
    assert q.label(tenant_id("acme")) == "acme"
    usage = {tenant_id(f"t{i}"): i for i in range(10)} | {tenant_id("acme"): 1, 0: 99}
    assert list(q.reported(usage)) == [tenant_id("acme"), tenant_id("globex"), tenant_id("t9"), tenant_id("t8")]
    assert not TenantQuotas.from_config(load_config({}).tenants).enabled


@pytest.mark.parametrize("bad", ["0%", "101%", "x%", "-1GiB", 0, "lots"])
def test_a_bad_quota_names_the_field_and_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"tenants\.quotas\.acme"):
        load_config({"tenants": {"quotas": {"acme": bad}}})

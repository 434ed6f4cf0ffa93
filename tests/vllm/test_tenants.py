"""Tenants on vLLM 0.33's real scheduler: a request's ``cache_salt`` is its tenant.

The engine loop of ``tests/vllm/engine.py`` (vLLM's ``Scheduler``, ``TieredKVConnector`` with
``TieredKVOffloadingSpec`` over one CPU tier of 64 chunks, the emulated model runner checking every
KV byte) runs three phases, the GPU prefix cache reset and the "GPU" KV zeroed between them, so a
later phase's hits come from tieredkv:

1. tenant ``steady`` prefills two prompts (15 chunks, within its 16-chunk quota);
2. tenant ``flood`` prefills eight long prompts (144 chunks: more than twice the whole tier, 18
   times its 8-chunk quota);
3. ``steady`` sends its two prompts again.

With the quotas, every chunk of ``steady``'s is still there and phase 3 loads its whole prompts
from tieredkv; ``flood`` holds at most its quota. The same schedule without a ``tenants`` section
(``flood`` evicts everything older, as every tenant shares one LRU) is the control: ``steady``'s
phase 3 then finds nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import VOCAB, Engine, ReqSpec, _drive, cpu_workers
from tieredkv.keys import tenant_id

pytestmark = pytest.mark.vllm

TKC = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tieredkv.integrations.vllm"}
CHUNK = 16 * 64  # one full-attention block of 16 tokens, 64 bytes a token: one chunk (blocks_per_chunk 1)
STEADY_PROMPTS = (150, 100)  # 9 + 6 whole chunks stored
FLOOD_PROMPTS = 8 * (300,)  # 18 whole chunks each


def workload() -> list[list[ReqSpec]]:
    rng = random.Random(7)

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, VOCAB) for _ in range(n))

    steady = [ReqSpec(f"S{i}", i, prompt(n), 2, "steady", cache_salt="steady") for i, n in enumerate(STEADY_PROMPTS)]
    flood = [ReqSpec(f"F{i}", i, prompt(n), 2, "flood", cache_salt="flood") for i, n in enumerate(FLOOD_PROMPTS)]
    again = [ReqSpec(f"{r.name}x", r.arrival, r.prompt, 2, "steady again", cache_salt="steady") for r in steady]
    return [steady, flood, again]


def run(tmp_path: Path, tenants: dict[str, Any] | None) -> tuple[Any, dict[int, int] | None, dict[str, int]]:
    config = {
        "namespace": {"model": "engine-tenants"},
        "tiers": [
            {"kind": "cpu", "name": "cpu", "capacity_bytes": 64 * CHUNK, "segment_bytes": 64 * CHUNK,
             "min_slot_bytes": CHUNK},
        ],
        "pipeline": {"staging_bytes": "1MiB"},
        **({"tenants": tenants} if tenants else {}),
    }  # fmt: skip
    path = tmp_path / ("quotas.json" if tenants else "shared.json")
    path.write_text(json.dumps(config))
    extra = {
        "spec_name": "TieredKVOffloadingSpec",
        "spec_module_path": "tieredkv.integrations.vllm",
        "tieredkv_config": str(path),
    }
    eng = Engine(extra, settle=True, num_gpu_blocks=64, **TKC)
    try:
        _drive(eng, workload(), step_budget=3000, idle_grace_steps=200, idle_sleep=0.001)
        store = eng.connector_scheduler.manager.store  # type: ignore[union-attr]
        assert store.drain(30)
        usage = store.tenant_usage()["cpu"]
        counters = dict(store.tiers[0].counters)
    finally:
        eng.shutdown()
    return eng, usage, counters


def steady_hits(eng: Any) -> dict[str, int]:
    """Tokens each of phase 3's requests loaded from tieredkv."""
    return {rec.name: sum(rec.external_hits) for rec in eng.records.values() if rec.phase == 2}


def test_a_flooding_tenant_leaves_the_others_records_within_their_quota(tmp_path: Path) -> None:
    eng, usage, counters = run(tmp_path, {"quotas": {"steady": 16 * CHUNK, "flood": 8 * CHUNK}})
    res = eng.result
    assert all(res.phase_idle) and res.wrong_slots == 0 and not res.unfinished_requests, res.summary()
    whole = {f"S{i}x": (n - 1) // 16 * 16 for i, n in enumerate(STEADY_PROMPTS)}  # vLLM never hits the last token
    assert steady_hits(eng) == whole  # every chunk steady stored was still there
    assert usage is not None
    assert usage[tenant_id("steady")] == sum(n // 16 for n in STEADY_PROMPTS) * CHUNK  # 15 chunks
    assert 0 < usage[tenant_id("flood")] <= 8 * CHUNK
    assert usage[0] == 0  # every record has its request's tenant
    assert counters["tenant_evictions"] == counters["evictions"] > 0  # flood's own, and only those

    control, shared, _ = run(tmp_path, None)  # no quotas: one LRU for everybody
    assert all(control.result.phase_idle) and control.result.wrong_slots == 0
    assert steady_hits(control) == {name: 0 for name in whole}  # the flood took them all
    assert shared is not None and shared[tenant_id("flood")] > 32 * CHUNK  # unbounded: half the tier and more


def test_secondary_tier_stores_each_row_as_its_requests_tenant(tmp_path: Path) -> None:
    """Under vLLM's ``TieringOffloadingSpec`` a cascade job carries the request's ``ReqContext``:
    ``TieredKVSecondaryTier`` stores its rows as the request's tenant's records (the salt that
    ``TieredKVConnector`` recorded), bounded by the tenant's quota in tieredkv's tiers."""
    config = {
        "namespace": {"model": "engine-tenants-secondary"},
        "tiers": [
            {"kind": "cpu", "name": "cpu", "capacity_bytes": "1MiB", "segment_bytes": "1MiB", "min_slot_bytes": CHUNK}
        ],
        "tenants": {"quotas": {"flood": "32KiB"}},
    }
    path = tmp_path / "secondary.json"
    path.write_text(json.dumps(config))
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "TieredKVSecondaryTier", "module_path": "tieredkv.integrations.vllm", "config": str(path)}
        ],
    }
    with cpu_workers(extra, True):
        eng = Engine(extra, settle=True, num_gpu_blocks=64, **TKC)
        try:
            _drive(eng, workload()[:2], step_budget=3000, idle_grace_steps=200, idle_sleep=0.001)
            (tier,) = eng.connector_scheduler.manager.secondary_tiers  # type: ignore[union-attr]
            assert tier.wait_idle(30)
            usage = tier.store.tenant_usage()["cpu"]
            row = int(tier.block_size_bytes)  # vLLM's primary row: one chunk, padded
        finally:
            eng.shutdown()
    res = eng.result
    assert all(res.phase_idle) and res.wrong_slots == 0 and not res.unfinished_requests, res.summary()
    assert usage is not None and usage[0] == 0  # every row under its request's tenant
    assert usage[tenant_id("steady")] == sum(n // 16 for n in STEADY_PROMPTS) * row  # no quota: all 15 rows
    assert 0 < usage[tenant_id("flood")] <= 32 * 1024 < 144 * row  # its quota held it (its own rows evicted)


def test_the_tenant_of_a_request_context() -> None:
    from vllm.v1.kv_offload.base import ReqContext

    from tieredkv.integrations.vllm.tenants import request_tenant, set_request_tenant

    assert request_tenant(ReqContext(req_id="plain")) == 0
    assert request_tenant(ReqContext(req_id="p", kv_transfer_params={"cache_salt": "acme"})) == tenant_id("acme")
    ctx = ReqContext(req_id="c", kv_transfer_params={"cache_salt": "from-params"})
    assert set_request_tenant(ctx, "from-request") == tenant_id("from-request")  # TieredKVConnector's wins
    assert request_tenant(ctx) == tenant_id("from-request")
    assert request_tenant(ReqContext(req_id="x", kv_transfer_params={"cache_salt": 5})) == 0  # not a salt

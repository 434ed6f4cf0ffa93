"""The cases vLLM 0.33.0's own offloading-connector suite found, on the engine loop of our own.

vLLM's suite (``./scripts/test-vllm``, ``tests/vllm/peer/``) runs against ``TieredKVConnector``
with a mocked manager. Each case here runs the real scheduler, the real worker side and a real
manager (vLLM's ``CPUOffloadingSpec``, or tieredkv's spec), every KV byte checked, next to vLLM's
own ``OffloadingConnector`` on the same schedule:

* the manager's ``RequestOffloadingContext`` (``REQUEST_LEVEL``: a tier that supplies peers needs
  every chunk of the request) honoured: the loaded prefix is offered to ``prepare_store`` again;
* a sliding-window chunk with a null block a lookup reads is not stored (vLLM's store mask None
  means every block is read): behind vLLM's CPU spec its unwritten block was loaded as KV;
* the one intended difference (``test_scheduler_reports_allocation_failure``): a refused finished
  request is retried, each refused retry one more ``allocation_failure``, bounded by the hold.

Also from the suite, in ``test_connector.py``: the manager's lock read from the instance
(``test_manager_lock_*``) and keys left out of ``keys_to_store`` taken as declined
(``test_case_declined_keys_stay_declined``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import ReqSpec, RunResult, _patched, reference_extra_config, run_engine
from tests.vllm.faults import StoreFault
from tests.vllm.test_connector import TKC
from tests.vllm.test_engine_loop import _tiers_file, spec_extra
from tieredkv.keys import key_group

pytestmark = pytest.mark.vllm


class _PolicyManager:
    """A real manager whose ``on_new_request`` answers ``policy`` for the requests named ``b-*``
    (the rest: the manager's own answer); it records, per request, the keys offered to
    ``prepare_store`` and the keys ``prepare_load`` read."""

    def __init__(self, inner: Any, policy: Any) -> None:
        self._inner = inner
        self._policy = policy
        self.offered: dict[str, set[bytes]] = {}
        self.loaded: dict[str, set[bytes]] = {}

    def on_new_request(self, ctx: Any) -> Any:
        out = self._inner.on_new_request(ctx)
        return dataclasses.replace(out, policy=self._policy) if ctx.req_id.startswith("b-") else out

    def prepare_store(self, keys: Any, ctx: Any) -> Any:
        keys = list(keys)
        self.offered.setdefault(ctx.req_id, set()).update(map(bytes, keys))
        return self._inner.prepare_store(keys, ctx)

    def prepare_load(self, keys: Any, ctx: Any) -> Any:
        keys = list(keys)
        self.loaded.setdefault(ctx.req_id, set()).update(map(bytes, keys))
        return self._inner.prepare_load(keys, ctx)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def assert_small_run_healthy(name: str, r: RunResult) -> None:
    """``assert_healthy`` of the engine loop, for a workload of a few requests."""
    assert r.error is None, (name, r.error, r.wrong_examples[:2])
    assert r.stalled is None and r.idle_reached, (name, r.stalled, r.phase_idle)
    assert r.wrong_bytes == 0 and r.wrong_slots == 0, (name, r.wrong_examples[:3])
    assert not r.wrong_outputs and not r.unfinished_requests, (name, r.wrong_outputs, r.unfinished_requests)
    assert r.checked_slots > 0 and r.external_hit_tokens > 0, (name, r.checked_slots, r.external_hit_tokens)


@contextlib.contextmanager
def _policy_managers(spec_cls: Any, policy: Any) -> Iterator[list[_PolicyManager]]:
    """``spec_cls`` hands out its (real) manager wrapped in :class:`_PolicyManager`."""
    made: list[_PolicyManager] = []
    real = spec_cls.get_manager

    def get_manager(self: Any) -> Any:
        inner = real(self)
        for m in made:
            if m._inner is inner:
                return m
        made.append(_PolicyManager(inner, policy))
        return made[-1]

    with _patched(spec_cls, "get_manager", get_manager):
        yield made


def _spec(kind: str, tmp_path: Path) -> tuple[dict[str, Any], Any]:
    if kind == "cpu":
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        return reference_extra_config(2), CPUOffloadingSpec
    from tieredkv.integrations.vllm.spec import TieredKVOffloadingSpec

    return spec_extra(2, _tiers_file(tmp_path / kind, "lmdb")), TieredKVOffloadingSpec


PROMPT = tuple(range(3, 3 + 128))
#: "a" computes and stores the prompt; the GPU prefix cache is reset (every "GPU" byte zeroed);
#: "b" shares the prompt, loads it from the store and goes on for 64 tokens.
WORKLOAD = [[ReqSpec("a", 0, PROMPT, 2)], [ReqSpec("b", 0, PROMPT + tuple(range(500, 564)), 2)]]


@pytest.mark.parametrize("spec", ["cpu", "tieredkv"])
@pytest.mark.parametrize("groups", [("full",), ("full", "swa")], ids=["full", "full+swa"])
def test_request_level_policy_offers_the_loaded_prefix(spec: str, groups: tuple[str, ...], tmp_path: Path) -> None:
    """vLLM's ``test_request_level_policy_stores_all_blocks`` and
    ``test_request_level_supply_covers_consumer_demand``, with a real manager: under
    ``REQUEST_LEVEL`` every full-attention key "b" loaded is offered to ``prepare_store`` again, and
    every loaded key vLLM's connector offers (its sliding-window keys: those a later lookup can
    reach); under ``CHUNK_LEVEL`` none is (the loaded prefix is held already)."""
    from vllm.v1.kv_offload.base import OffloadPolicy

    offered: dict[tuple[str, str], set[bytes]] = {}
    loaded: dict[tuple[str, str], set[bytes]] = {}
    runs = [
        ("vllm", OffloadPolicy.REQUEST_LEVEL),
        ("tkc", OffloadPolicy.REQUEST_LEVEL),
        ("tkc", OffloadPolicy.CHUNK_LEVEL),
    ]
    for n, (connector, policy) in enumerate(runs):
        extra, spec_cls = _spec(spec, tmp_path / str(n))
        kw = TKC if connector == "tkc" else {}
        with _policy_managers(spec_cls, policy) as made:
            r = run_engine(extra, groups=groups, blocks_per_chunk=2, workload=WORKLOAD, **kw)
        assert_small_run_healthy(f"{connector} {policy.name}", r)
        (m,) = made
        (b,) = [rid for rid in m.loaded if rid.startswith("b-")]
        offered[connector, policy.name] = m.offered.get(b, set())
        loaded[connector, policy.name] = m.loaded[b]
        assert len(m.loaded[b]) >= len(PROMPT) // 32 - 1, ("b loads the shared prompt", connector, policy)
    for run in (("vllm", "REQUEST_LEVEL"), ("tkc", "REQUEST_LEVEL")):
        full = {k for k in loaded[run] if key_group(k) == 0}
        missing = full - offered[run]
        assert full and not missing, (run, f"{len(missing)} of {len(full)} loaded keys never offered to prepare_store")
    # sliding window: vLLM offers the loaded chunks a later lookup can reach; tieredkv at least those
    vllm_offered = loaded["vllm", "REQUEST_LEVEL"] & offered["vllm", "REQUEST_LEVEL"]
    assert vllm_offered <= offered["tkc", "REQUEST_LEVEL"]
    assert not loaded["tkc", "CHUNK_LEVEL"] & offered["tkc", "CHUNK_LEVEL"], "chunk level: the loaded prefix is held"


def test_sliding_window_chunk_with_a_null_block_a_lookup_reads_is_not_stored() -> None:
    """vLLM's ``test_sliding_window_chunk_with_null_block_is_not_stored`` with its real CPU spec
    (``store_threshold: 2``, so "a" stores nothing) and dense prefix-cache retention
    (``prefix_cache_retention_interval`` None: vLLM's store mask is None, every block read): "b"
    extends "a"'s prompt and hits it in the GPU
    prefix cache, which allocates its sliding-window block 0 as null (out of the window at the hit);
    "b" then offers chunk 0. A later lookup from 32 tokens reads block 0, so vLLM's connector does
    not store the sliding-window chunk; ``TieredKVConnector`` stored it as a partial chunk (vLLM's
    mask said "every block" and the planner took that as "no leading block read"), vLLM's spec
    stored the chunk whole, and "c" loaded an unwritten block as KV."""
    prompt = tuple(range(3, 3 + 48))
    workload = [
        [ReqSpec("a", 0, prompt, 2), ReqSpec("b", 10_000, prompt + (999,), 2)],
        [ReqSpec("c", 0, prompt[:32] + tuple(range(600, 617)), 2)],
    ]
    extra = dict(reference_extra_config(2), store_threshold=2)
    hits = {}
    for name, kw in (("vllm", {}), ("tkc", TKC)):
        r = run_engine(
            extra, groups=("full", "swa"), blocks_per_chunk=2, workload=workload, retention_interval=None, **kw
        )
        print(name, r.summary())
        assert r.error is None and r.idle_reached, (name, r.error, r.wrong_examples)
        assert r.wrong_bytes == 0 and r.wrong_slots == 0, (name, r.wrong_examples[:3])
        assert r.keys_accepted, (name, "b stored its full-attention chunk 0")
        hits[name] = r.hit_tokens
    assert hits["tkc"] == hits["vllm"], hits


def test_refused_finished_request_is_retried_each_retry_an_allocation_failure() -> None:
    """The intended difference behind vLLM's ``test_scheduler_reports_allocation_failure`` (it
    expects 2: a refusal while running, one at the finished pass): a store that refuses every
    call. vLLM's connector gives the finished request's chunks up at once;
    ``TieredKVConnector`` holds its blocks and offers them again each step, at most
    ``hold_finished_steps`` times, and vLLM's ``allocation_failure`` counter (a refused
    ``prepare_store`` call) counts each retry. What the retries buy when the store takes them:
    ``test_connector.py::test_case_refusal_on_the_last_pass`` (vLLM loses those chunks)."""
    workload = [[ReqSpec("a", 0, tuple(range(3, 3 + 64)), 2)]]
    runs = {}
    for name, kw in (("vllm", {}), ("tkc", TKC)):
        r = run_engine(reference_extra_config(1), workload=workload, store_fault=StoreFault("always"), **kw)
        print(name, r.summary(), r.prepare_store_refused, r.connector_counters)
        assert r.error is None and r.idle_reached and r.wrong_bytes == 0, (name, r.error, r.wrong_examples)
        runs[name] = r
    ref, tkc = runs["vllm"], runs["tkc"]
    c = tkc.connector_counters
    assert c is not None and c["held_requests"] == 1 and c["chunks_given_up"] == 64 // 16, c
    retries = tkc.prepare_store_refused - c["held_steps"]
    assert ref.prepare_store_refused == retries, (ref.prepare_store_refused, tkc.prepare_store_refused, c)
    assert 0 < c["held_steps"] <= 16, c  # hold_finished_steps (default 16)

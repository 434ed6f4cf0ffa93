"""Engine-loop harness: vLLM 0.33's real scheduler + KV connector, an emulated model runner that
writes and checks every KV byte a forward reads, a deterministic multi-phase workload.

API
---
``run_engine(extra_config, *, groups=("full",), blocks_per_chunk=1, async_scheduling=False, seed=0,
step_budget=3000, kv_connector="OffloadingConnector", kv_connector_module_path=None,
tiering_cpu_worker=False, num_gpu_blocks=None, idle_grace_steps=200, idle_sleep=0.001,
stall_steps=200, long_prefill_token_threshold=24, reset_connector=False, workload=None,
on_phase=None) -> RunResult``

* ``workload``: phases of ``ReqSpec`` (name, arrival step, prompt, max_tokens, ``cache_salt``,
  ``kv_transfer_params`` — e.g. ``kv_load_tiers``, ``max_load_tokens`` — and ``kv_hints``, a vLLM
  ``KvHintsEnvelope``); ``on_phase(engine, i)`` runs before phase ``i`` and, once every phase went
  idle, with ``i == len(phases)`` (the stores still open: read what they hold).

* ``extra_config``: ``kv_connector_extra_config`` (``spec_name``, ``spec_module_path``, the spec's
  own keys); ``blocks_per_chunk`` is written into it. ``kv_connector`` /
  ``kv_connector_module_path`` select another connector (both roles are built by vLLM's
  ``KVConnectorFactory``); the offloading-specific metrics are then left at 0 / None.
* ``groups``: ``("full",)``, ``("full", "swa")`` or ``("full", "swa", "mamba")``. Full attention
  block 16; sliding window block 16, window 32; Mamba ``MambaSpec(mamba_cache_mode="align")``
  block 64, so ``cache_config.block_size`` (the Mamba block the scheduler aligns chunks to) and the
  scheduler block size are 64 and block hashes stay at 16 tokens (``resolve_kv_cache_block_sizes``
  and ``resolve_cache_hit_alignment_tokens`` are applied as ``EngineCore`` does). One CPU tensor per
  layer (one layer per group); prefix caching on.
* ``reference_extra_config(blocks_per_chunk, delay_steps=0)``: vLLM's own ``CPUOffloadingSpec`` with
  64 MiB. Its worker is CUDA-only; for the run ``CPUOffloadingSpec.get_worker`` is patched to
  ``tests.vllm.cpu_worker.cpu_offloading_get_worker`` (a CPU twin of vLLM's worker; ``delay_steps``
  makes it copy late, at completion). ``tiering_cpu_worker=True`` patches
  ``TieringOffloadingSpec.get_worker`` the same way (primary tier of vLLM's tiering spec).
* ``write_tieredkv_config(path, "lmdb"|"cpu")`` + ``tieredkv_extra_config(bpc, path)``:
  ``TieredKVOffloadingSpec``.
* ``run_matrix(make_extra, ...)``: groups × blocks_per_chunk × async; ``python -m tests.vllm.engine``
  prints the reference matrix.
* ``Engine`` is the engine itself (``add_request(ReqSpec)``, ``step()``, ``has_work()``) for
  callers that want their own schedule; ``build_workload(seed)`` is the default one.

The engine loop
---------------
``EngineCore``'s: without async scheduling ``step()`` (schedule → execute → ``update_from_output``);
with it (``AsyncScheduler``) ``step_with_batch_queue()`` with a batch queue of 2, so a step's output
is applied only after the next step was scheduled, with the engine's early return while the queue
is not full. The emulated worker executes a batch when it is scheduled (a GPU runs batches in
order, so this is the device order; the sampled token it feeds the next step is its own, not the
scheduler's placeholder). *Idle* is ``EngineCore.has_work()`` False: ``scheduler.has_requests()``
(which includes ``connector.has_pending_push_work()``) False and the batch queue empty. A step that
scheduled nothing while requests remain sleeps ``idle_sleep`` (the engine core sleeps 1 ms there);
nothing else waits on wall time.

Workload (``build_workload(seed)``, deterministic): phase 1, six requests of 160-400 tokens arriving
over 8 steps (B shares a 176-216 token prefix with A, C extends A's prompt, E shares a prefix with
D, F is long); phase 2, second turns of A and B (prompt + output + new tokens), F's prompt again, a
new request and a mid-prompt share with E; phase 3, third/second turns of A, C, D, G and a new one.
``max_tokens`` 2-8. Between phases the GPU prefix cache is reset
(``reset_prefix_cache(reset_connector=False)``) and every "GPU" KV byte is zeroed, so hits must come
from the offload tier. Chunked prefill with ``max_num_batched_tokens`` 56 and a 24-token per-request
cap (``long_prefill_token_threshold``; several prefills advance per step), ``max_num_seqs`` 6, and a
small pool (``DEFAULT_GPU_BLOCKS``: 32 / 44 / 56 blocks) so requests are preempted and resumed. A
phase ends when the engine is idle. If its requests all finished but it is not idle
``idle_grace_steps`` steps later, the phase is recorded not idle and the next one starts anyway (GPU
zeroing then only if no transfer is in flight). If requests remain but nothing was scheduled for
``stall_steps`` steps with no transfer or lookup in flight (:meth:`Engine.no_transfers`),
``RunResult.stalled`` says what was left and the run stops (vLLM 0.33 can deadlock so; see
``test_engine_harness_smoke.test_no_progress_is_reported``).
``step_budget`` bounds the whole run (``budget_exhausted``, ``idle_reached`` False; no exception).

The emulated model runner
-------------------------
Per step, in ``GPUModelRunner.execute_model``'s order: ``handle_preemptions`` (last step's deferred
stores are submitted here) → ``_update_states`` (drop finished requests; zero
``new_block_ids_to_zero``; apply ``kv_cache_block_copies``, the Mamba partial-hit copy-on-write; new
/ resumed / running block tables, append-only like the runner's) → ``preprocess_mamba`` (state slot
``prev`` = the last step's, or ``(c - 1) // 64`` for a new/resumed request; ``curr = cdiv(c + n, 64)
- 1``; copy ``prev`` → ``curr`` when they differ) → bind metadata, sync loads → **check** → the
forward's writes → async loads (``start_load_kv`` runs after the forward when no load is sync) →
``wait_for_save`` → ``get_transfer_results`` → ``build_connector_worker_meta`` → clear.

Tokens: prompts, then each sampled token is a function of the whole prefix (outputs, replays after
preemption and multi-turn prompts agree everywhere; finished requests' outputs are compared with it,
``wrong_outputs``). KV of token p in a layer: a function of (hash of tokens 0..p, layer), 64 bytes
per slot. A Mamba state: a function of (hash of all tokens so far, their count). Checked every
step for every scheduled request with ``c = num_computed``, ``n`` scheduled:

* full attention: every token slot in ``[0, c)``;
* sliding window: ``[c - 31, c)`` (the query at ``c`` sees the 31 tokens before it);
* Mamba: for ``c > 0``, block ``curr`` after the pre-copy (where the kernel reads its initial state)
  must hold the state after exactly ``c`` tokens; the forward then writes the state after ``c + n``
  there (the emulation writes the right state even after a wrong read, so one error counts once).

A wrong slot is counted (``wrong_slots``, ``wrong_bytes``, the first few in ``wrong_examples``),
never asserted. Known vLLM 0.33 bug, counted apart in ``mamba_off_grid_*``: the lookup rounds the
hit to the Mamba chunk once, before the other groups shrink it; when the full-attention or
sliding-window group leaves it off the Mamba chunk grid, ``update_state_after_alloc`` still loads
Mamba chunk ``cdiv(hit, chunk) - 1`` into block ``cdiv(hit, 64) - 1`` (the state after the next
grid point, or with ``blocks_per_chunk`` > 1 a sub-slot nothing was stored in, i.e. zeros), and that
block may then reach other requests through the GPU prefix cache. The harness tracks where every
Mamba block's bytes came from, so a wrong state read from such a block goes to
``mamba_off_grid_wrong_*`` and one from a regular load to ``wrong_*``; ``mamba_loaded_states_ok /
_checked`` count states read right after a regular (on-grid) load.

Metrics (``RunResult``): steps, idle_reached (+ per phase), stalled, wrong/checked slots and bytes,
hit_tokens per group (sum over load jobs the worker receives of ``dst_spec.group_sizes[g] * block
tokens``; a Mamba state block counts 64), stored_tokens likewise for stores, external_hit_tokens and
per request ``matched`` (answers of ``get_num_new_matched_tokens``) / ``external_hits``
(``num_external_tokens`` given to ``update_state_after_alloc``), preemptions, deferred_lookups
(``None`` answers), max_request_steps (arrival → finish, slowest request), keys_offered /
keys_accepted (``manager.prepare_store``), prepare_store_refused, flushed_jobs, block_copies,
mamba_precopies; first_hit_tokens (hit_tokens over each request's first load before any
preemption), reoffered_keys (offered although accepted before), connector_s (time in the
connector's scheduler-side hooks), connector_counters (``TieredKVConnector``'s own); with a
``store_fault`` (``tests/vllm/faults.py``) fault_refused_keys and lost_keys per group.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tieredkv.keys import key_group

TINY_MODEL = Path(__file__).parent / "models" / "tiny-llama"
EOS = 2
VOCAB = 1000
ATTN_BLOCK = 16
WINDOW = 32
MAMBA_BLOCK = 64
HEAD_SIZE = 8  # one KV head of 8 float32: 64 bytes per token slot (K and V)
MAMBA_WORDS = 16  # one Mamba state: 16 int32 words (64 bytes) per block
MAX_MODEL_LEN = 1024
MAX_BATCHED_TOKENS = 56
MAX_NUM_SEQS = 6
GROUP_SETS = (("full",), ("full", "swa"), ("full", "swa", "mamba"))
LAYER = {
    "full": "model.layers.0.self_attn.attn",
    "swa": "model.layers.1.self_attn.attn",
    "mamba": "model.layers.2.mixer",
}
LAYER_SALT = {"full": 1, "swa": 2, "mamba": 3}
BLOCK_TOKENS = {"full": ATTN_BLOCK, "swa": ATTN_BLOCK, "mamba": MAMBA_BLOCK}
# Small enough that requests are preempted and resumed in every group set's default schedule.
DEFAULT_GPU_BLOCKS = {("full",): 32, ("full", "swa"): 44, ("full", "swa", "mamba"): 56}
# Per-request prefill chunk cap (``long_prefill_token_threshold``): several prefills advance each
# step, so running requests outgrow the pool and are preempted.
LONG_PREFILL_THRESHOLD = 24

_M61 = (1 << 61) - 1
_H0 = 0x2545F4914F6CDD1D % _M61
# int64 constants for the torch-side mixing (products wrap around, deterministically)
_K1 = torch.tensor(0x1E3779B97F4A7C15, dtype=torch.int64)
_K2 = torch.tensor(0x632BE59BD9B4E019, dtype=torch.int64)
_K3 = torch.tensor(0x14D049BB133111EB, dtype=torch.int64)
_LANES = torch.arange(2 * HEAD_SIZE, dtype=torch.int64)
_MLANES = torch.arange(MAMBA_WORDS, dtype=torch.int64)


def _mix(h: int, tok: int) -> int:
    return (h * 1_000_003 + tok * 7_919 + 1) % _M61


def next_token(h: int) -> int:
    """The token the emulated model samples after a prefix whose hash is ``h`` (never EOS)."""
    return 3 + (h * 2_654_435_761 >> 7) % (VOCAB - 3)


def continuation(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens the emulated model generates after ``prompt``."""
    h = _H0
    for t in prompt:
        h = _mix(h, t)
    out = []
    for _ in range(n):
        t = next_token(h)
        out.append(t)
        h = _mix(h, t)
    return out


class _Seq:
    """One request's true token sequence (prompt + deterministic samples) and prefix hashes."""

    __slots__ = ("_ht", "_ht_len", "hashes", "tokens")

    def __init__(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.hashes = [_H0]
        self._ht: torch.Tensor | None = None
        self._ht_len = 0
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        h = self.hashes[-1]
        for t in self.tokens[len(self.hashes) - 1 :]:
            h = _mix(h, t)
            self.hashes.append(h)

    def ensure(self, n: int) -> None:
        """Make tokens[0:n] (and hashes[0:n+1]) known, sampling past the prompt."""
        while len(self.tokens) < n:
            self.tokens.append(next_token(self.hashes[len(self.tokens)]))
            self._extend_hashes()

    def ht(self, n: int) -> torch.Tensor:
        """hashes[0:n+1] as an int64 tensor."""
        self.ensure(n)
        if self._ht is None or self._ht_len < n + 1:
            self._ht = torch.tensor(self.hashes, dtype=torch.int64)
            self._ht_len = len(self.hashes)
        return self._ht[: n + 1]

    def kv(self, layer: str, start: int, end: int) -> torch.Tensor:
        """Expected int32 words (n, 2, HEAD_SIZE) of token slots [start, end) in ``layer``."""
        h = self.ht(end)[start + 1 : end + 1]
        y = h[:, None] * _K1 + (_LANES[None, :] + 16 * LAYER_SALT[layer]) * _K2
        return ((y >> 20) & 0x7FFFFFFF).to(torch.int32).view(-1, 2, HEAD_SIZE)

    def state(self, n: int) -> torch.Tensor:
        """Expected Mamba state words after exactly ``n`` tokens."""
        h = self.ht(n)[n]
        y = h * _K1 + (_MLANES + 16 * LAYER_SALT["mamba"]) * _K2 + n * _K3
        return ((y >> 20) & 0x7FFFFFFF).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReqSpec:
    name: str
    arrival: int  # engine steps after the phase started
    prompt: tuple[int, ...]
    max_tokens: int
    note: str = ""
    cache_salt: str | None = None  # the request's tenant (vLLM folds it into the first block hash)
    kv_transfer_params: dict[str, Any] | None = None  # SamplingParams.extra_args["kv_transfer_params"]
    kv_hints: Any = None  # a vLLM KvHintsEnvelope (Request.kv_hints)


def build_workload(seed: int = 0) -> list[list[ReqSpec]]:
    """Three phases of requests (see the module docstring); deterministic per ``seed``."""
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    def mt() -> int:
        return rng.randint(2, 8)

    out: dict[str, tuple[list[int], int]] = {}

    def req(name: str, arrival: int, prompt: list[int], note: str) -> ReqSpec:
        m = mt()
        out[name] = (prompt, m)
        return ReqSpec(name, arrival, tuple(prompt), m, note)

    def turn(name: str) -> list[int]:
        prompt, m = out[name]
        return prompt + continuation(prompt, m)

    a = rand(rng.randint(240, 300))
    d = rand(rng.randint(160, 220))
    p1 = [
        req("A", 0, a, "new"),
        req("B", 1, a[: rng.randint(176, 216)] + rand(rng.randint(100, 150)), "long shared prefix with A"),
        req("D", 2, d, "new"),
        req("C", 4, a + rand(rng.randint(40, 80)), "extends A's prompt"),
        req("E", 5, d[: rng.randint(100, 140)] + rand(rng.randint(120, 180)), "shared prefix with D"),
        req("F", 7, rand(rng.randint(330, 400)), "new, long"),
    ]
    p2 = [
        req("A2", 0, turn("A") + rand(rng.randint(40, 70)), "second turn of A"),
        req("F2", 0, list(out["F"][0]), "F's prompt again"),
        req("B2", 2, turn("B") + rand(rng.randint(30, 50)), "second turn of B"),
        req("G", 3, rand(rng.randint(200, 260)), "new"),
        req(
            "E2",
            4,
            list(out["E"][0][: rng.randint(150, len(out["E"][0]) - 20)]) + rand(rng.randint(60, 90)),
            "mid-prompt share with E",
        ),
    ]
    p3 = [
        req("A3", 0, turn("A2") + rand(rng.randint(30, 50)), "third turn of A"),
        req("C3", 1, turn("C") + rand(rng.randint(30, 60)), "second turn of C"),
        req("D3", 1, turn("D") + rand(rng.randint(20, 40)), "second turn of D"),
        req("G2", 3, turn("G") + rand(rng.randint(40, 60)), "second turn of G"),
        req("H", 3, rand(rng.randint(150, 200)), "new"),
    ]
    return [p1, p2, p3]


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    name: str
    req_id: str
    phase: int
    num_prompt_tokens: int
    arrival_step: int
    finish_step: int | None = None
    # what get_num_new_matched_tokens answered, per lookup (None: deferred)
    matched: list[int | None] = field(default_factory=list)
    external_hits: list[int] = field(default_factory=list)  # num_external_tokens per admission
    preemptions: int = 0
    output_ok: bool | None = None  # outputs == the deterministic model's


@dataclass
class RunResult:
    groups: tuple[str, ...]
    blocks_per_chunk: int
    async_scheduling: bool
    steps: int = 0
    idle_reached: bool = False
    phase_idle: list[bool] = field(default_factory=list)
    # steps from the phase's last finished request until idle (None: not idle)
    phase_steps_to_idle: list[int | None] = field(default_factory=list)
    phase_reset_ok: list[bool] = field(default_factory=list)
    phase_zeroed: list[bool] = field(default_factory=list)
    budget_exhausted: bool = False
    # set when requests remain unfinished but nothing was scheduled for ``stall_steps`` steps
    # with no transfer in flight (the scheduler cannot make progress): what was left
    stalled: str | None = None
    empty_steps: int = 0  # steps that scheduled no token
    block_copies: int = 0  # kv_cache_block_copies applied (Mamba partial-hit copy-on-write)
    mamba_precopies: int = 0  # preprocess_mamba copies (previous state block -> this step's)
    checked_slots: int = 0
    checked_bytes: int = 0
    wrong_slots: int = 0
    wrong_bytes: int = 0
    wrong_examples: list[str] = field(default_factory=list)
    mamba_states_checked: int = 0
    # Mamba states read by a forward that came from an on-grid load (and how many were right)
    mamba_loaded_states_checked: int = 0
    mamba_loaded_states_ok: int = 0
    mamba_off_grid_loads: int = 0  # loads whose boundary is off the Mamba chunk grid
    mamba_off_grid_wrong_slots: int = 0
    mamba_off_grid_wrong_bytes: int = 0
    mamba_off_grid_examples: list[str] = field(default_factory=list)
    # tokens loaded from the offload tier per group: sum over load jobs of group_sizes[g] * block
    hit_tokens: dict[str, int] = field(default_factory=dict)
    # the same, only over each request's first load before any preemption (a reload after a
    # preemption brings back the request's own KV: it depends on which request was preempted)
    first_hit_tokens: dict[str, int] = field(default_factory=dict)
    load_jobs: int = 0
    stored_tokens: dict[str, int] = field(default_factory=dict)  # same, over store jobs
    store_jobs: int = 0
    flushed_jobs: int = 0
    external_hit_tokens: int = 0  # sum over admissions of num_external_tokens
    preemptions: int = 0
    deferred_lookups: int = 0  # get_num_new_matched_tokens returned None
    lookups: int = 0
    max_request_steps: int = 0  # arrival → finish, the slowest request
    unfinished_requests: list[str] = field(default_factory=list)
    wrong_outputs: list[str] = field(default_factory=list)
    keys_offered: int | None = None  # to manager.prepare_store (OffloadingConnector only)
    keys_accepted: int | None = None
    prepare_store_calls: int | None = None
    prepare_store_refused: int | None = None  # returned None
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    # store faults (``store_fault``): keys a fault refused or cut off, and of those the ones never
    # accepted later nor held by the manager at the end of the run (lost), per group name
    fault_refused_keys: int = 0
    lost_keys: dict[str, int] = field(default_factory=dict)
    # keys offered again although the manager had accepted them before (re-offers)
    reoffered_keys: int = 0
    # wall time spent in the connector's scheduler-side hooks (lookups, allocation, metadata, outputs)
    connector_s: float = 0.0
    # TieredKVConnector's own counters (``ConnectorCounters``), None for other connectors
    connector_counters: dict[str, int] | None = None
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Idle, every request finished with the model's outputs, no wrong byte, no error.
        (Wrong Mamba states from off-grid loads, a vLLM bug, are counted apart.)"""
        return (
            self.error is None
            and self.stalled is None
            and self.idle_reached
            and self.wrong_bytes == 0
            and not self.wrong_outputs
            and not self.unfinished_requests
        )

    def summary(self) -> str:
        hits = " ".join(f"{g}={self.hit_tokens.get(g, 0)}" for g in self.groups)
        s = (
            f"{'+'.join(self.groups):15} bpc={self.blocks_per_chunk} async={int(self.async_scheduling)} "
            f"steps={self.steps:4d} idle={int(self.idle_reached)} preempt={self.preemptions:2d} "
            f"hits[{hits}] ext={self.external_hit_tokens} wrong={self.wrong_bytes}B/{self.wrong_slots} "
            f"checked={self.checked_slots} deferred={self.deferred_lookups} "
            f"keys={self.keys_accepted}/{self.keys_offered} maxreq={self.max_request_steps} "
            f"{self.wall_s:.2f}s"
        )
        if "mamba" in self.groups:
            s += f" mamba_loaded_ok={self.mamba_loaded_states_ok}/{self.mamba_loaded_states_checked}"
        if self.mamba_off_grid_loads or self.mamba_off_grid_wrong_slots:
            s += f" offgrid_loads={self.mamba_off_grid_loads} offgrid_wrong={self.mamba_off_grid_wrong_slots}"
        if self.stalled:
            s += f" STALLED({self.stalled})"
        if self.error:
            s += f" ERROR={self.error}"
        return s


# ---------------------------------------------------------------------------------------------
# Spec configs
# ---------------------------------------------------------------------------------------------


def reference_extra_config(blocks_per_chunk: int = 1, *, delay_steps: int = 0) -> dict[str, Any]:
    """vLLM's own ``CPUOffloadingSpec`` (64 MiB); ``run_engine`` installs the CPU stand-in worker."""
    cfg: dict[str, Any] = {
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": 64 << 20,
        "blocks_per_chunk": blocks_per_chunk,
    }
    if delay_steps:
        cfg["stand_in_delay_steps"] = delay_steps
    return cfg


def lmdb_tier(path: Path, cap: str = "32MiB", map_size: str = "64MiB") -> dict[str, Any]:
    """An ``lmdb`` tier named ``nvme``, its environment in ``path/lmdb``."""
    return {
        "kind": "lmdb",
        "name": "nvme",
        "path": str(Path(path) / "lmdb"),
        "map_size_bytes": map_size,
        "size_cap_bytes": cap,
    }


def write_config(file: Path, tiers: list[dict[str, Any]], model: str = "x", **sections: Any) -> Path:
    """A tieredkv config at ``file`` (JSON is YAML): ``tiers`` with an 8 MiB staging pool, and
    ``sections`` (``policy``, ``tenants``, ...) added."""
    import json

    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    cfg = {"version": 1, "namespace": {"model": model}, "tiers": tiers, "pipeline": {"staging_bytes": "8MiB"}}
    file.write_text(json.dumps({**cfg, **sections}))
    return file


def write_tieredkv_config(path: Path, kind: str = "lmdb") -> Path:
    """A minimal tieredkv config (JSON is YAML): one ``lmdb`` or ``cpu`` tier."""
    path = Path(path)
    if kind == "lmdb":
        tier = lmdb_tier(path.parent)
    elif kind == "cpu":
        tier = {"kind": "cpu", "name": "cpu", "capacity_bytes": "16MiB"}
    else:
        raise ValueError(kind)
    return write_config(path, [tier])


def tieredkv_extra_config(blocks_per_chunk: int, tiers_file: Path) -> dict[str, Any]:
    return spec_extra(blocks_per_chunk, tiers_file)


def spec_extra(bpc: int, tiers: Path, **kw: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` of tieredkv's spec (``TieredKVOffloadingSpec``) over the
    tiers of ``tiers``, with ``kw`` added."""
    return {
        "spec_name": "TieredKVOffloadingSpec",
        "spec_module_path": "tieredkv.integrations.vllm",
        "tieredkv_config": str(tiers),
        "blocks_per_chunk": bpc,
        **kw,
    }


def secondary_extra(bpc: int, tiers: Path) -> dict[str, Any]:
    """``kv_connector_extra_config`` of vLLM's ``TieringOffloadingSpec`` with tieredkv as its
    secondary tier (``TieredKVSecondaryTier``) over the tiers of ``tiers``."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "blocks_per_chunk": bpc,
        "secondary_tiers": [
            {
                "type": "TieredKVSecondaryTier",
                "module_path": "tieredkv.integrations.vllm",
                "config": str(tiers),
                "keep_on_reset": True,
            }
        ],
    }


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = obj.__dict__.get(name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is None:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


@contextlib.contextmanager
def cpu_workers(extra_config: dict[str, Any], tiering_cpu_worker: bool) -> Iterator[None]:
    """CPU stand-ins for vLLM's CUDA-only workers, only for this run."""
    with contextlib.ExitStack() as stack:
        if extra_config.get("spec_name") == "CPUOffloadingSpec" and not extra_config.get("spec_module_path"):
            from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

            from tests.vllm.cpu_worker import cpu_offloading_get_worker

            stack.enter_context(_patched(CPUOffloadingSpec, "get_worker", cpu_offloading_get_worker))
        if tiering_cpu_worker:
            from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

            from tests.vllm.cpu_worker import cpu_get_worker

            stack.enter_context(_patched(TieringOffloadingSpec, "get_worker", cpu_get_worker))
        yield


# ---------------------------------------------------------------------------------------------
# The engine: scheduler + emulated model runner
# ---------------------------------------------------------------------------------------------


class _RState:
    __slots__ = ("bt", "runner_len")

    def __init__(self, bt: list[list[int]], runner_len: int) -> None:
        self.bt = bt
        self.runner_len = runner_len


class Engine:
    """One engine: the real (Async)Scheduler with its connector, a WORKER-role connector on CPU
    tensors, and the emulated model runner. Drive it with ``add_request`` / ``step``."""

    def __init__(
        self,
        extra_config: dict[str, Any],
        *,
        groups: tuple[str, ...] = ("full",),
        blocks_per_chunk: int = 1,
        async_scheduling: bool = False,
        num_gpu_blocks: int | None = None,
        kv_connector: str = "OffloadingConnector",
        kv_connector_module_path: str | None = None,
        result: RunResult | None = None,
        max_examples: int = 8,
        long_prefill_token_threshold: int = LONG_PREFILL_THRESHOLD,
        settle: bool = False,
        store_fault: Any = None,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int = MAX_BATCHED_TOKENS,
        model: Path = TINY_MODEL,
        hash_algo: str = "sha256",
        retention_interval: int | None = 0,
    ) -> None:
        assert groups[0] == "full" and set(groups) <= set(LAYER), groups
        self.settle = settle
        self.store_fault = store_fault
        self.accepted_keys: set[bytes] = set()
        self.loaded_reqs: set[str] = set()
        self.refused_keys: set[bytes] = set()
        self.groups = tuple(groups)
        self.has_mamba = "mamba" in groups
        self.async_scheduling = async_scheduling
        self.bpc = blocks_per_chunk
        self.result = result or RunResult(self.groups, blocks_per_chunk, async_scheduling)
        self.max_examples = max_examples
        num_blocks = num_gpu_blocks or DEFAULT_GPU_BLOCKS[self.groups]
        self.num_blocks = num_blocks
        extra = dict(extra_config)
        extra["blocks_per_chunk"] = blocks_per_chunk
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0
            ),
            cache_config=CacheConfig(
                block_size=MAMBA_BLOCK if self.has_mamba else ATTN_BLOCK,
                enable_prefix_caching=True,
                mamba_cache_mode="align" if self.has_mamba else "none",
                prefix_caching_hash_algo=hash_algo,
                prefix_cache_retention_interval=retention_interval,  # vLLM's default 0; None: dense
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=MAX_MODEL_LEN,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=async_scheduling,
                long_prefill_token_threshold=long_prefill_token_threshold,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector=kv_connector,
                kv_role="kv_both",
                kv_connector_module_path=kv_connector_module_path,
                kv_connector_extra_config=extra,
            ),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec_kw = {"block_size": ATTN_BLOCK, "num_kv_heads": 1, "head_size": HEAD_SIZE, "dtype": torch.float32}
        specs = {
            "full": FullAttentionSpec(**spec_kw),
            "swa": SlidingWindowSpec(sliding_window=WINDOW, **spec_kw),
            "mamba": MambaSpec(
                block_size=MAMBA_BLOCK, shapes=((MAMBA_WORDS,),), dtypes=(torch.float32,), mamba_cache_mode="align"
            ),
        }
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([LAYER[g]], specs[g]) for g in self.groups],
        )
        sched_block, hash_block = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        self.kv_cache_config.hash_block_size = hash_block
        self.kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            self.kv_cache_config, self.vllm_config, sched_block, hash_block
        )
        self.sched_block, self.hash_block = sched_block, hash_block
        with set_current_vllm_config(self.vllm_config):
            cls = AsyncScheduler if async_scheduling else Scheduler
            self.scheduler = cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                log_stats=True,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=sched_block,
                hash_block_size=hash_block,
            )
            self.worker = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            self.kv: dict[str, torch.Tensor] = {}
            for g in self.groups:
                if g == "mamba":
                    self.kv[LAYER[g]] = torch.zeros(num_blocks, MAMBA_WORDS, dtype=torch.float32)
                else:
                    self.kv[LAYER[g]] = torch.zeros(num_blocks, 2, ATTN_BLOCK, 1, HEAD_SIZE, dtype=torch.float32)
            self.worker.register_kv_caches(self.kv)
        # int32 views the runner reads and writes
        self.words = {
            g: (
                self.kv[LAYER[g]].view(torch.int32)
                if g == "mamba"
                else self.kv[LAYER[g]].view(torch.int32).view(num_blocks, 2, ATTN_BLOCK, HEAD_SIZE)
            )
            for g in self.groups
        }
        self.gidx = {g: i for i, g in enumerate(self.groups)}
        init_none_hash(get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo))
        self.hasher = get_request_block_hasher(
            hash_block, get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        )
        self.connector = self.scheduler.connector
        self.connector_scheduler = getattr(self.connector, "connector_scheduler", None)
        self.mamba_chunk = MAMBA_BLOCK * blocks_per_chunk
        self.batch_queue: deque[tuple[Any, Any]] = deque()
        self.batch_queue_size = 2 if async_scheduling else 1
        self.step_no = 0
        self.seqs: dict[str, _Seq] = {}
        self.reqs: dict[str, Request] = {}
        self.rstate: dict[str, _RState] = {}
        self.mamba_state_idx: dict[str, int] = {}
        # req_id -> boundary (tokens) of a load planned this step off the Mamba chunk grid
        self.off_grid_pending: dict[str, int] = {}
        # Mamba blocks whose content came from a load: block id -> (how it got there, whether the
        # load boundary was off the Mamba chunk grid, i.e. vLLM took the block for the state at
        # the boundary, which it is not). A forward write, zeroing or a copy of a block without
        # this mark clears it; copies out of a marked block carry it along.
        self.mamba_origin: dict[int, tuple[str, bool]] = {}
        self.records: dict[str, RequestRecord] = {}
        self._n = 0
        self._wrap_connector()

    # ---- observing the connector -------------------------------------------------------------

    def _wrap_connector(self) -> None:
        res, conn = self.result, self.connector
        if conn is None:
            return
        gnm, ustate = conn.get_num_new_matched_tokens, conn.update_state_after_alloc

        def get_num_new_matched_tokens(request: Request, num_computed_tokens: int) -> Any:
            out = gnm(request, num_computed_tokens)
            res.lookups += 1
            if out[0] is None:
                res.deferred_lookups += 1
            rec = self.records.get(request.request_id)
            if rec is not None:
                rec.matched.append(out[0])
            return out

        def update_state_after_alloc(request: Request, blocks: Any, num_external_tokens: int) -> Any:
            if num_external_tokens:
                rec = self.records.get(request.request_id)
                if rec is not None:
                    rec.external_hits.append(num_external_tokens)
                res.external_hit_tokens += num_external_tokens
                cs = self.connector_scheduler
                if self.has_mamba and cs is not None:
                    st = cs._req_status.get(request.request_id)
                    boundary = (st.num_locally_computed_tokens if st is not None else 0) + num_external_tokens
                    if boundary % self.mamba_chunk:
                        res.mamba_off_grid_loads += 1
                        self.off_grid_pending[request.request_id] = boundary
            return ustate(request, blocks, num_external_tokens)

        conn.get_num_new_matched_tokens = _timed(res, get_num_new_matched_tokens)
        conn.update_state_after_alloc = _timed(res, update_state_after_alloc)
        for hook in (
            "build_connector_meta",
            "update_connector_output",
            "request_finished",
            "request_finished_all_groups",
        ):
            setattr(conn, hook, _timed(res, getattr(conn, hook)))
        cs = self.connector_scheduler
        if cs is None:
            return
        m = cs.manager
        res.keys_offered = res.keys_accepted = res.prepare_store_calls = res.prepare_store_refused = 0
        prepare_store = m.prepare_store
        fault = self.store_fault

        def rec_store(keys: Any, ctx: Any) -> Any:
            keys = list(keys)
            res.prepare_store_calls += 1
            res.keys_offered += len(keys)
            res.reoffered_keys += sum(1 for k in keys if k in self.accepted_keys)
            n = len(keys) if fault is None else fault.decide(keys, ctx, self)
            if n is None:  # the fault refuses the call
                self.refused_keys.update(keys)
                res.prepare_store_refused += 1
                return None
            self.refused_keys.update(keys[n:])
            out = prepare_store(keys[:n], ctx)
            if out is None:
                res.prepare_store_refused += 1
            else:
                res.keys_accepted += len(out.keys_to_store)
                self.accepted_keys.update(out.keys_to_store)
            return out

        m.prepare_store = rec_store

    def count_lost_keys(self) -> None:
        """Keys a store fault refused that were never accepted later nor are held now."""
        res = self.result
        res.fault_refused_keys = len(self.refused_keys)
        cs = self.connector_scheduler
        counters = getattr(cs, "counters", None)
        if counters is not None:
            res.connector_counters = {k: v for k, v in vars(counters).items() if isinstance(v, int)}
        if cs is None or not self.refused_keys:
            return
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        ctx = ReqContext(req_id="lost-keys-check")
        for key in self.refused_keys - self.accepted_keys:
            if cs.manager.lookup(key, ctx) in (LookupResult.HIT, LookupResult.HIT_PENDING):
                continue
            name = self.groups[key_group(bytes(key))]
            res.lost_keys[name] = res.lost_keys.get(name, 0) + 1

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, spec: ReqSpec, phase: int) -> Request:
        self._n += 1
        rid = f"{spec.name}-{self._n}"
        extra = {"kv_transfer_params": dict(spec.kv_transfer_params)} if spec.kv_transfer_params else None
        sp = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, extra_args=extra)
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(spec.prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
            cache_salt=spec.cache_salt,
            kv_hints=spec.kv_hints,
        )
        self.reqs[rid] = req
        self.seqs[rid] = _Seq(list(spec.prompt))
        self.records[rid] = RequestRecord(spec.name, rid, phase, len(spec.prompt), self.step_no)
        self.scheduler.add_request(req)
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # ---- the engine core step ------------------------------------------------------------------

    def step(self) -> bool:
        """One ``EngineCore.step`` / ``step_with_batch_queue``; returns whether a model ran."""
        self.step_no += 1
        sched = self.scheduler
        if not self.async_scheduling:
            if not sched.has_requests():
                return False
            so = sched.schedule()
            mro = self._execute(so)
            sched.update_from_output(so, mro)
            self._after_update()
            return so.total_num_scheduled_tokens > 0
        model_executed = False
        if sched.has_requests():
            so = sched.schedule()
            mro = self._execute(so)
            model_executed = so.total_num_scheduled_tokens > 0
            self.batch_queue.appendleft((so, mro))
            if len(self.batch_queue) < self.batch_queue_size and (model_executed or sched.has_requests()):
                return model_executed
        elif not self.batch_queue:
            return False
        so, mro = self.batch_queue.pop()
        sched.update_from_output(so, mro)
        self._after_update()
        return model_executed

    def drain_batch_queue(self) -> None:
        while self.batch_queue:
            so, mro = self.batch_queue.pop()
            self.scheduler.update_from_output(so, mro)
            self._after_update()

    def _after_update(self) -> None:
        for rid, rec in self.records.items():
            if rec.finish_step is None and self.reqs[rid].is_finished():
                rec.finish_step = self.step_no
                req = self.reqs[rid]
                want = continuation(list(req.prompt_token_ids), req.max_tokens)
                rec.output_ok = list(req.output_token_ids) == want
                if not rec.output_ok:
                    self.result.wrong_outputs.append(f"{rid}: {list(req.output_token_ids)} != {want}")

    # ---- the emulated model runner -------------------------------------------------------------

    def _wrong(self, msg: str, slots: int, nbytes: int) -> None:
        res = self.result
        res.wrong_slots += slots
        res.wrong_bytes += nbytes
        if len(res.wrong_examples) < self.max_examples:
            res.wrong_examples.append(f"step {self.step_no}: {msg}")

    def _execute(self, so: Any) -> ModelRunnerOutput:
        w, res = self.worker, self.result
        meta = so.kv_connector_metadata
        if isinstance(meta, OffloadingConnectorMetadata):
            for job in meta.load_jobs.values():
                res.load_jobs += 1
                rec = self.records.get(job.req_id)
                first = rec is not None and not rec.preemptions and job.req_id not in self.loaded_reqs
                self.loaded_reqs.add(job.req_id)
                for g, n in zip(self.groups, job.dst_spec.group_sizes):
                    res.hit_tokens[g] = res.hit_tokens.get(g, 0) + int(n) * BLOCK_TOKENS[g]
                    if first:
                        res.first_hit_tokens[g] = res.first_hit_tokens.get(g, 0) + int(n) * BLOCK_TOKENS[g]
            for job in meta.store_jobs.values():
                res.store_jobs += 1
                for g, n in zip(self.groups, job.src_spec.group_sizes):
                    res.stored_tokens[g] = res.stored_tokens.get(g, 0) + int(n) * BLOCK_TOKENS[g]
            res.flushed_jobs += len(meta.jobs_to_flush or ())
        if so.preempted_req_ids:
            res.preemptions += len(so.preempted_req_ids)
            for rid in so.preempted_req_ids:
                if rid in self.records:
                    self.records[rid].preemptions += 1
        # 1. handle_preemptions (submits last step's deferred stores, flushes)
        if meta is not None:
            w.handle_preemptions(meta)
        # 2. _update_states
        for rid in so.finished_req_ids:
            self.rstate.pop(rid, None)
        for rid in (
            list(so.finished_req_ids)
            + list(so.preempted_req_ids or ())
            + list(so.scheduled_cached_reqs.resumed_req_ids)
        ):
            self.mamba_state_idx.pop(rid, None)
        if so.new_block_ids_to_zero:
            idx = torch.tensor(so.new_block_ids_to_zero, dtype=torch.long)
            for t in self.words.values():
                t[idx] = 0
            for b in so.new_block_ids_to_zero:
                self.mamba_origin.pop(int(b), None)
        for copy in so.kv_cache_block_copies or ():
            res.block_copies += 1
            src, dst = int(copy[0]), int(copy[1])
            for t in self.words.values():
                t[dst] = t[src]
            self._copy_poison(src, dst)
        for nr in so.scheduled_new_reqs:
            self.rstate[nr.req_id] = _RState([list(g) for g in nr.block_ids], len(nr.prompt_token_ids))
        cached = so.scheduled_cached_reqs
        computed: dict[str, int] = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            st = self.rstate.get(rid)
            if rid in cached.resumed_req_ids or st is None:
                st = self.rstate[rid] = _RState([list(g) for g in new_ids] if new_ids else [[] for _ in self.groups], 0)
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    st.bt[g].extend(ids)
            if rid in cached.all_token_ids:
                st.runner_len = len(cached.all_token_ids[rid])
            computed[rid] = cached.num_computed_tokens[i]
        batch = list(so.num_scheduled_tokens)
        # 3. preprocess_mamba: copy the running state into this step's state block
        if self.has_mamba:
            mg = self.gidx["mamba"]
            mw = self.words["mamba"]
            for rid in batch:
                c, n = computed[rid], so.num_scheduled_tokens[rid]
                bt = self.rstate[rid].bt[mg]
                prev = self.mamba_state_idx.get(rid)
                if prev is None:
                    prev = (c - 1) // MAMBA_BLOCK
                curr = -(-(c + n) // MAMBA_BLOCK) - 1
                self.mamba_state_idx[rid] = curr
                if prev != -1 and prev != curr:
                    if prev >= len(bt) or curr >= len(bt):
                        self._wrong(
                            f"{rid} mamba pre-copy {prev}->{curr} outside its table ({len(bt)})", 1, 4 * MAMBA_WORDS
                        )
                    else:
                        mw[bt[curr]] = mw[bt[prev]]
                        self._copy_poison(bt[prev], bt[curr])
                        res.mamba_precopies += 1
        # 4. bind; sync loads land before the forward
        if meta is not None:
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
        # 5. the forward: check what it reads, write what it computes
        sampled: list[list[int]] = []
        for rid in batch:
            c, n = computed[rid], so.num_scheduled_tokens[rid]
            st = self.rstate[rid]
            seq = self.seqs[rid]
            seq.ensure(c + n + 1)
            self._check(rid, seq, st, c, n)
            self._write(seq, st, c, n)
            if c + n >= st.runner_len:
                sampled.append([seq.tokens[c + n]])
                st.runner_len = c + n + 1
            else:
                sampled.append([])
        # 6. async loads start after the forward; wait_for_save; results
        out = KVConnectorOutput()
        if meta is not None:
            if not so.has_sync_kv_loads:
                w.start_load_kv(None)
            self._mark_off_grid_loads(meta)
            w.wait_for_save()
            if self.settle:
                self._settle()
            tr = w.get_transfer_results(so.finished_req_ids)
            out.finished_sending = tr.finished_sending or None
            out.finished_recving = tr.finished_recving or None
            out.failed_recving = getattr(tr, "failed_recving", None) or None
            out.invalid_block_ids = w.get_block_ids_with_load_errors()
            out.kv_connector_stats = w.get_kv_connector_stats()
            out.kv_connector_worker_meta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
        if not so.total_num_scheduled_tokens:
            res.empty_steps += 1
        return ModelRunnerOutput(
            req_ids=batch,
            req_id_to_index={r: i for i, r in enumerate(batch)},
            sampled_token_ids=sampled,
            kv_connector_output=out,
        )

    def _settle(self) -> None:
        """A device step outlasts the tier I/O it overlaps: wait (for the condition, bounded) until
        every transfer and lookup the offloading manager or its secondary tiers have in flight is
        done, as the reference stand-in worker is done by the end of the step it copies in."""
        mgr = getattr(self.connector_scheduler, "manager", None)
        for obj in [mgr, *getattr(mgr, "secondary_tiers", ())]:
            wait_idle = getattr(obj, "wait_idle", None)
            if wait_idle is not None:
                assert wait_idle(30.0), f"{type(obj).__name__}: I/O still in flight after 30 s"

    def _copy_poison(self, src: int, dst: int) -> None:
        if src in self.mamba_origin:
            self.mamba_origin[dst] = self.mamba_origin[src]
        else:
            self.mamba_origin.pop(dst, None)

    def _mark_off_grid_loads(self, meta: Any) -> None:
        if not self.has_mamba or not isinstance(meta, OffloadingConnectorMetadata):
            return
        mg = self.gidx["mamba"]
        for job in meta.load_jobs.values():
            boundary = self.off_grid_pending.pop(job.req_id, None)
            sizes = [int(x) for x in job.dst_spec.group_sizes]
            start = sum(sizes[:mg])
            for b in job.dst_spec.block_ids[start : start + sizes[mg]]:
                if boundary is None:
                    self.mamba_origin[int(b)] = (f"load of {job.req_id}, step {self.step_no}", False)
                else:
                    self.mamba_origin[int(b)] = (
                        f"off-grid load of {job.req_id} at {boundary} tokens, step {self.step_no}",
                        True,
                    )
        self.off_grid_pending.clear()

    def _check(self, rid: str, seq: _Seq, st: _RState, c: int, n: int) -> None:
        res = self.result
        for g in self.groups:
            bt = st.bt[self.gidx[g]]
            if g == "mamba":
                if c == 0:
                    continue
                curr = -(-(c + n) // MAMBA_BLOCK) - 1
                res.mamba_states_checked += 1
                res.checked_slots += 1
                res.checked_bytes += 4 * MAMBA_WORDS
                want = seq.state(c)
                if curr >= len(bt) or bt[curr] == 0:
                    self._wrong(
                        f"{rid} mamba state block {curr} missing (table {len(bt)}) at c={c}", 1, 4 * MAMBA_WORDS
                    )
                    continue
                got = self.words["mamba"][bt[curr]]
                origin = self.mamba_origin.get(bt[curr])
                if origin is not None and not origin[1]:
                    res.mamba_loaded_states_checked += 1
                if torch.equal(got, want):
                    if origin is not None and not origin[1]:
                        res.mamba_loaded_states_ok += 1
                    continue
                nbytes = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
                grid = -(-c // self.mamba_chunk) * self.mamba_chunk
                who = next((k for k in (grid, *range(c + n + 1)) if torch.equal(got, seq.state(k))), None)
                what = (
                    f"holds the state after {who} tokens"
                    if who is not None
                    else ("holds zeros" if not bool(got.any()) else "holds unknown bytes")
                )
                msg = f"{rid} mamba block {bt[curr]} (idx {curr}) at c={c}: {what}"
                if origin is not None and origin[1]:
                    # The bytes come from a load whose boundary was off the Mamba chunk grid:
                    # vLLM loaded chunk cdiv(c, chunk) - 1 into block cdiv(c, 64) - 1 (with
                    # blocks_per_chunk > 1, a sub-slot no state was stored in), possibly reused
                    # since through the GPU prefix cache.
                    res.mamba_off_grid_wrong_slots += 1
                    res.mamba_off_grid_wrong_bytes += nbytes
                    if len(res.mamba_off_grid_examples) < self.max_examples:
                        res.mamba_off_grid_examples.append(f"step {self.step_no}: {msg} ({origin[0]})")
                    continue
                self._wrong(msg + (f" ({origin[0]})" if origin else ""), 1, nbytes)
                continue
            start = 0 if g == "full" else max(0, c - (WINDOW - 1))
            if start >= c:
                continue
            pos = torch.arange(start, c)
            bidx = pos // ATTN_BLOCK
            nblk = -(-c // ATTN_BLOCK)
            if nblk > len(bt):
                self._wrong(
                    f"{rid} {g}: {c} tokens need {nblk} blocks, table has {len(bt)}", c - start, (c - start) * 64
                )
                continue
            blocks = torch.tensor(bt[:nblk], dtype=torch.long)[bidx]
            got = self.words[g][blocks, :, pos % ATTN_BLOCK]
            want = seq.kv(g, start, c)
            res.checked_slots += c - start
            res.checked_bytes += (c - start) * 64
            eq = (got == want).flatten(1).all(1)
            if bool(eq.all()):
                continue
            bad = (~eq).nonzero().flatten()
            nbytes = int((got[bad].contiguous().view(torch.uint8) != want[bad].contiguous().view(torch.uint8)).sum())
            p0 = int(pos[bad[0]])
            null = bool((blocks[bad] == 0).any())
            self._wrong(
                f"{rid} {g}: {len(bad)} of slots [{start},{c}) wrong, first token {p0} "
                f"(block {int(blocks[bad[0]])}{', null block read' if null else ''})",
                len(bad),
                nbytes,
            )

    def _write(self, seq: _Seq, st: _RState, c: int, n: int) -> None:
        for g in self.groups:
            bt = st.bt[self.gidx[g]]
            if g == "mamba":
                curr = -(-(c + n) // MAMBA_BLOCK) - 1
                if curr < len(bt) and bt[curr] != 0:
                    self.words["mamba"][bt[curr]] = seq.state(c + n)
                    self.mamba_origin.pop(bt[curr], None)
                continue
            pos = torch.arange(c, c + n)
            bidx = pos // ATTN_BLOCK
            nblk = -(-(c + n) // ATTN_BLOCK)
            ids = torch.tensor((bt + [0] * nblk)[:nblk], dtype=torch.long)[bidx]
            vals = seq.kv(g, c, c + n)
            keep = ids != 0  # a null block: out of the window, nothing kept
            if not bool(keep.all()):
                pos, ids, vals = pos[keep], ids[keep], vals[keep]
            self.words[g][ids, :, pos % ATTN_BLOCK] = vals

    # ---- between phases ------------------------------------------------------------------------

    def unfinished(self) -> list[str]:
        return [rid for rid, rec in self.records.items() if rec.finish_step is None]

    def no_transfers(self) -> bool:
        """Nothing on its way: no job of the connector scheduler, and no transfer, promotion or
        lookup of the offloading manager or of its secondary tiers. (A secondary tier's lookup
        still in flight keeps a request waiting: counted as quiet steps alone, a slow one on a
        busy machine read as a stall.)"""
        cs = self.connector_scheduler
        if cs is None:
            return True
        if cs._jobs:
            return False
        mgr = getattr(cs, "manager", None)
        for obj in [mgr, *getattr(mgr, "secondary_tiers", ())]:
            pending = getattr(obj, "has_pending_work", None)
            if pending is not None and pending():
                return False
            wait_idle = getattr(obj, "wait_idle", None)  # tieredkv's managers: transfers and lookups
            if wait_idle is not None and not wait_idle(0):
                return False
        return True

    def describe_stall(self) -> str:
        s = self.scheduler
        parts = [
            f"{rid}:{r.status.name} computed={r.num_computed_tokens}/{r.num_tokens}" for rid, r in s.requests.items()
        ]
        return (
            f"step {self.step_no}: nothing scheduled; running={[r.request_id for r in s.running]} "
            f"free_blocks={s.kv_cache_manager.block_pool.get_num_free_blocks()}/{self.num_blocks} " + "; ".join(parts)
        )

    def can_zero(self) -> bool:
        """No transfer is in flight (zeroing now cannot corrupt a store)."""
        cs = self.connector_scheduler
        if cs is None:
            return not self.scheduler.has_requests()
        cw = getattr(self.worker, "connector_worker", None)
        unsubmitted = getattr(cw, "_unsubmitted_store_jobs", None)
        return not cs._jobs and not unsubmitted

    def reset_gpu(self, zero: bool, reset_connector: bool = False) -> bool:
        ok = bool(self.scheduler.reset_prefix_cache(reset_connector=reset_connector))
        if zero:
            for t in self.words.values():
                t.zero_()
            self.mamba_origin.clear()
        return ok

    def shutdown(self) -> None:
        try:
            self.scheduler.shutdown()
        finally:
            self.worker.shutdown()


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------


def run_engine(
    extra_config: dict[str, Any],
    *,
    groups: tuple[str, ...] = ("full",),
    blocks_per_chunk: int = 1,
    async_scheduling: bool = False,
    seed: int = 0,
    step_budget: int = 3000,
    kv_connector: str = "OffloadingConnector",
    kv_connector_module_path: str | None = None,
    tiering_cpu_worker: bool = False,
    num_gpu_blocks: int | None = None,
    idle_grace_steps: int = 200,
    idle_sleep: float = 0.001,
    stall_steps: int = 200,
    long_prefill_token_threshold: int = LONG_PREFILL_THRESHOLD,
    reset_connector: bool = False,
    workload: list[list[ReqSpec]] | None = None,
    settle: bool = False,
    store_fault: Any = None,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int = MAX_BATCHED_TOKENS,
    model: Path = TINY_MODEL,
    hash_algo: str = "sha256",
    retention_interval: int | None = 0,
    on_phase: Any = None,
) -> RunResult:
    """Run the workload once through the real scheduler + connector; see the module docstring.
    ``on_phase(engine, phase)`` is called before each phase's first request (and with
    ``len(phases)`` once the last phase is over, before shutdown)."""
    t0 = time.perf_counter()
    res = RunResult(tuple(groups), blocks_per_chunk, async_scheduling)
    phases = workload if workload is not None else build_workload(seed)
    with cpu_workers(extra_config, tiering_cpu_worker):
        eng = Engine(
            extra_config,
            groups=tuple(groups),
            blocks_per_chunk=blocks_per_chunk,
            async_scheduling=async_scheduling,
            num_gpu_blocks=num_gpu_blocks,
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            result=res,
            long_prefill_token_threshold=long_prefill_token_threshold,
            settle=settle,
            store_fault=store_fault,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            model=model,
            hash_algo=hash_algo,
            retention_interval=retention_interval,
        )
        try:
            _drive(eng, phases, step_budget, idle_grace_steps, idle_sleep, stall_steps, reset_connector, on_phase)
        except Exception as exc:  # noqa: BLE001 - reported, the caller decides
            import traceback

            res.error = f"{type(exc).__name__}: {exc}"
            res.wrong_examples.append(traceback.format_exc(limit=6)[-1500:])
        finally:
            res.steps = eng.step_no
            res.requests = eng.records
            for rec in eng.records.values():
                if rec.finish_step is None:
                    res.unfinished_requests.append(rec.req_id)
                else:
                    res.max_request_steps = max(res.max_request_steps, rec.finish_step - rec.arrival_step)
            try:
                eng.count_lost_keys()
            except Exception as exc:  # noqa: BLE001
                res.error = res.error or f"lost-key count: {type(exc).__name__}: {exc}"
            try:
                eng.shutdown()
            except Exception as exc:  # noqa: BLE001
                res.error = res.error or f"shutdown: {type(exc).__name__}: {exc}"
    res.wall_s = time.perf_counter() - t0
    return res


def _timed(res: RunResult, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            res.connector_s += time.perf_counter() - t

    return call


def _drive(
    eng: Engine,
    phases: list[list[ReqSpec]],
    step_budget: int,
    idle_grace_steps: int,
    idle_sleep: float,
    stall_steps: int = 200,
    reset_connector: bool = False,
    on_phase: Any = None,
) -> None:
    res = eng.result
    for pi, phase in enumerate(phases):
        if on_phase is not None:
            on_phase(eng, pi)
        pending = sorted(phase, key=lambda r: r.arrival)
        start = eng.step_no
        rids: list[str] = []
        idle = False
        last_finish: int | None = None
        quiet = 0  # consecutive steps that scheduled nothing
        while True:
            while pending and (pending[0].arrival <= eng.step_no - start or not eng.has_work()):
                rids.append(eng.add_request(pending.pop(0), pi).request_id)
            if not eng.has_work():
                idle = True
                break
            if eng.step_no >= step_budget:
                res.budget_exhausted = True
                break
            if not pending and all(eng.records[r].finish_step is not None for r in rids):
                last_finish = max(eng.records[r].finish_step for r in rids)  # type: ignore[type-var]
                if eng.step_no - last_finish >= idle_grace_steps:
                    break
            ran = eng.step()
            quiet = 0 if ran else quiet + 1
            if quiet >= stall_steps and not pending and eng.unfinished() and eng.no_transfers():
                res.stalled = eng.describe_stall()
                break
            if not ran and eng.scheduler.has_requests() and idle_sleep:
                time.sleep(idle_sleep)
        res.phase_idle.append(idle)
        if idle:
            fin = [eng.records[r].finish_step for r in rids]
            res.phase_steps_to_idle.append(eng.step_no - max(f for f in fin if f is not None))
        else:
            res.phase_steps_to_idle.append(None)
        if res.budget_exhausted or res.stalled:
            break
        if pi + 1 < len(phases):
            eng.drain_batch_queue()
            zero = idle or eng.can_zero()
            res.phase_reset_ok.append(eng.reset_gpu(zero, reset_connector))
            res.phase_zeroed.append(zero)
    res.idle_reached = len(res.phase_idle) == len(phases) and all(res.phase_idle)
    if on_phase is not None and res.idle_reached:
        on_phase(eng, len(phases))


def run_matrix(
    make_extra: Any,
    *,
    group_sets: tuple[tuple[str, ...], ...] = GROUP_SETS,
    bpcs: tuple[int, ...] = (1, 2, 4),
    asyncs: tuple[bool, ...] = (False, True),
    **kw: Any,
) -> list[RunResult]:
    """``run_engine`` over groups × blocks_per_chunk × async; ``make_extra(bpc)`` gives the config."""
    out = []
    for groups in group_sets:
        for bpc in bpcs:
            for a in asyncs:
                out.append(run_engine(make_extra(bpc), groups=groups, blocks_per_chunk=bpc, async_scheduling=a, **kw))
    return out


if __name__ == "__main__":  # python -m tests.vllm.engine: the reference matrix
    import logging

    logging.disable(logging.WARNING)
    t = time.perf_counter()
    for r in run_matrix(reference_extra_config):
        print(r.summary(), flush=True)
        for ex in r.wrong_examples[:3]:
            print("   ", ex)
    print(f"total {time.perf_counter() - t:.1f}s")

"""Drive vLLM 0.33's real Scheduler and OffloadingConnector (both roles) on CPU, no weights.

The pattern of vLLM's own offloading-connector unit tests (RequestRunner with
``kv_cache_groups=``), rewritten here: a hand-made ``KVCacheConfig`` with a full-attention and a
sliding-window group, a config-only model directory, CPU tensors standing in for the GPU KV
cache, and a step loop schedule() → worker connector → update_from_output(). A "model" fills the
KV bytes of each computed token deterministically from (token id, position, layer), so bytes can
be checked end to end after a load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

TINY_MODEL = Path(__file__).parent / "models" / "tiny-llama"
EOS = 2
BLOCK_SIZE = 16
LAYERS = {"full": "model.layers.0.self_attn.attn", "swa": "model.layers.1.self_attn.attn"}


@dataclass
class Recorded:
    """What vLLM's connector asked the manager / worker for, step by step."""

    lookups: list[tuple[int, bytes, str]] = field(default_factory=list)
    prepare_store: list[tuple[int, tuple[bytes, ...], tuple[bytes, ...] | None]] = field(default_factory=list)
    prepare_load: list[tuple[int, tuple[bytes, ...]]] = field(default_factory=list)
    store_jobs: list[tuple[int, list[int], list[int], list[int]]] = field(default_factory=list)
    load_jobs: list[tuple[int, list[int], list[int], list[int]]] = field(default_factory=list)


class Runner:
    """One engine: scheduler (with its connector) + a WORKER-role connector on CPU tensors."""

    def __init__(
        self,
        extra_config: dict[str, Any],
        *,
        block_size: int = 16,
        num_blocks: int = 96,
        sliding_window: int = 32,
        num_kv_heads: int = 1,
        head_size: int = 8,
        max_num_batched_tokens: int = 64,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(TINY_MODEL), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra_config
            ),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec_kw = {
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
            "dtype": torch.float32,
        }
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([LAYERS["full"]], FullAttentionSpec(**spec_kw)),
                KVCacheGroupSpec([LAYERS["swa"]], SlidingWindowSpec(sliding_window=sliding_window, **spec_kw)),
            ],
        )
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                log_stats=True,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=block_size,
            )
            self.worker = OffloadingConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            # CPU tensors standing in for the GPU KV cache: (blocks, 2 (K,V), block_size, heads, head_size).
            self.kv = {
                name: torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=torch.float32)
                for name in LAYERS.values()
            }
            self.worker.register_kv_caches(self.kv)
        conn = self.scheduler.connector
        assert isinstance(conn, OffloadingConnector)
        self.connector_scheduler = conn.connector_scheduler
        self.manager = self.connector_scheduler.manager
        self.manager_obj = self.manager  # the manager object itself (its methods get recording wrappers)
        self.recorded = Recorded()
        self._wrap_manager()
        self.step_no = 0
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self._n = 0
        self.first_blocks: dict[str, tuple[list[int], ...]] = {}

    # ---- recording -----------------------------------------------------------------------

    def _wrap_manager(self) -> None:
        """Record every call vLLM's connector makes on the manager (transparent wrappers)."""
        m, rec = self.manager, self.recorded
        lookup, prepare_store, prepare_load = m.lookup, m.prepare_store, m.prepare_load

        def rec_lookup(key: bytes, ctx: Any) -> Any:
            r = lookup(key, ctx)
            rec.lookups.append((self.step_no, bytes(key), r.name))
            return r

        def rec_store(keys: Any, ctx: Any) -> Any:
            out = prepare_store(keys, ctx)
            rec.prepare_store.append(
                (
                    self.step_no,
                    tuple(bytes(k) for k in keys),
                    None if out is None else tuple(bytes(k) for k in out.keys_to_store),
                )
            )
            return out

        def rec_load(keys: Any, ctx: Any) -> Any:
            rec.prepare_load.append((self.step_no, tuple(bytes(k) for k in keys)))
            return prepare_load(keys, ctx)

        m.lookup, m.prepare_store, m.prepare_load = rec_lookup, rec_store, rec_load

    # ---- the "model": deterministic KV bytes per token ----------------------------------------

    @staticmethod
    def kv_value(token: int, pos: int, layer: int) -> float:
        return float((token * 131 + pos * 7 + layer * 1009) % 65521) + 0.25

    def write_kv(self, req: Request, start: int, end: int) -> None:
        """Write KV for tokens [start, end) of ``req`` into its blocks (what a forward pass does)."""
        mgr = self.scheduler.kv_cache_manager
        block_ids = mgr.get_block_ids(req.request_id)
        tokens = req.all_token_ids
        for layer_idx, (g, name) in enumerate(zip(range(2), LAYERS.values())):
            ids = block_ids[g]
            for pos in range(start, end):
                b = ids[pos // self.block_size]
                if b == 0:
                    continue  # out of the window: a null block, nothing written
                self.kv[name][b, :, pos % self.block_size] = self.kv_value(tokens[pos], pos, layer_idx)

    def check_kv(self, req: Request, start: int, end: int, groups: tuple[int, ...] = (0, 1)) -> int:
        """Assert the KV of tokens [start, end) in the blocks ``req`` was first given holds what the
        model wrote for them (a null block is skipped); returns how many token slots were checked."""
        block_ids = self.first_blocks[req.request_id]
        tokens = req.all_token_ids
        checked = 0
        for layer_idx, name in enumerate(LAYERS.values()):
            if layer_idx not in groups:
                continue
            ids = block_ids[layer_idx]
            for pos in range(start, end):
                b = ids[pos // self.block_size]
                if b == 0:
                    continue
                want = self.kv_value(tokens[pos], pos, layer_idx)
                got = self.kv[name][b, :, pos % self.block_size]
                assert torch.all(got == want), (
                    f"group {layer_idx} token {pos} block {b}: KV {got.flatten()[:4].tolist()} != {want}"
                )
                checked += 1
        return checked

    # ---- requests and steps ----------------------------------------------------------------

    def new_request(self, token_ids: list[int], max_tokens: int = 2) -> Request:
        self._n += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=f"r{self._n}",
            prompt_token_ids=list(token_ids),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(req)
        return req

    def step(self, sampled: int = 7) -> Any:
        self.step_no += 1
        out = self.scheduler.schedule()
        mgr = self.scheduler.kv_cache_manager
        for rid in list(self.scheduler.requests):
            if rid not in self.first_blocks:
                ids = mgr.get_block_ids(rid)
                if any(ids):
                    self.first_blocks[rid] = tuple(list(g) for g in ids)
        meta = out.kv_connector_metadata
        w = self.worker
        for job_id, job in meta.store_jobs.items():
            self.recorded.store_jobs.append(
                (
                    job_id,
                    list(map(int, job.src_spec.block_ids)),
                    list(job.src_spec.group_sizes),
                    list(job.src_spec.block_indices),
                )
            )
        for job_id, job in meta.load_jobs.items():
            self.recorded.load_jobs.append(
                (
                    job_id,
                    list(map(int, job.dst_spec.block_ids)),
                    list(job.dst_spec.group_sizes),
                    list(job.dst_spec.block_indices),
                )
            )
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        # the forward pass: KV of every scheduled token
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            # schedule() has already advanced num_computed_tokens past the scheduled tokens
            self.write_kv(req, req.num_computed_tokens - n, req.num_computed_tokens)
        if out.total_num_scheduled_tokens > 0:
            w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        running = [r for r in self.scheduler.running if out.num_scheduled_tokens.get(r.request_id)]
        ids = [r.request_id for r in running]
        sampled_ids = []
        for r in running:
            done_prefill = r.num_computed_tokens >= r.num_prompt_tokens
            sampled_ids.append([sampled] if done_prefill else [])
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled_ids,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None, finished_recving=recving or None, kv_connector_worker_meta=worker_meta
            ),
        )
        self.scheduler.update_from_output(out, mro)
        return out

    def run_until_done(self, max_steps: int = 400, idle_sleep: float = 0.002) -> int:
        """Step until no request is left and no transfer is in flight."""
        for i in range(max_steps):
            if not self.scheduler.requests and not self.connector_scheduler.has_pending_push_work():
                return i
            out = self.step()
            if out.total_num_scheduled_tokens == 0:
                time.sleep(idle_sleep)  # tieredkv's pipeline thread is working
        raise AssertionError(f"not done after {max_steps} steps: {list(self.scheduler.requests)}")

    def shutdown(self) -> None:
        try:
            self.scheduler.shutdown()
        finally:
            self.worker.shutdown()

"""A CPU stand-in for vLLM 0.33's CUDA-only GPU↔CPU worker under ``TieringOffloadingSpec``.

``CPUOffloadingSpec.get_worker`` refuses a CPU platform and ``CPUOffloadingWorker`` asserts CUDA
tensors, so on CPU CI the tests replace only ``TieringOffloadingSpec.get_worker`` (monkeypatch)
with this worker. It maps the primary region exactly as vLLM's worker does
(``SharedOffloadRegion.create_next_worker_view`` per canonical tensor; chunk = ``blocks_per_chunk``
pages; the first chunk of a group skips ``block_indices[g] % blocks_per_chunk`` pages) and copies
with ``torch`` on the CPU. Everything else — scheduler, connector, tiering manager, primary tier,
the secondary tier — is vLLM's and tieredkv's real code.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


class CPUStandInWorker(OffloadingWorker):
    def __init__(self, spec: Any, kv_caches: Any) -> None:
        self.bpc = int(spec.blocks_per_chunk)
        self.region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=0,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        self.gpu = []
        self.cpu = []
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            self.gpu.append(t.tensor.view(-1, page))
            self.cpu.append(self.region.create_next_worker_view(page * self.bpc))
        self.pages = [int(t.page_size_bytes) for t in kv_caches.tensors]
        self.group_tensors = [sorted({r.tensor_idx for r in refs}) for refs in kv_caches.group_data_refs]
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec, to_cpu: bool) -> bool:
        t0 = time.perf_counter()
        gpu_ids = [int(b) for b in gpu.block_ids]
        chunk_ids = [int(c) for c in cpu.block_ids]
        nbytes, off, coff = 0, 0, 0
        for g, size in enumerate(gpu.group_sizes):
            size = int(size)
            ids = gpu_ids[off : off + size]
            off += size
            if not size:
                continue
            skip = int(gpu.block_indices[g]) % self.bpc
            nchunks = -(-(skip + size) // self.bpc)
            chunks = chunk_ids[coff : coff + nchunks]
            coff += nchunks
            for j, b in enumerate(ids):
                p = skip + j
                c, sub = chunks[p // self.bpc], p % self.bpc
                for ti in self.group_tensors[g]:
                    page = self.pages[ti]
                    dst_cpu = self.cpu[ti][c, sub * page : (sub + 1) * page]
                    if to_cpu:
                        dst_cpu.copy_(self.gpu[ti][b])
                    else:
                        self.gpu[ti][b].copy_(dst_cpu)
                    nbytes += page
        assert coff == len(chunk_ids), f"job {job_id}: {len(chunk_ids)} chunks, {coff} mapped"
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_cpu=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # copies are synchronous

    def shutdown(self) -> None:
        self.cpu.clear()
        self.region.cleanup()


def cpu_get_worker(self: Any, kv_caches: Any) -> OffloadingWorker:
    """Replacement for ``TieringOffloadingSpec.get_worker`` on a CPU-only machine."""
    if getattr(self, "_worker", None) is None:
        self._worker = CPUStandInWorker(self, kv_caches)
    return self._worker


# ---- vLLM's own CPUOffloadingSpec on a CPU-only machine -----------------------------------------


class CPUOffloadingStandInWorker(OffloadingWorker):
    """CPU twin of vLLM 0.33's ``CPUOffloadingWorker`` (``cpu/gpu_worker.py``), tensor path.

    On a CPU platform vLLM itself would not use the shared mmap region
    (``CPUOffloadingSpec._uses_shared_region()`` is False there) but a plain
    ``(num_chunks, page_size_bytes * blocks_per_chunk)`` int8 tensor per canonical KV tensor, and
    ``SingleDirectionOffloadingHandler`` fills one copy per (block, data ref) through
    ``compute_sub_block_ptrs``: GPU side one block per row, CPU side ``blocks_per_chunk`` sub-blocks
    per chunk row, the first chunk of group ``g`` skipping ``block_indices[g] % blocks_per_chunk``
    sub-blocks (a Mamba boundary state is one block in its chunk's last slot), ``page_size_bytes``
    of the ref (unpadded) copied at ``sub * (row_bytes // blocks_per_chunk)``. This class does the
    same with ``torch`` copies. Transfers run in submission order per direction (store, load,
    expedited load), like vLLM's one-stream-after-another handlers.

    ``delay_steps`` > 0 emulates a slow device: a job's bytes are copied only when it completes,
    ``delay_steps`` calls of ``get_finished`` after submission (or at ``wait``), the latest moment
    a real DMA could read/write them — so vLLM's fences (``jobs_to_flush``) are exercised.
    """

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_cpu_chunks: int, delay_steps: int = 0) -> None:
        import torch

        self.bpc = int(blocks_per_chunk)
        self.delay_steps = int(delay_steps)
        self.gpu = []
        self.cpu = []
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            self.gpu.append(t.tensor.view(torch.int8).view(-1, page))
            self.cpu.append(torch.zeros((num_cpu_chunks, page * self.bpc), dtype=torch.int8))
        self.refs = kv_caches.group_data_refs
        # direction -> FIFO of [job_id, steps_left, ops, nbytes, t_submit]
        self._queues: dict[str, list[list[Any]]] = {"store": [], "load": [], "expedited": []}
        self._done: list[TransferResult] = []
        self.submitted = {"store": 0, "load": 0}

    def _plan(self, job_id: int, src_spec: Any, dst_spec: Any, gpu_to_cpu: bool) -> tuple[list[tuple[Any, Any]], int]:
        """The (src view, dst view) copies of one transfer, exactly as vLLM's handler addresses them."""
        src_blocks = [int(b) for b in src_spec.block_ids]
        dst_blocks = [int(b) for b in dst_spec.block_ids]
        gpu_spec = src_spec if gpu_to_cpu else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        group_sizes = list(gpu_spec.group_sizes)
        block_indices = list(gpu_spec.block_indices)
        assert len(group_sizes) == len(self.refs) == len(block_indices), (job_id, group_sizes, len(self.refs))
        src_bpc, dst_bpc = (1, self.bpc) if gpu_to_cpu else (self.bpc, 1)
        src_tensors, dst_tensors = (self.gpu, self.cpu) if gpu_to_cpu else (self.cpu, self.gpu)
        ops: list[tuple[Any, Any]] = []
        nbytes = src_off = dst_off = 0
        for g, (size, bidx) in enumerate(zip(group_sizes, block_indices)):
            size, bidx = int(size), int(bidx)
            if size == 0:
                continue
            src_skip, dst_skip = bidx % src_bpc, bidx % dst_bpc
            src_n = -(-(size + src_skip) // src_bpc)
            dst_n = -(-(size + dst_skip) // dst_bpc)
            g_src = src_blocks[src_off : src_off + src_n]
            g_dst = dst_blocks[dst_off : dst_off + dst_n]
            assert len(g_src) == src_n and len(g_dst) == dst_n, (job_id, g, src_n, dst_n, src_blocks, dst_blocks)
            src_off += src_n
            dst_off += dst_n
            for ref in self.refs[g]:
                ti, page = ref.tensor_idx, int(ref.page_size_bytes)
                st, dt = src_tensors[ti], dst_tensors[ti]
                s_sub, d_sub = st.shape[1] // src_bpc, dt.shape[1] // dst_bpc
                for j in range(size):
                    sp, dp = src_skip + j, dst_skip + j
                    s_row, s_col = g_src[sp // src_bpc], (sp % src_bpc) * s_sub
                    d_row, d_col = g_dst[dp // dst_bpc], (dp % dst_bpc) * d_sub
                    ops.append((st[s_row, s_col : s_col + page], dt[d_row, d_col : d_col + page]))
                    nbytes += page
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks), (
            f"job {job_id}: mapped {src_off}/{len(src_blocks)} src, {dst_off}/{len(dst_blocks)} dst blocks"
        )
        return ops, nbytes

    def _submit(self, direction: str, job_id: int, src: Any, dst: Any, gpu_to_cpu: bool) -> bool:
        ops, nbytes = self._plan(job_id, src, dst, gpu_to_cpu)
        entry = [job_id, self.delay_steps, ops, nbytes, time.perf_counter()]
        if self.delay_steps == 0:
            self._run(entry)
        self._queues[direction].append(entry)
        return True

    @staticmethod
    def _run(entry: list[Any]) -> None:
        for src, dst in entry[2]:
            dst.copy_(src)
        entry[2] = []

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.submitted["store"] += 1
        return self._submit("store", job_id, src_spec, dst_spec, gpu_to_cpu=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        self.submitted["load"] += 1
        return self._submit("expedited" if expedited else "load", job_id, src_spec, dst_spec, gpu_to_cpu=False)

    def _complete_head(self, queue: list[list[Any]]) -> None:
        entry = queue.pop(0)
        self._run(entry)
        self._done.append(TransferResult(entry[0], True, entry[3], time.perf_counter() - entry[4]))

    def get_finished(self) -> list[TransferResult]:
        for queue in self._queues.values():
            for entry in queue:
                entry[1] -= 1
            while queue and queue[0][1] < 0:
                self._complete_head(queue)
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        for queue in self._queues.values():
            while queue and any(e[0] in job_ids for e in queue):
                self._complete_head(queue)

    def shutdown(self) -> None:
        self.cpu.clear()
        self.gpu.clear()


def cpu_offloading_get_worker(self: Any, kv_caches: Any) -> OffloadingWorker:
    """Replacement for ``CPUOffloadingSpec.get_worker`` on a CPU-only machine (vLLM's raises)."""
    if getattr(self, "_worker", None) is None:
        delay = int(self.extra_config.get("stand_in_delay_steps", 0))
        self._worker = CPUOffloadingStandInWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, delay)
    return self._worker

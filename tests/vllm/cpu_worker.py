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

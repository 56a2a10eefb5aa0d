"""The worker side: whole blocks between vLLM's KV tensors and the host region, then to the store.

vLLM hands the worker its KV caches as canonical tensors, each ``(num_blocks,
page_bytes)`` bytes.  A host row is those pages side by side, so one transfer
is one indexed copy per tensor over all the transfer's blocks (numpy fancy indexing
for CPU tensors, ``index_select`` / ``index_put_`` on a device), never a loop over
blocks or tokens.  A store job, once its
blocks are in the host region, hands a copy of the rows to a writer thread that
``batch_set``\\ s them (kvcore frames each with its length and checksum); the
job is reported done at once, so vLLM never waits on the network.  A failed
write only means the store lacks the block: a later reader misses and computes it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found,unused-ignore]
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvcore.stores import KVStore
from kvcore_vllm.manager import KvcoreLoadStoreSpec
from kvcore_vllm.region import HostRegion

__all__ = ["KvcoreOffloadingWorker", "canonical_row_bytes"]

log = logging.getLogger("kvcore_vllm")


def canonical_row_bytes(kv_caches: CanonicalKVCaches) -> int:
    return sum(int(t.tensor.shape[1]) for t in kv_caches.tensors)


class KvcoreOffloadingWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, region: HostRegion, store: KVStore | None) -> None:
        self.region = region
        self.store = store
        self.tensors: list[torch.Tensor] = []
        # CPU tensors are copied through numpy views: one memcpy per block row on the calling thread, where
        # torch's indexed copies into vLLM's strided block views run on its OpenMP pool (measured 4-6 MB/s
        # against numpy's 1-5 GB/s on this 2-core machine under load).
        self.arrays: list[np.ndarray[Any, Any] | None] = []
        self.columns: list[tuple[int, int]] = []
        off = 0
        for t in kv_caches.tensors:
            tensor = t.tensor
            width = int(tensor.shape[1])
            self.tensors.append(tensor)
            self.arrays.append(tensor.numpy() if tensor.device.type == "cpu" else None)
            self.columns.append((off, off + width))
            off += width
        self.host = region.data.numpy()
        if off != region.row_bytes:
            raise ValueError(f"kvcore-vllm: vLLM's KV caches hold {off} bytes per block but the host tier was sized "
                             f"for {region.row_bytes}; this KV layout is not served (see the plugin's README)")
        self._finished: list[TransferResult] = []
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future[list[bool]]] = []
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.load_s = 0.0
        self.store_s = 0.0

    @staticmethod
    def _index(ids: object) -> torch.Tensor:
        return torch.as_tensor(ids, dtype=torch.int64)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvcoreLoadStoreSpec)
        t0 = time.perf_counter()
        blocks = self._index(src_spec.block_ids)
        slots = self._index(dst_spec.slots)
        n = min(len(blocks), len(slots))
        blocks, slots = blocks[:n], slots[:n]
        host = self.region.data
        if n:
            for tensor, arr, (lo, hi) in zip(self.tensors, self.arrays, self.columns, strict=True):
                if arr is not None:
                    self.host[slots.numpy(), lo:hi] = arr[blocks.numpy()].view(np.uint8)
                else:
                    pages = tensor.index_select(0, blocks.to(tensor.device, non_blocking=True))
                    host[slots, lo:hi] = pages.view(torch.uint8).to("cpu")
        size = n * self.region.row_bytes
        if n and dst_spec.store_keys and self.store is not None:
            rows = self.host[slots.numpy()]  # a copy: the slots may be reused before the write ends
            payloads = [memoryview(rows[i].data) for i in range(n)]
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcore-vllm-write")
            self._writes = [w for w in self._writes if not w.done()]
            self._writes.append(self._writer.submit(self.store.batch_set, dst_spec.store_keys[:n], payloads))
        self.bytes_stored += size
        dt = time.perf_counter() - t0
        self.store_s += dt
        self._finished.append(TransferResult(job_id, True, size, dt))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KvcoreLoadStoreSpec)
        t0 = time.perf_counter()
        slots = self._index(src_spec.slots)
        blocks = self._index(dst_spec.block_ids)
        n = min(len(blocks), len(slots))
        blocks, slots = blocks[:n], slots[:n]
        if n:
            rows = self.host[slots.numpy()]
            for tensor, arr, (lo, hi) in zip(self.tensors, self.arrays, self.columns, strict=True):
                if arr is not None:
                    arr[blocks.numpy()] = rows[:, lo:hi].view(arr.dtype)
                else:
                    dev = tensor.device
                    src = torch.from_numpy(rows[:, lo:hi]).to(dev).view(tensor.dtype)
                    tensor.index_put_((blocks.to(dev),), src)
        size = n * self.region.row_bytes
        self.bytes_loaded += size
        dt = time.perf_counter() - t0
        self.load_s += dt
        self._finished.append(TransferResult(job_id, True, size, dt))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Every job is done when its submit returns (the copies are synchronous on this device)."""

    def flush(self) -> None:
        """Wait for the store writes handed to the writer thread (tests and benchmarks call it)."""
        for w in self._writes:
            w.result()
        self._writes.clear()

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._writes.clear()
        if self.store is not None:
            self.store.close()
        # Drop the views of the mapping first, so that it can be unmapped now.
        self.arrays = [None] * len(self.arrays)
        self.host = np.empty((0, self.region.row_bytes), dtype=np.uint8)
        self.region.close()

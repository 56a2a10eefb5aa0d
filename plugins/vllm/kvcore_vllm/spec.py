"""``KvcoreOffloadingSpec``: vLLM's ``OffloadingSpec`` that builds kvcore's manager and worker.

Selected with ``kv_transfer_config = {"kv_connector": "OffloadingConnector",
"kv_role": "kv_both", "kv_connector_extra_config": {"spec_name":
"KvcoreOffloadingSpec", "store": URL, ...}}``.  What it refuses, it refuses here,
when vLLM builds the connector, with one error that says what to change.
"""

from __future__ import annotations

import hashlib
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker  # type: ignore[import-not-found,unused-ignore]
from vllm.v1.kv_offload.config import OffloadingConfig  # type: ignore[import-not-found,unused-ignore]

from kvcore.stores import KVStore, StoreNamespace, open_store
from kvcore_vllm.books import HostBooks
from kvcore_vllm.config import KvcoreVllmConfig, parse_extra_config
from kvcore_vllm.manager import KvcoreOffloadingManager
from kvcore_vllm.region import HostRegion, region_path
from kvcore_vllm.worker import KvcoreOffloadingWorker, canonical_row_bytes

__all__ = ["KvcoreOffloadingSpec", "NotServed", "block_hash_seed_digest"]


class NotServed(ValueError):
    """An engine configuration kvcore-vllm does not serve."""


def block_hash_seed_digest() -> str:
    """A digest of vLLM's NONE_HASH: it names the block-hash algorithm and seed, so engines whose
    block hashes cannot agree never share a namespace."""
    from vllm.v1.core import kv_cache_utils  # type: ignore[import-not-found,unused-ignore]

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        # Not initialised in this process: the scheduler initialises it before its first request.
        raise RuntimeError("vLLM's NONE_HASH is not initialised yet")
    return hashlib.sha256(bytes(none_hash)).hexdigest()[:16]


class KvcoreOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options: KvcoreVllmConfig = parse_extra_config(self.extra_config)
        self._refuse_what_is_not_served(config)
        self.row_bytes = int(config.worker_kv_bytes_per_block)
        self.num_blocks = self.options.host_bytes // max(1, self.row_bytes)
        if self.num_blocks < 1:
            raise ValueError(f"kvcore-vllm: host_bytes={self.options.host_bytes} holds no block of "
                             f"{self.row_bytes} bytes; give host_bytes of at least {self.row_bytes}")
        group = config.groups[0]
        par = config.parallel
        # The layout names everything that makes two engines' bytes for one block hash differ.
        layers = len(group.layer_names)
        self.namespace = StoreNamespace(
            layout=(f"vllm:{self.options.namespace}:{config.model.name}:L{layers}:B{self.row_bytes}"
                    f":{config.kv_cache_layout or 'default'}:canon{int(config.canonical_layout)}"),
            dtype=str(config.model.dtype),
            page_size=int(group.tokens_per_block),
        )
        self._rank_key = f"tp{par.tp_size}pp{par.pp_size}r{par.rank}"
        self._prefix: str | None = None
        self._manager: KvcoreOffloadingManager | None = None
        self._worker: KvcoreOffloadingWorker | None = None

    @staticmethod
    def _refuse_what_is_not_served(config: OffloadingConfig) -> None:
        par = config.parallel
        problems = []
        if len(config.groups) != 1:
            problems.append(f"the model has {len(config.groups)} KV cache groups (a hybrid model: sliding window, "
                            "Mamba or several attention types); kvcore-vllm serves one full-attention group")
        if par.world_size != 1 or par.tp_size != 1 or par.pp_size != 1:
            problems.append(f"tensor/pipeline parallel (tp={par.tp_size}, pp={par.pp_size}, "
                            f"world_size={par.world_size}); kvcore-vllm serves one worker per engine")
        if par.pcp_size != 1 or par.dcp_size != 1:
            problems.append(f"context parallel (pcp={par.pcp_size}, dcp={par.dcp_size}) is not served")
        if config.cache.blocks_per_chunk != 1:
            problems.append(f"blocks_per_chunk={config.cache.blocks_per_chunk} (or a block_size larger than the "
                            "engine's); kvcore-vllm offloads whole engine blocks: drop that key")
        if config.replicated_layout:
            problems.append("a replicated (MLA) layout is not served")
        if problems:
            raise NotServed("kvcore-vllm (KvcoreOffloadingSpec) cannot serve this engine: " + "; ".join(problems)
                            + ". Run without the kvcore spec, or with vLLM's CPUOffloadingSpec.")

    # -- pieces both sides build ------------------------------------------------

    def _open_store(self) -> KVStore | None:
        return None if self.options.store is None else open_store(self.options.store)

    def _region(self) -> HostRegion:
        return HostRegion(region_path(self.config.engine_id, self.config.parallel.rank),
                          self.num_blocks + 1, self.row_bytes)

    def store_key(self, key: bytes) -> str:
        if self._prefix is None:
            self._prefix = self.namespace.prefix(f"{self._rank_key}:h{block_hash_seed_digest()}")
        return self._prefix + bytes(key).hex()

    # -- vLLM's interface ---------------------------------------------------------

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvcoreOffloadingManager(
                HostBooks(self.num_blocks, self.options.eviction_policy,
                          events=self.kv_events_config.enable_kv_cache_events),
                self._region,
                self._open_store(),
                self.store_key,
                write_to_store=self.options.write_to_store,
                max_fetch_blocks=self.options.max_fetch_blocks,
                read_wait_ms=self.options.read_wait_ms,
                verify_values=self.options.verify_values,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            got = canonical_row_bytes(kv_caches)
            if got != self.row_bytes:
                raise NotServed(f"kvcore-vllm: the worker's KV caches hold {got} bytes per block, vLLM's config says "
                                f"{self.row_bytes}; this KV layout (padded or packed pages) is not served")
            self._worker = KvcoreOffloadingWorker(kv_caches, self._region(), self._open_store())
        return self._worker

    def __repr__(self) -> str:
        opts: dict[str, Any] = self.options.model_dump()
        return f"KvcoreOffloadingSpec({opts})"

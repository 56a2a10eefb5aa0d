"""HiSparseCache: the ``hisparse`` backend (SGLang runs HiSparse with ``--disable-radix-cache``, so a chunk cache)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvcore.cache import SlotOwner
from kvcore.capabilities import Capability
from kvcore.chunk_cache import ChunkCache
from kvcore.pools.views import PoolView
from kvcore_hisparse.config import HiSparseConfig
from kvcore_hisparse.coordinator import HiSparseCoordinator, HiSparseTokenStats
from kvcore_hisparse.memory_pool import HiSparseHostPool, HiSparseTokenToKVPool, HiSparseTokenToKVPoolAllocator

if TYPE_CHECKING:
    from kvcore.config import CacheInitParams
    from kvcore.record import Req, ReqKvInfo

__all__ = ["HiSparseCache"]


class HiSparseCache(ChunkCache):
    """No prefix reuse; every request's full KV on the host, a small buffer of it on the device.

    Pools by name: ``full`` (logical slots: what rows hold), ``device`` (buffers,
    and prefills until they are staged) and ``host`` (a copy of every staged token).
    Lifecycle: the prompt's completion (``cache_unfinished_req`` with
    ``chunked=False``) admits the request into staging; ``on_decode_step`` collects
    it, maps each new token to its buffer and swaps the step's top-k selection in
    (every layer); finishing, retracting or aborting (``cache_finished_req``) gives
    its buffer and host copy back.  ``cache.coordinator`` is SGLang's
    ``HiSparseCoordinator`` for engines that drive it step by step.
    """

    token_to_kv_pool_allocator: HiSparseTokenToKVPoolAllocator
    kv_pool: HiSparseTokenToKVPool
    capabilities = frozenset({Capability.SPARSE})

    def __init__(self, params: CacheInitParams):
        config = params.config
        if not isinstance(config, HiSparseConfig):
            raise TypeError(f"HiSparseCache needs a HiSparseConfig, got {type(config).__name__}")
        alloc = params.token_to_kv_pool_allocator
        if not isinstance(alloc, HiSparseTokenToKVPoolAllocator):
            raise TypeError(f"HiSparseCache needs a HiSparseTokenToKVPoolAllocator, got {type(alloc).__name__}")
        if not isinstance(params.kv_pool, HiSparseTokenToKVPool):
            raise TypeError("HiSparseCache needs its device pool (HiSparsePools.kv_pool)")
        super().__init__(params)
        self.config: HiSparseConfig = config
        self.token_to_kv_pool_allocator = alloc
        self.kv_pool = params.kv_pool
        self.kv_pool.register_mapping(alloc.full_to_hisparse_device_index_mapping)
        self.host_pool = HiSparseHostPool(config.logical_size, self.page_size, self.kv_pool)
        self.top_k = config.top_k
        self.device_buffer_size = config.device_buffer_size
        self.coordinator = HiSparseCoordinator(
            self.req_to_token_pool, alloc, self.kv_pool, self.host_pool,
            top_k=config.top_k, device_buffer_size=config.device_buffer_size, device=alloc.device,
        )
        self._views = [
            PoolView("full", alloc.logical_attn_allocator),
            PoolView("device", alloc.hisparse_attn_allocator, record_slots=self._device_slots),
            PoolView("host", self.host_pool.allocator, record_slots=self._host_slots),
        ]
        self._reset_decode_stats()

    def _reset_decode_stats(self) -> None:
        self.decode_steps = 0
        self.decode_batch_peak = 0
        self.decode_device_slots_peak = 0
        self.device_bound_violations = 0
        self.full_kv_bytes_peak = 0
        self.device_kv_bytes_peak = 0
        self.device_bytes_saved = 0

    # ------------------------------------------------------------------ pools by name
    def pools(self) -> list[PoolView]:
        return list(self._views)

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        return {"full": (0, 0), "device": (0, 0), "host": (0, 0)}

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        return iter(())  # nothing is cached: every slot belongs to a request

    def _device_slots(self, kv: ReqKvInfo) -> tuple[torch.Tensor, int]:
        slots = self.coordinator.device_slots_held(kv)
        p = self.page_size
        count = slots.numel() if p == 1 else torch.unique(slots // p).numel() * p
        return slots, count

    def _host_slots(self, kv: ReqKvInfo) -> tuple[torch.Tensor, int]:
        state = self.coordinator.state_of(kv)
        if state is None:
            return torch.empty((0,), dtype=torch.int64), 0
        slots = self.host_pool.allocated_host_indices(state)
        return slots, int(slots.numel())

    def sanity_check(self) -> None:
        coord = self.coordinator
        for row, state in coord.states_by_row():
            kv = state.kv
            assert kv.req_pool_idx == row, (
                f"hisparse state of {state.rid!r} is filed under row {row}, its record holds {kv.req_pool_idx}"
            )
            assert kv.components.get("hisparse") is state, f"record of {state.rid!r} lost its hisparse state"
            assert state.staging == (state.act is not None), f"{state.rid!r}: staging flag and queue disagree"
            assert state.device_buffer_size_now <= coord.padded_buffer_size
        for act in coord.ack_staging_queue:
            # By the copy, not the request: a session may have adopted the request's record since.
            queued = coord.staging_state_of(act)
            assert queued is not None and queued.staging, f"staging queue holds {act.req.rid!r}, which is not staging"

    # ------------------------------------------------------------------ lifecycle
    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        super().cache_unfinished_req(req, chunked)
        if not chunked and self.coordinator.state_of(req.kv) is None and req.kv.kv_committed_len > 0:
            # The prompt is complete: SGLang admits the request into staging right after caching it.
            self.coordinator.admit_request_into_staging(req)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        self.check_req(req, "cache_finished_req")
        # SGLang: request_finished (or retract_req) before release_kv_cache.
        self.coordinator.retract_req(req)
        super().cache_finished_req(req, is_insert)

    def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None:
        # A row freed under a record that still holds hisparse state (a session's record) drops that state first.
        self.coordinator.release_record(kv)
        super().free_kv_row(kv, ranges)

    def reset(self) -> None:
        self._reset_decode_stats()

    # ------------------------------------------------------------------ decode
    def sparse_top_k(self) -> int:
        """Tokens of the context each decode step reads (the sparse indexer's top-k)."""
        return self.top_k

    def on_decode_step(self, reqs: Sequence[Req], selections: torch.Tensor) -> list[torch.Tensor]:
        """One decode step, after its slots are allocated and before its K/V is written.

        ``selections``: shape ``(len(reqs), <= top_k)``, each row the positions the step
        reads (-1: padding), in ``[0, seq_len)`` where ``seq_len`` is the record's
        allocated length (it counts the new token).  Requests not yet in hisparse are
        staged and collected first; then ``map_last_loc_to_buffer`` and, for every layer,
        ``swap_in_selected_pages``.  A bad selection raises ValueError before anything changes.
        Returns the device slots of the selection, one ``(len(reqs), top_k)`` tensor per layer.
        """
        reqs = list(reqs)
        if not reqs:
            return []
        coord = self.coordinator
        lens = []
        for req in reqs:
            kv = req.kv
            if kv.req_pool_idx is None or kv.kv_allocated_len < 2:
                raise ValueError(f"request {req.rid!r} has no decode step to act on (prefill it and allocate a slot)")
            lens.append(kv.kv_allocated_len)
        coord.check_selection([r.rid for r in reqs], lens, selections)
        known = [(coord.state_of(r.kv), n) for r, n in zip(reqs, lens) if coord.state_of(r.kv) is not None]
        coord.check_decode_step([st for st, _ in known if st is not None], [n for _, n in known])
        fresh = [(req, n) for req, n in zip(reqs, lens) if coord.state_of(req.kv) is None]
        for req, n in fresh:
            # Check every fresh request before staging any.
            full = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : n - 1].to(torch.int64)
            if bool((self.kv_pool.translate_loc_from_full_to_hisparse_device(full) <= 0).any()):
                raise ValueError(f"request {req.rid!r}: part of its prefill has no device KV to stage")
        for req, n in fresh:
            coord.admit_request_into_staging(req, n - 1)
        coord.collect_ready_reqs(wait=True)
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        table = self.req_to_token_pool.req_to_token
        out_cache_loc = table[rows.to(table.device), (lens_t - 1).to(table.device)].to(torch.int64)
        coord.map_last_loc_to_buffer(reqs, lens, out_cache_loc)
        locs = [coord.swap_in_selected_pages(rows, lens_t, selections, layer) for layer in range(coord.layer_num)]
        held = 0
        for req in reqs:
            state = coord.state_of(req.kv)
            assert state is not None
            held += state.device_buffer_size_now
        n = len(reqs)
        self.decode_steps += 1
        self.decode_batch_peak = max(self.decode_batch_peak, n)
        self.decode_device_slots_peak = max(self.decode_device_slots_peak, held)
        if held > n * coord.padded_buffer_size:
            self.device_bound_violations += 1
        bpt = self.kv_pool.bytes_per_token
        full_bytes, dev_bytes = sum(lens) * bpt, held * bpt
        self.full_kv_bytes_peak = max(self.full_kv_bytes_peak, full_bytes)
        self.device_kv_bytes_peak = max(self.device_kv_bytes_peak, dev_bytes)
        self.device_bytes_saved = max(self.device_bytes_saved, full_bytes - dev_bytes)
        return locs

    def stats(self) -> dict[str, int]:
        out = self.coordinator.stats()
        out.update(
            decode_steps=self.decode_steps,
            decode_batch_peak=self.decode_batch_peak,
            decode_device_slots_peak=self.decode_device_slots_peak,
            padded_buffer_size=self.coordinator.padded_buffer_size,
            device_bound_violations=self.device_bound_violations,
            full_kv_bytes_peak=self.full_kv_bytes_peak,
            device_kv_bytes_peak=self.device_kv_bytes_peak,
            device_bytes_saved=self.device_bytes_saved,
        )
        return out

    def get_token_stats(self) -> HiSparseTokenStats:
        return self.coordinator.get_token_stats()



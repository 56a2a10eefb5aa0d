"""SGLang's ``HiSparseCoordinator`` (``managers/hisparse_coordinator.py``), on kvcore's records.

The request path, with SGLang's names:

1. prefill writes KV into the device pool through the logical-to-device map;
2. ``admit_request_into_staging(req)`` copies it to the host (a side stream and
   events on CUDA, synchronously elsewhere); ``collect_ready_reqs()`` hands back
   the requests whose copy finished, each with its device buffer
   (``alloc_device_buffer``): ``device_buffer_size`` slots plus one page, reusing
   the prefill's device slots and giving the rest back.  KV that arrives on the
   host (disaggregated decode) takes ``alloc_host_slots`` + ``admit_request_direct``;
3. each decode step, ``map_last_loc_to_buffer`` backs the previous token up to the
   host and maps the new token to the buffer's reserved slot; then, per layer,
   ``swap_in_selected_pages`` returns the device slots of the step's top-k tokens,
   copying from the host only those not already in the buffer (a per-request,
   per-layer LRU over the buffer slots, as SGLang's swap-in kernel keeps it);
4. ``request_finished`` / ``retract_req`` give the buffer, the host copy and the
   mappings back.

Per-request state lives in ``req.kv.components["hisparse"]`` (a
:class:`HiSparseReqState`), so it moves with the record.  Differences from
SGLang: bad input raises ``ValueError`` with nothing changed (SGLang asserts);
``compress_ratio`` is 1 (DSA; DeepSeek V4's compressed C4 layout is not modelled);
top-k entries of -1 are padding; the temporary device slot a page-size-1 decode
allocation takes is freed when the token is mapped to its buffer (SGLang does
this on ROCm only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from kvcore.pools import ReqToTokenPool
    from kvcore.record import Req, ReqKvInfo
    from kvcore_hisparse.memory_pool import HiSparseHostPool, HiSparseTokenToKVPool, HiSparseTokenToKVPoolAllocator

__all__ = ["HiSparseCoordinator", "HiSparseReqState", "HiSparseTokenStats", "HiSparseAct", "COMPONENT"]

#: the key of the per-request state in ``ReqKvInfo.components``
COMPONENT = "hisparse"


class HiSparseTokenStats(NamedTuple):
    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


class HiSparseAct(NamedTuple):
    """A staging copy in flight: its events (None off CUDA: the copy is already done) and the request."""

    start_event: Any
    finish_event: Any
    req: Req


@dataclass(eq=False)
class HiSparseReqState:
    """One request's HiSparse state (SGLang keeps it in per-row tables of the coordinator).

    ``device_buffer[:device_buffer_size_now]`` are the buffer's device slots (SGLang's
    ``req_to_device_buffer`` row); slot index ``device_buffer_size`` is reserved for the
    newest token.  ``buffer_tokens[layer, i]`` is the token buffer slot ``i`` holds in that
    layer (-1: none); ``lru_slots[layer]`` orders the first ``device_buffer_size`` slots
    least recently used first; ``token_slots[layer, t]`` is the inverse (the slot holding token
    ``t``, -1: none; SGLang's kernel builds it per step as a hash table).  ``host_locs[pos]`` is
    the host slot of position ``pos``.
    """

    rid: str
    kv: ReqKvInfo
    host_locs: torch.Tensor
    device_buffer: torch.Tensor
    buffer_tokens: torch.Tensor
    lru_slots: torch.Tensor
    token_slots: torch.Tensor
    host_allocated_len: int = 0
    # Positions [0, here) have a host copy.
    host_backed_len: int = 0
    device_buffer_size_now: int = 0
    staging: bool = False
    prefill_len: int = 0
    skip_first_backup: bool = False
    act: HiSparseAct | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return not self.staging and self.device_buffer_size_now > 0


class HiSparseCoordinator:
    """Moves requests between prefill, host staging and sparse decode; see the module docstring."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: HiSparseTokenToKVPoolAllocator,
        mem_pool_device: HiSparseTokenToKVPool,
        mem_pool_host: HiSparseHostPool,
        top_k: int,
        device_buffer_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if device_buffer_size < top_k:
            raise ValueError(f"device_buffer_size={device_buffer_size} is smaller than top_k={top_k}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.mem_pool_device = mem_pool_device
        self.mem_pool_host = mem_pool_host
        self.top_k = top_k
        self.device_buffer_size = device_buffer_size
        self.device = torch.device(device)
        self.page_size = token_to_kv_pool_allocator.page_size
        self.padded_buffer_size = device_buffer_size + self.page_size
        self.layer_num = mem_pool_device.layer_num
        self.max_context_len = req_to_token_pool.max_context_len
        self.ack_staging_queue: list[HiSparseAct] = []
        self.is_cuda = self.device.type == "cuda"
        self.write_staging_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._lru_init = torch.arange(device_buffer_size, dtype=torch.int64)
        self._arange_tokens = torch.arange(device_buffer_size, dtype=torch.int64)
        # Requests with HiSparse state, by req_to_token row (SGLang's tables are indexed by row).
        self._states: dict[int, HiSparseReqState] = {}
        # Counters (``stats()``).
        self.swap_in_tokens = 0
        self.buffer_hits = 0
        self.buffer_misses = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    # ------------------------------------------------------------------ state
    def _new_state(self, req: Req) -> HiSparseReqState:
        layers, padded = self.layer_num, self.padded_buffer_size
        return HiSparseReqState(
            rid=req.rid,
            kv=req.kv,
            host_locs=torch.full((self.max_context_len + self.page_size,), -1, dtype=torch.int64),
            device_buffer=torch.zeros(padded, dtype=torch.int64),
            buffer_tokens=torch.full((layers, padded), -1, dtype=torch.int64),
            lru_slots=self._lru_init.repeat(layers, 1),
            token_slots=torch.full(
                (layers, max(self.max_context_len, self.device_buffer_size) + self.page_size), -1, dtype=torch.int64
            ),
        )

    @staticmethod
    def state_of(kv: ReqKvInfo) -> HiSparseReqState | None:
        return kv.components.get(COMPONENT)

    def states(self) -> list[HiSparseReqState]:
        return list(self._states.values())

    def states_by_row(self) -> list[tuple[int, HiSparseReqState]]:
        """Each live state with the request row it is filed under (what ``sanity_check`` compares)."""
        return list(self._states.items())

    def _attach(self, req: Req, state: HiSparseReqState) -> None:
        req.kv.components[COMPONENT] = state
        assert req.kv.req_pool_idx is not None
        self._states[req.kv.req_pool_idx] = state

    def _detach(self, kv: ReqKvInfo) -> None:
        state = kv.components.pop(COMPONENT, None)
        if state is not None and kv.req_pool_idx is not None:
            self._states.pop(kv.req_pool_idx, None)

    def _row_slots(self, kv: ReqKvInfo, end: int) -> torch.Tensor:
        assert kv.req_pool_idx is not None
        return self.req_to_token_pool.req_to_token[kv.req_pool_idx, :end].to(torch.int64)

    def _held_row(self, req: Req) -> int:
        if req.kv.req_pool_idx is None:
            raise ValueError(f"request {req.rid!r} holds no req_to_token row")
        return req.kv.req_pool_idx

    # ------------------------------------------------------------------ stats
    def get_token_stats(self) -> HiSparseTokenStats:
        dev = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        dev_cap = dev.size
        dev_tokens = dev_cap - dev.available_size()
        host_cap = self.mem_pool_host.size
        host_tokens = host_cap - self.mem_pool_host.available_size()
        return HiSparseTokenStats(
            device_tokens=dev_tokens,
            device_token_usage=dev_tokens / dev_cap if dev_cap else 0.0,
            host_tokens=host_tokens,
            host_token_usage=host_tokens / host_cap if host_cap else 0.0,
        )

    def device_slots_held(self, kv: ReqKvInfo) -> torch.Tensor:
        """Every device slot ``kv`` holds: its buffer and what its row still maps to (unique, int64)."""
        parts = []
        if kv.req_pool_idx is not None and kv.kv_allocated_len:
            mapped = self.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping[
                self._row_slots(kv, kv.kv_allocated_len).to(self.token_to_kv_pool_allocator.device)
            ].cpu()
            parts.append(mapped[mapped > 0])
        state = self.state_of(kv)
        if state is not None and state.device_buffer_size_now:
            buf = state.device_buffer[: state.device_buffer_size_now]
            parts.append(buf[buf > 0])
        if not parts:
            return torch.empty((0,), dtype=torch.int64)
        return torch.unique(torch.cat(parts))

    # ------------------------------------------------------------------ staging
    def admit_request_into_staging(self, req: Req, prefill_len: int | None = None) -> None:
        """Copy ``req``'s prefill KV (positions ``[0, prefill_len)``, default the committed length) to the host.

        On CUDA the copy runs on a side stream and ``collect_ready_reqs`` picks the
        request up once its event fired; elsewhere it is done on return.
        """
        row = self._held_row(req)
        kv = req.kv
        n = kv.kv_committed_len if prefill_len is None else prefill_len
        if not 0 < n <= kv.kv_allocated_len:
            raise ValueError(
                f"request {req.rid!r}: nothing to stage (prefill_len={n}, allocated {kv.kv_allocated_len})"
            )
        if self.state_of(kv) is not None:
            raise ValueError(f"request {req.rid!r} is already admitted into hisparse (staging or decoding)")
        full = self._row_slots(kv, n)
        device_indices = self.mem_pool_device.translate_loc_from_full_to_hisparse_device(full)
        missing = (device_indices <= 0).nonzero()
        if missing.numel():
            raise ValueError(
                f"request {req.rid!r}: position {int(missing[0])} of its prefill has no device KV to stage"
            )
        state = self._new_state(req)
        host_indices = self.mem_pool_host.alloc_paged_token_slots(state, 0, n)  # RuntimeError: nothing taken
        if self.is_cuda:
            start, finish = torch.cuda.Event(), torch.cuda.Event()
            start.record()
            stream = self.write_staging_stream
            assert stream is not None
            with torch.cuda.stream(stream):
                start.wait(stream)
                self.bytes_d2h += self.mem_pool_host.backup_from_device_all_layer(
                    self.mem_pool_device, host_indices, device_indices
                )
                finish.record()
            act = HiSparseAct(start, finish, req)
        else:
            self.bytes_d2h += self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host_indices, device_indices
            )
            act = HiSparseAct(None, None, req)
        state.staging = True
        state.prefill_len = n
        state.host_backed_len = n
        state.act = act
        self._attach(req, state)
        self.ack_staging_queue.append(act)
        del row

    def has_ongoing_staging(self) -> bool:
        return len(self.ack_staging_queue) > 0

    def collect_ready_reqs(self, wait: bool = False) -> list[Req]:
        """Requests whose staging copy finished, in admission order, each given its device buffer.

        ``wait``: block until every staging copy finished (kvcore's bench decodes a
        request in the step after its prefill).
        """
        ready: list[Req] = []
        while self.ack_staging_queue:
            act = self.ack_staging_queue[0]
            if act.finish_event is not None:
                if wait:
                    act.finish_event.synchronize()
                elif not act.finish_event.query():
                    break
            req = act.req
            state = self.state_of(req.kv)
            if state is None or state.act is not act:
                # The request's record moved on while it was staging (a streaming session adopted a
                # turn that finished before its copy was collected): drop that staging copy.
                self.ack_staging_queue.pop(0)
                self._drop_stale_staging(act)
                continue
            self.alloc_device_buffer(req)
            self.ack_staging_queue.pop(0)
            state.skip_first_backup = True
            state.staging = False
            state.act = None
            ready.append(req)
        return ready

    # ------------------------------------------------------------------ direct-to-host
    def alloc_host_slots(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Host slots for positions ``[0, num_tokens)`` of ``req``: where the KV of the direct path is written.

        (SGLang's decode pre-allocation, ``alloc_paged_token_slots(..., 0, fill_len)``.)
        """
        self._held_row(req)
        if num_tokens <= 0 or num_tokens > self.max_context_len:
            raise ValueError(f"request {req.rid!r}: num_tokens={num_tokens} is outside [1, {self.max_context_len}]")
        state = self.state_of(req.kv)
        if state is not None and (state.staging or state.device_buffer_size_now):
            raise ValueError(f"request {req.rid!r} is already admitted into hisparse")
        fresh = state is None
        if state is None:
            state = self._new_state(req)
        locs = self.mem_pool_host.alloc_paged_token_slots(state, 0, num_tokens)
        if fresh:
            self._attach(req, state)
        return locs

    def admit_request_direct(self, req: Req) -> None:
        """Admit a request whose KV already sits in host memory (``alloc_host_slots``): give it a buffer,
        preloaded when the whole sequence fits, else empty so every selected token is a miss."""
        self._held_row(req)
        kv = req.kv
        state = self.state_of(kv)
        if state is None or state.host_allocated_len < kv.kv_allocated_len or kv.kv_allocated_len == 0:
            raise ValueError(
                f"request {req.rid!r}: its {kv.kv_allocated_len} tokens have no host copy; call alloc_host_slots "
                "and write the KV there first"
            )
        if state.staging or state.device_buffer_size_now:
            raise ValueError(f"request {req.rid!r} is already admitted into hisparse")
        self.alloc_device_buffer(req)
        host_len = kv.kv_allocated_len
        state.host_backed_len = host_len
        if host_len <= self.device_buffer_size:
            self._preload_to_device_buffer(state, host_len)
        else:
            state.buffer_tokens[:, : self.device_buffer_size] = -1
            state.token_slots.fill_(-1)
        state.staging = False
        state.skip_first_backup = True

    def _preload_to_device_buffer(self, state: HiSparseReqState, n: int) -> None:
        host = state.host_locs[:n]
        dev = state.device_buffer[:n]
        for layer in range(self.layer_num):
            self.bytes_h2d += self.mem_pool_host.load_to_device_per_layer(self.mem_pool_device, host, dev, layer)

    # ------------------------------------------------------------------ device buffer
    def alloc_device_buffer(self, req: Req) -> None:
        """Give ``req`` its buffer: as many slots as its tokens (page-aligned), or the full
        ``device_buffer_size`` plus the reserved page once it reaches that size."""
        kv = req.kv
        state = self.state_of(kv)
        if state is None:
            raise ValueError(f"request {req.rid!r} was not admitted into hisparse")
        allocated_len = kv.kv_allocated_len
        p = self.page_size
        alloc_size = min(-(-allocated_len // p) * p, self.device_buffer_size)
        if alloc_size == self.device_buffer_size:
            alloc_size = self.padded_buffer_size
        buf = self.token_to_kv_pool_allocator.alloc_device_buffer(self._row_slots(kv, allocated_len), alloc_size)
        if buf is None:
            raise RuntimeError(
                f"HiSparse alloc_device_buffer failed for request {req.rid!r} ({alloc_size} device slots)"
            )
        state.device_buffer[:alloc_size] = buf.cpu()
        state.device_buffer_size_now = alloc_size
        state.buffer_tokens[:, : self.device_buffer_size] = self._arange_tokens
        state.lru_slots[:] = self._lru_init
        state.token_slots.fill_(-1)
        state.token_slots[:, : self.device_buffer_size] = self._arange_tokens

    def _grow_device_buffers(self, states: list[HiSparseReqState], seq_lens: list[int]) -> list[int]:
        """Grow the buffers of short requests that outgrew them; returns each request's newest-token slot."""
        p = self.page_size
        grows: list[tuple[HiSparseReqState, int, int]] = []
        total = 0
        for state, seq_len in zip(states, seq_lens):
            cap = state.device_buffer_size_now
            if seq_len <= self.device_buffer_size and seq_len > cap:
                new_cap = min(-(-seq_len // p) * p, self.device_buffer_size)
                if new_cap == self.device_buffer_size:
                    new_cap = self.padded_buffer_size
                if new_cap > cap:
                    grows.append((state, cap, new_cap))
                    total += new_cap - cap
        if total:
            new = self.token_to_kv_pool_allocator.hisparse_attn_allocator.alloc(total)
            if new is None:
                raise RuntimeError(f"HiSparse _grow_device_buffers failed (total_grow={total})")
            new = new.cpu()
            off = 0
            for state, cap, new_cap in grows:
                state.device_buffer[cap:new_cap] = new[off : off + new_cap - cap]
                off += new_cap - cap
                state.device_buffer_size_now = new_cap
        return [int(s.device_buffer[min(n - 1, self.device_buffer_size)]) for s, n in zip(states, seq_lens)]

    def map_last_loc_to_buffer(self, reqs: list[Req], seq_lens: list[int], out_cache_loc: torch.Tensor) -> None:
        """One decode step's bookkeeping: back the previous token up to the host, grow short buffers,
        and map each new token (logical slot ``out_cache_loc[i]``) to its buffer slot.

        ``seq_lens`` count the new token.  (SGLang's signature takes the batch's
        tensors; kvcore's records carry the rows.)
        """
        states = [self._ready_state(req) for req in reqs]
        self.check_decode_step(states, seq_lens)
        self._eager_backup_previous_token(states, seq_lens)
        reserved = self._grow_device_buffers(states, seq_lens)
        alloc = self.token_to_kv_pool_allocator
        mapping = alloc.full_to_hisparse_device_index_mapping
        locs = out_cache_loc.to(device=mapping.device, dtype=torch.int64)
        reserved_t = torch.tensor(reserved, dtype=torch.int64, device=mapping.device)
        previous = mapping[locs]
        stale = previous[(previous > 0) & (previous != reserved_t)]
        if stale.numel():
            # A page-size-1 decode allocation took a temporary device slot (SGLang frees it on ROCm only).
            alloc.free_hisparse_indices(stale)
        mapping[locs] = reserved_t

    def check_decode_step(self, states: list[HiSparseReqState], seq_lens: list[int]) -> None:
        """Refuse a step that does not follow the last one: every token but the newest two must be on the host.

        (A streaming-session turn that prefilled more tokens after staging is refused here:
        their KV would have to be staged again.)"""
        for state, seq_len in zip(states, seq_lens):
            if seq_len - 2 > state.host_backed_len or seq_len > state.kv.kv_allocated_len:
                raise ValueError(
                    f"request {state.rid!r}: decode step at length {seq_len} does not follow its hisparse state "
                    f"({state.host_backed_len} tokens on the host); hisparse cannot resume a request prefilled "
                    "again after staging (streaming sessions: run with --no-sessions)"
                )

    def _eager_backup_previous_token(self, states: list[HiSparseReqState], seq_lens: list[int]) -> None:
        host_parts, dev_parts = [], []
        for state, seq_len in zip(states, seq_lens):
            if state.skip_first_backup:
                state.skip_first_backup = False
                continue
            pos = seq_len - 2
            if pos < 0:
                continue
            dev_parts.append(int(state.device_buffer[min(pos, self.device_buffer_size)]))
            host_parts.append(self.mem_pool_host.alloc_paged_token_slots(state, pos, 1))
            state.host_backed_len = max(state.host_backed_len, pos + 1)
        if host_parts:
            self.bytes_d2h += self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, torch.cat(host_parts), torch.tensor(dev_parts, dtype=torch.int64)
            )

    # ------------------------------------------------------------------ swap-in
    def _ready_state(self, req: Req) -> HiSparseReqState:
        state = self.state_of(req.kv)
        if state is None or not state.ready:
            raise ValueError(
                f"request {req.rid!r} has no hisparse device buffer (admit it into staging and collect it first)"
            )
        return state

    def _states_for_rows(self, req_pool_indices: torch.Tensor) -> list[HiSparseReqState]:
        out = []
        for row in req_pool_indices.tolist():
            state = self._states.get(int(row))
            if state is None or not state.ready:
                raise ValueError(f"req_to_token row {int(row)} holds no request with a hisparse device buffer")
            out.append(state)
        return out

    def check_selection(self, rids: list[str], seq_lens: list[int], top_k_result: torch.Tensor) -> torch.Tensor:
        """Refuse (ValueError) a selection that does not fit: its shape, an index outside a request's
        ``seq_len`` tokens (-1 is padding), a token named twice.  Returns it as a CPU int64 tensor."""
        if not isinstance(top_k_result, torch.Tensor):
            raise ValueError(f"top_k_result must be a tensor, got {type(top_k_result).__name__}")
        if top_k_result.dim() != 2 or top_k_result.shape[0] != len(rids):
            raise ValueError(
                f"top_k_result must have shape ({len(rids)}, <= {self.top_k}), got {tuple(top_k_result.shape)}"
            )
        if top_k_result.shape[1] > self.top_k:
            raise ValueError(f"top_k_result has {top_k_result.shape[1]} columns, more than top_k={self.top_k}")
        if top_k_result.is_floating_point() or top_k_result.is_complex() or top_k_result.dtype == torch.bool:
            raise ValueError(f"top_k_result must hold integer token positions, got {top_k_result.dtype}")
        sel = top_k_result.to("cpu", torch.int64)
        for rid, seq_len, row in zip(rids, seq_lens, sel):
            bad = (row < -1) | (row >= seq_len)
            if bool(bad.any()):
                raise ValueError(
                    f"request {rid!r}: top-k index {int(row[bad][0])} is outside the request's "
                    f"{seq_len} tokens (or -1 for padding)"
                )
            valid = row[row >= 0]
            if valid.numel() != torch.unique(valid).numel():
                raise ValueError(f"request {rid!r}: top-k selection names a token twice")
        return sel

    def check_top_k(self, states: list[HiSparseReqState], seq_lens: list[int], top_k_result: torch.Tensor) -> None:
        """``check_selection``, then what the states must hold for it: lengths, a full buffer, host copies."""
        sel = self.check_selection([s.rid for s in states], seq_lens, top_k_result)
        for i, (state, seq_len) in enumerate(zip(states, seq_lens)):
            kv = state.kv
            if not 0 < seq_len <= kv.kv_allocated_len:
                raise ValueError(
                    f"request {state.rid!r}: seq_len {seq_len} is outside [1, {kv.kv_allocated_len}] "
                    "(its allocated length)"
                )
            if seq_len > self.device_buffer_size and state.device_buffer_size_now < self.padded_buffer_size:
                raise ValueError(
                    f"request {state.rid!r}: seq_len {seq_len} outgrew its buffer; map_last_loc_to_buffer first"
                )
            row = sel[i]
            valid = row[row >= 0]
            if seq_len > self.device_buffer_size:
                older = valid[valid != seq_len - 1]
                missing = older[state.host_locs[older] < 0] if older.numel() else older
                if missing.numel():
                    raise ValueError(
                        f"request {state.rid!r}: token {int(missing[0])} has no host copy (was its decode step mapped?)"
                    )

    def swap_in_selected_pages(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, top_k_result: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """Device slots of each request's selected tokens in layer ``layer_id``, shape ``(n, top_k)`` int32, -1 padded.

        A request whose whole sequence fits its buffer reads token ``t`` at buffer slot
        ``t``.  Otherwise the newest token reads the reserved slot, tokens already in the
        buffer are hits (no copy), and each miss is copied from the host into the least
        recently used slot not selected this step; the layer's LRU order becomes
        [unselected, least recent first] + [misses] + [hits].
        """
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id={layer_id} is outside [0, {self.layer_num})")
        states = self._states_for_rows(req_pool_indices)
        lens = [int(x) for x in seq_lens.tolist()]
        self.check_top_k(states, lens, top_k_result)
        sel_all = top_k_result.to("cpu", torch.int64)
        n = len(states)
        out = torch.full((n, self.top_k), -1, dtype=torch.int64)
        dbs = self.device_buffer_size
        host_src, dev_dst = [], []
        for i, (state, seq_len) in enumerate(zip(states, lens)):
            sel = sel_all[i]
            k = sel.numel()
            valid = sel >= 0
            if seq_len <= dbs:
                out[i, :k][valid] = state.device_buffer[sel[valid]]
                self.buffer_hits += int(valid.sum())
                continue
            is_newest = sel == seq_len - 1
            if bool(is_newest.any()):
                out[i, :k][is_newest] = state.device_buffer[dbs]
                self.buffer_hits += int(is_newest.sum())
            want = valid & ~is_newest
            want_pos = want.nonzero().flatten()
            tokens = sel[want_pos]
            order = state.lru_slots[layer_id]
            token_slots = state.token_slots[layer_id]
            slot_of = token_slots[tokens]
            found = slot_of >= 0
            found_slots = slot_of[found]
            mark = torch.zeros(self.padded_buffer_size, dtype=torch.bool)
            mark[found_slots] = True
            is_hit = mark[order]
            hit_slots, evictable = order[is_hit], order[~is_hit]
            out[i, want_pos[found]] = state.device_buffer[found_slots]
            miss_tokens = tokens[~found]
            nm = miss_tokens.numel()
            dst = evictable[:nm]
            old = state.buffer_tokens[layer_id][dst]
            token_slots[old[old >= 0]] = -1
            state.buffer_tokens[layer_id][dst] = miss_tokens
            token_slots[miss_tokens] = dst
            dst_locs = state.device_buffer[dst]
            out[i, want_pos[~found]] = dst_locs
            state.lru_slots[layer_id] = torch.cat([evictable[nm:], dst, hit_slots])
            self.buffer_hits += int(found.sum())
            self.buffer_misses += nm
            if nm:
                host_src.append(state.host_locs[miss_tokens])
                dev_dst.append(dst_locs)
        if host_src:
            src, dst_all = torch.cat(host_src), torch.cat(dev_dst)
            self.swap_in_tokens += src.numel()
            self.bytes_h2d += self.mem_pool_host.load_to_device_per_layer(self.mem_pool_device, src, dst_all, layer_id)
        return out.to(device=self.device, dtype=torch.int32)

    def naive_load_topk(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, top_k_tokens: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """The plain reference: load every selected token (but the newest) from the host into buffer
        slots ``0..m-1`` and return their device slots.  It ignores (and overwrites) what the LRU
        believes the buffer holds, so run it on a twin of the cache, as an oracle."""
        states = self._states_for_rows(req_pool_indices)
        lens = [int(x) for x in seq_lens.tolist()]
        self.check_top_k(states, lens, top_k_tokens)
        sel_all = top_k_tokens.to("cpu", torch.int64)
        out = torch.full((len(states), self.top_k), -1, dtype=torch.int64)
        for i, (state, seq_len) in enumerate(zip(states, lens)):
            top_n = min(seq_len, sel_all.shape[1])
            sel = sel_all[i, :top_n]
            sel = sel[sel >= 0]
            if seq_len <= self.device_buffer_size:
                out[i, : sel.numel()] = state.device_buffer[sel]
                continue
            dev = torch.empty(sel.numel(), dtype=torch.int64)
            latest = sel == seq_len - 1
            dev[latest] = state.device_buffer[self.device_buffer_size]
            load = ~latest
            m = int(load.sum())
            if m:
                host = state.host_locs[sel[load]]
                buf = state.device_buffer[:m]
                dev[load] = buf
                self.mem_pool_host.load_to_device_per_layer(self.mem_pool_device, host, buf, layer_id)
            out[i, : sel.numel()] = dev
        return out.to(device=self.device, dtype=torch.int32)

    # ------------------------------------------------------------------ release
    def abort_staging_request(self, req: Req) -> None:
        """Drop a request still in staging: its prefill's device slots, its host copy, its queue entry."""
        kv = req.kv
        state = self.state_of(kv)
        if state is None:
            return
        self.ack_staging_queue = [a for a in self.ack_staging_queue if a.req is not req and a is not state.act]
        if self.write_staging_stream is not None:
            self.write_staging_stream.synchronize()
        self._drop_staging_state(kv, state)

    def _drop_staging_state(self, kv: ReqKvInfo, state: HiSparseReqState) -> None:
        """Free what a staging request holds: the device slots its row maps to, its host copy.

        The whole allocated row, not only the prefill: with pages, a device page the prefill
        ends in is freed whole, and a slot past the prefill that maps into it must not keep
        pointing there (the row's own free would free that page again).
        """
        self.token_to_kv_pool_allocator.free_hisparse(self._row_slots(kv, kv.kv_allocated_len))
        self._free_host(state)
        self._detach(kv)

    def staging_state_of(self, act: HiSparseAct) -> HiSparseReqState | None:
        """The state a queued staging copy was made for (its request's record may have moved since)."""
        return next((st for st in self._states.values() if st.act is act), None)

    def _drop_stale_staging(self, act: HiSparseAct) -> None:
        state = self.staging_state_of(act)
        if state is None:
            return
        self._drop_staging_state(state.kv, state)

    def retract_req(self, req: Req) -> None:
        state = self.state_of(req.kv)
        if state is None:
            return
        if state.staging:
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def request_finished(self, req: Req) -> None:
        """Give back the buffer and the host copy and unmap the request's logical slots."""
        self.release_record(req.kv)

    def release_record(self, kv: ReqKvInfo) -> None:
        """``request_finished`` by record (a session slot's record has no request)."""
        state = self.state_of(kv)
        if state is None:
            return
        if state.staging:
            self.ack_staging_queue = [a for a in self.ack_staging_queue if a is not state.act]
            if self.write_staging_stream is not None:
                self.write_staging_stream.synchronize()
            self._drop_staging_state(kv, state)
            return
        alloc = self.token_to_kv_pool_allocator
        cap = state.device_buffer_size_now
        if cap:
            buf = state.device_buffer[:cap]
            alloc.free_hisparse_indices(torch.unique(buf[buf > 0]))
        if kv.req_pool_idx is not None and kv.kv_allocated_len:
            rows = self._row_slots(kv, kv.kv_allocated_len).to(alloc.device)
            mapping = alloc.full_to_hisparse_device_index_mapping
            mapped = mapping[rows]
            # What the row maps outside the buffer (a page-size-1 decode slot not mapped yet) is the row's own.
            inside = torch.isin(mapped, state.device_buffer[:cap].to(mapped.device))
            mapping[rows[inside]] = 0
        self._free_host(state)
        self._detach(kv)

    def _free_host(self, state: HiSparseReqState) -> None:
        host = self.mem_pool_host.allocated_host_indices(state)
        if host.numel():
            self.mem_pool_host.free(host)
        state.host_locs.fill_(-1)
        state.host_allocated_len = 0
        state.host_backed_len = 0

    def reset(self) -> None:
        self.ack_staging_queue.clear()
        self._states.clear()

    def stats(self) -> dict[str, int]:
        return {
            "swap_in_tokens": self.swap_in_tokens,
            "buffer_hits": self.buffer_hits,
            "buffer_misses": self.buffer_misses,
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
        }

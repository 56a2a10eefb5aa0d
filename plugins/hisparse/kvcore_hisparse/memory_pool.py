"""The three pools of HiSparse and the mapping that joins them (SGLang's ``hisparse_memory_pool.py``,
``allocator/hisparse.py`` and the host pool's HiSparse mixin).

* the logical pool: ``size * host_to_device_ratio`` slots; request rows hold these ids;
* the device pool: ``size`` slots; a prefill's KV until it is staged, then one buffer
  of ``device_buffer_size`` tokens plus one page per decoding request;
* the host pool: ``size * host_to_device_ratio`` slots holding a full copy of every
  staged token (pinned memory when the device is CUDA).

``full_to_hisparse_device_index_mapping`` maps a logical slot to its device slot (0: none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvcore.pools import MHATokenToKVPool, TokenToKVPoolAllocator
from kvcore.pools.allocator import Lens, split_row_segments, trim_row_segments
from kvcore.pools.views import PoolView

if TYPE_CHECKING:
    from kvcore_hisparse.coordinator import HiSparseReqState

__all__ = ["HiSparseTokenToKVPool", "HiSparseHostPool", "HiSparseTokenToKVPoolAllocator"]


class HiSparseTokenToKVPool(MHATokenToKVPool):
    """Device K/V of ``size`` slots; writes by logical slot go through the logical-to-device map.

    SGLang's ``HiSparseDSATokenToKVPool`` (an MLA pool there; K and V per layer here,
    so kvcore's K/V writer fills it unchanged).  ``get_kv_buffer`` reads by device slot.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str | torch.device) -> None:
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device)
        self.bytes_per_token_layer = 2 * head_num * head_dim * torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = self.bytes_per_token_layer * layer_num
        self.full_to_hisparse_device_index_mapping: torch.Tensor | None = None

    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor) -> None:
        self.full_to_hisparse_device_index_mapping = full_to_hisparse_device_index_mapping

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor) -> torch.Tensor:
        mapping = self.full_to_hisparse_device_index_mapping
        if mapping is None:
            raise RuntimeError("HiSparseTokenToKVPool: no logical-to-device mapping registered")
        return mapping[full_indices.to(device=mapping.device, dtype=torch.int64)]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K/V of logical slots ``loc`` at their device slots (an unmapped slot writes the padding slot 0)."""
        dev = self.translate_loc_from_full_to_hisparse_device(loc).to(self.k_buffer[layer_id].device)
        self.k_buffer[layer_id][dev] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][dev] = cache_v.to(self.dtype)


class HiSparseHostPool:
    """Host K/V (``layer_first``: one K and one V tensor per layer) and its page allocator.

    Pinned when the device pool lives on CUDA, so host-to-device copies can be asynchronous.
    """

    def __init__(self, size: int, page_size: int, device_pool: HiSparseTokenToKVPool) -> None:
        self.size = size
        self.page_size = page_size
        self.layer_num = device_pool.layer_num
        self.dtype = device_pool.dtype
        self.allocator = TokenToKVPoolAllocator(size, page_size, "cpu")
        dev = torch.device(device_pool.device)
        self.pin_memory = dev.type == "cuda"
        shape = (size + page_size, device_pool.head_num, device_pool.head_dim)
        self.k_buffer = [self._zeros(shape) for _ in range(self.layer_num)]
        self.v_buffer = [self._zeros(shape) for _ in range(self.layer_num)]
        self.bytes_per_token_layer = device_pool.bytes_per_token_layer

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.zeros(shape, dtype=self.dtype)
        return t.pin_memory() if self.pin_memory else t

    # ---- allocation (SGLang's HiSparseHostPoolMixin) ----------------------------

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.allocator.alloc(need_size)

    def alloc_page(self, num_pages: int) -> torch.Tensor | None:
        return self.alloc(num_pages * self.page_size)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def _round_up_to_page_size(self, size: int) -> int:
        return -(-size // self.page_size) * self.page_size

    def alloc_paged_token_slots(self, state: HiSparseReqState, start_pos: int, num_tokens: int) -> torch.Tensor:
        """Host slots of positions ``[start_pos, start_pos + num_tokens)``, allocating whole pages past what
        the request holds; RuntimeError (nothing taken) when the host pool is short."""
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64)
        allocated = state.host_allocated_len
        if start_pos > allocated:
            raise ValueError(f"host slots for position {start_pos} requested past the allocated {allocated}")
        end = start_pos + num_tokens
        page_end = self._round_up_to_page_size(end)
        if page_end > allocated:
            locs = self.alloc_page((page_end - allocated) // self.page_size)
            if locs is None:
                raise RuntimeError(
                    f"HiSparse host pool is short: {page_end - allocated} slots for request {state.rid!r}, "
                    f"{self.available_size()} free"
                )
            state.host_locs[allocated:page_end] = locs
            state.host_allocated_len = page_end
        return state.host_locs[start_pos:end]

    def allocated_host_indices(self, state: HiSparseReqState) -> torch.Tensor:
        locs = state.host_locs[: state.host_allocated_len]
        return locs[locs >= 0]

    # ---- data movement -----------------------------------------------------------

    def backup_from_device_all_layer(
        self, device_pool: HiSparseTokenToKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor
    ) -> int:
        """Copy device slots to host slots in every layer; returns the bytes moved."""
        n = int(host_indices.numel())
        if n == 0:
            return 0
        dev_idx = device_indices.to(device=device_pool.k_buffer[0].device, dtype=torch.int64)
        host_idx = host_indices.to(torch.int64)
        for layer in range(self.layer_num):
            for src, dst in ((device_pool.k_buffer[layer], self.k_buffer[layer]),
                             (device_pool.v_buffer[layer], self.v_buffer[layer])):
                # A blocking copy: the CPU index_copy_ reads the gathered bytes at once, and a
                # non_blocking device-to-pinned copy could still be in flight then (stale host KV).
                dst.index_copy_(0, host_idx, src.index_select(0, dev_idx).to("cpu"))
        return n * self.bytes_per_token_layer * self.layer_num

    def load_to_device_per_layer(
        self, device_pool: HiSparseTokenToKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor,
        layer_id: int,
    ) -> int:
        """Copy host slots to device slots in one layer; returns the bytes moved."""
        n = int(host_indices.numel())
        if n == 0:
            return 0
        dev = device_pool.k_buffer[layer_id].device
        dev_idx = device_indices.to(device=dev, dtype=torch.int64)
        host_idx = host_indices.to(torch.int64)
        nb = self.pin_memory
        for src, dst in ((self.k_buffer[layer_id], device_pool.k_buffer[layer_id]),
                         (self.v_buffer[layer_id], device_pool.v_buffer[layer_id])):
            dst.index_copy_(0, dev_idx, src.index_select(0, host_idx).to(dev, non_blocking=nb))
        return n * self.bytes_per_token_layer

    def mem_usage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))


class HiSparseTokenToKVPoolAllocator:
    """SGLang's ``HiSparseTokenToKVPoolAllocator``: a logical and a device allocator joined by a map.

    Prefill (``alloc``, ``alloc_extend``) takes a slot on both sides; decode
    (``alloc_decode``) and the direct-to-host path (``alloc_logical_only``) take
    logical slots only.  ``free`` returns logical slots and whatever device slots
    they still map to.  Unlike SGLang (asserts), a short or bad call changes nothing.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu",
                 host_to_device_ratio: int = 2) -> None:
        if host_to_device_ratio < 1:
            raise ValueError(f"host_to_device_ratio={host_to_device_ratio} must be >= 1")
        self.page_size = page_size
        self.device = device
        self.host_to_device_ratio = host_to_device_ratio
        self._size_full = size * host_to_device_ratio
        self._size_hisparse = size
        self.logical_attn_allocator = TokenToKVPoolAllocator(self._size_full, page_size, device)
        self.hisparse_attn_allocator = TokenToKVPoolAllocator(size, page_size, device)
        # The trailing -1 makes a last_loc of -1 (empty prefix) translate to -1.
        self.full_to_hisparse_device_index_mapping = torch.zeros(
            self._size_full + page_size + 1, dtype=torch.int64, device=device
        )
        self.full_to_hisparse_device_index_mapping[-1] = -1
        self.clear()

    @property
    def size(self) -> int:
        return self._size_full

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_hisparse(self) -> int:
        return self._size_hisparse

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1].fill_(0)

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size())

    def pool_views(self) -> list[PoolView]:
        """The row-indexed pool: ``full`` (logical).  The cache adds ``device`` and ``host``."""
        return [PoolView("full", self.logical_attn_allocator)]

    def translate_loc_from_full_to_hisparse_device(self, full_indices: Any) -> torch.Tensor:
        return self.full_to_hisparse_device_index_mapping[self.logical_attn_allocator.as_slots(full_indices)]

    # ---- alloc -------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` logical slots, each mapped to a fresh device slot; None (nothing taken) if either is short."""
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(f"need_size={need_size} must be >= 0 and a multiple of page_size={self.page_size}")
        if need_size > self.available_size():
            return None
        logical = self.logical_attn_allocator.alloc(need_size)
        hisparse = self.hisparse_attn_allocator.alloc(need_size)
        assert logical is not None and hisparse is not None
        self.full_to_hisparse_device_index_mapping[logical] = hisparse
        return logical

    def alloc_logical_only(self, prefix_lens: Lens, prefix_lens_cpu: Lens, seq_lens: Lens, seq_lens_cpu: Lens,
                           last_loc: Lens, extend_num_tokens: int) -> torch.Tensor | None:
        """Logical slots only: the direct-to-host path, where the KV arrives in host memory."""
        return self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )

    def alloc_extend(self, prefix_lens: Lens, prefix_lens_cpu: Lens, seq_lens: Lens, seq_lens_cpu: Lens,
                     last_loc: Lens, extend_num_tokens: int) -> torch.Tensor | None:
        p = self.page_size
        if p == 1:
            return self.alloc(extend_num_tokens)
        logical_alloc, device_alloc = self.logical_attn_allocator, self.hisparse_attn_allocator
        n = logical_alloc.num_new_pages_extend(prefix_lens_cpu, seq_lens_cpu)
        if n > logical_alloc.available_size() // p:
            return None
        last = torch.as_tensor(last_loc, dtype=torch.int64, device=self.device).reshape(-1)
        hisparse_last = self.full_to_hisparse_device_index_mapping[last]
        pre_cpu = torch.as_tensor(prefix_lens_cpu, dtype=torch.int64).reshape(-1)
        seq_cpu = torch.as_tensor(seq_lens_cpu, dtype=torch.int64).reshape(-1)
        # A row whose last partial page has no device side (decode tokens take logical slots only)
        # continues on a fresh device page: the device side starts at the page boundary below.
        orphan = ((pre_cpu % p != 0) & (hisparse_last.cpu() <= 0)) if bool((pre_cpu % p != 0).any()) else None
        if orphan is None or not bool(orphan.any()):
            if n > device_alloc.available_size() // p:
                return None
            logical = logical_alloc.alloc_extend(
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last, extend_num_tokens, n
            )
            hisparse = device_alloc.alloc_extend(
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, hisparse_last, extend_num_tokens, n
            )
            assert logical is not None and hisparse is not None
            self.full_to_hisparse_device_index_mapping[logical] = hisparse
            return logical
        dev_pre = torch.where(orphan, pre_cpu // p * p, pre_cpu)
        n_dev = device_alloc.num_new_pages_extend(dev_pre, seq_cpu)
        if n_dev > device_alloc.available_size() // p:
            return None
        dev_last = torch.where(orphan.to(hisparse_last.device), torch.full_like(hisparse_last, -1), hisparse_last)
        dev_ext = int((seq_cpu - dev_pre).sum())
        logical = logical_alloc.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last, extend_num_tokens, n
        )
        hisparse = device_alloc.alloc_extend(dev_pre, dev_pre, seq_cpu, seq_cpu, dev_last, dev_ext, n_dev)
        assert logical is not None and hisparse is not None
        # Drop each orphan row's head: the positions below its prefix on the fresh page stay unmapped.
        drop = pre_cpu - dev_pre
        lens = seq_cpu - dev_pre
        req = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        j = torch.arange(dev_ext) - (torch.cumsum(lens, 0) - lens)[req]
        keep = (j >= drop[req]).to(hisparse.device)
        self.full_to_hisparse_device_index_mapping[logical] = hisparse[keep]
        return logical

    def alloc_decode(self, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> torch.Tensor | None:
        """Logical slots only: the coordinator maps each new token to its request's buffer."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int) -> torch.Tensor | None:
        """A request's device buffer of ``need_size`` slots, reusing the device slots its logical slots map to.

        Surplus device slots go back; a shortfall is taken from the device pool (after claiming the
        rest of a partial page).  The logical slots are unmapped: the buffer is addressed by the
        coordinator only.  None, with nothing changed, when the device pool is short.
        """
        p = self.page_size
        if need_size % p:
            raise ValueError(f"need_size={need_size} is not a multiple of page_size={p}")
        mapping = self.full_to_hisparse_device_index_mapping
        allocated_indices = allocated_indices.to(device=mapping.device, dtype=torch.int64)
        hisparse = mapping[allocated_indices]
        hisparse = hisparse[hisparse > 0]
        if hisparse.numel() >= need_size:
            buffer = hisparse[:need_size].clone()
            mapping[allocated_indices] = 0
            self.free_hisparse_indices(hisparse[need_size:])
            return buffer
        residual = hisparse.numel() % p
        if residual:
            last = int(hisparse[-1])
            hisparse = torch.cat([hisparse, torch.arange(last + 1, last + p - residual + 1, device=hisparse.device)])
        need_extra = need_size - hisparse.numel()
        if need_extra > self.hisparse_attn_allocator.available_size():
            return None
        extra = self.hisparse_attn_allocator.alloc(need_extra)
        assert extra is not None
        mapping[allocated_indices] = 0
        return torch.cat([hisparse, extra.to(hisparse.device)])

    # ---- free --------------------------------------------------------------

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        self.hisparse_attn_allocator.free(buffer_indices[buffer_indices > 0])

    def free_hisparse(self, free_indices: Any) -> None:
        """Free the device slots ``free_indices`` map to, and unmap them."""
        slots = self.logical_attn_allocator.as_slots(free_indices)
        if slots.numel() == 0:
            return
        hisparse = self.full_to_hisparse_device_index_mapping[slots]
        self.free_hisparse_indices(hisparse)
        self.full_to_hisparse_device_index_mapping[slots] = 0

    def _check_device_side(self, slots: torch.Tensor) -> None:
        hisparse = self.full_to_hisparse_device_index_mapping[slots]
        hisparse = hisparse[hisparse > 0]
        if hisparse.numel():
            self.hisparse_attn_allocator.check_free(hisparse)

    def free(self, free_index: Any) -> None:
        """Logical slots and the device slots they still map to; checked on both sides before anything moves."""
        logical = self.logical_attn_allocator
        slots = logical.as_slots(free_index)
        if slots.numel() == 0:
            return
        self._check_device_side(slots)
        logical.free(slots)
        self.free_hisparse(slots)

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None:
        """Free ascending ``(slots, start_pos)`` pieces of one row: logical slots in SGLang's page order,
        and the device slots they map to."""
        dead, alive = split_row_segments(segments, dead_lo=swa_dead_lo, dead_hi=swa_evicted_seqlen)
        if dead:
            raise ValueError(
                f"row positions in [{swa_dead_lo}, {swa_evicted_seqlen}) were window-evicted, "
                f"but {type(self).__name__} has no window pool"
            )
        logical = self.logical_attn_allocator
        alive = [(logical.as_slots(s), st) for s, st in alive]
        pieces = trim_row_segments(alive, self.page_size)
        if not pieces:
            return
        # The device side by page: a page shared by two pieces is one page there too.
        everything = torch.cat([s for s, _ in alive])
        self._check_device_side(everything)
        logical.free_segments(pieces)
        self.free_hisparse(everything)

    # No deferred frees: a free must clear the mapping at once (as in SGLang).
    def free_group_begin(self) -> None:
        return

    def free_group_end(self) -> None:
        return

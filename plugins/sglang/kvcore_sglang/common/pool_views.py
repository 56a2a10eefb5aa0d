"""kvcore's pool protocols over SGLang's pool objects (the allocators, ``ReqToTokenPool``, the Mamba pools).

Version-neutral: SGLang 0.5.19 and 0.5.23 keep these pools' API (``free_pages`` /
``release_pages``, ``free`` / ``free_segment(s)`` / ``free_group_*``, ``free_full`` /
``free_swa`` and the full-to-window map, ``common.free_kv_row_segments``, ``MambaPool.copy_from``
/ ``clear_slots``, ``HybridReqToTokenPool.free_mamba_cache`` / ``set_mamba_ping_pong_slot``).

The views hold no state of their own: every alloc and free is SGLang's own call, so the free
lists the model runner's kernels read are the ones kvcore's backend changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from sglang.srt.mem_cache.common import free_kv_row_segments  # type: ignore[import-not-found,unused-ignore]

from kvcore.pools.array_ops import ops_for
from kvcore.pools.claims import SlotOwnership
from kvcore.pools.mamba_pool import MambaRequestTable, mamba_state_of
from kvcore.pools.views import PoolView

__all__ = [
    "AllocatorView",
    "HybridReqToTokenPoolView",
    "MambaStatePoolView",
    "ReqToTokenPoolView",
    "SWAAllocatorView",
]


def free_page_ids(allocator: Any) -> torch.Tensor:
    """SGLang's free pages in hand-out order: 0.5.23 answers ``get_all_free_pages()`` (its paged allocator
    keeps no ``release_pages``); 0.5.19 keeps ``free_pages``, then ``release_pages``."""
    get = getattr(allocator, "get_all_free_pages", None)
    return get() if get is not None else torch.cat((allocator.free_pages, allocator.release_pages))


class _SGLangPages:
    """What kvcore's :class:`~kvcore.pools.claims.SlotOwnership` reads of a pool's pages, over SGLang's allocator.

    SGLang keeps its free pages as a list (``free_pages``, then ``release_pages``), not as
    a mask: the mask is built from that list each time a claim is checked (strict only).
    """

    def __init__(self, allocator: Any, ops: Any):
        self.sglang = allocator
        self.page_size = int(allocator.page_size)
        self.size = int(allocator.size) // self.page_size * self.page_size
        self.ops = ops

    @property
    def free(self) -> Any:
        """Per page id (0 is padding): non-zero where SGLang's allocator holds the page free."""
        a = self.sglang
        mask = torch.zeros(self.size // self.page_size + 1, dtype=torch.int32, device=a.free_pages.device)
        mask[free_page_ids(a).to(torch.int64)] = 1
        return self.ops.view(mask)

    def page_ids(self, s: Any) -> Any:
        return s // self.page_size


class _TreeClaims:
    """kvcore's strict slot checks over one of SGLang's pools (``claims``: which slots tree nodes own).

    A free refuses, before SGLang frees anything, a slot a tree node still owns (use
    after free).  With ``strict=False`` nothing is ever claimed and the check finds nothing.
    """

    sglang: Any
    claims: SlotOwnership
    ops: Any

    def unclaimed(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` back, once no tree node owns any of them (else the refusal names the owner)."""
        if slots.numel():
            self.claims.check_unclaimed(self.ops.view(slots.reshape(-1).to(torch.int64)))
        return slots

    # -- ownership by the tree (strict): full-side slot ids
    def check_claimable(self, slots: torch.Tensor, *, commit: bool = False, what: str = "insert") -> None:
        self.claims.check_claimable(self.ops.view(slots.reshape(-1).to(torch.int64)), commit=commit, what=what)

    def claim(self, slots: torch.Tensor, *, checked: bool = True) -> None:
        if checked:
            self.check_claimable(slots, commit=True)
        else:
            self.claims.claim_unchecked(self.ops.view(slots.reshape(-1).to(torch.int64)))

    def disown(self, slots: torch.Tensor) -> None:
        self.claims.disown(self.ops.view(slots.reshape(-1).to(torch.int64)))

    def claimed_slots(self) -> torch.Tensor:
        claimed = self.claims.claimed()
        return torch.empty(0, dtype=torch.int64) if claimed is None else self.ops.tensor(claimed)


class _AllocatorCalls(_TreeClaims):
    """The calls a kvcore backend makes on a token allocator, each answered by SGLang's own (``self.sglang``).

    ``claims`` is the full pool's ownership record.
    """

    def available_size(self) -> int:
        return int(self.sglang.available_size())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.sglang.alloc(need_size)

    def alloc_extend(self, *args: Any) -> torch.Tensor | None:
        return self.sglang.alloc_extend(*args)

    def alloc_decode(self, *args: Any) -> torch.Tensor | None:
        return self.sglang.alloc_decode(*args)

    # Set within frees_as_segments().
    _segment_frees = False

    @contextlib.contextmanager
    def frees_as_segments(self) -> Iterator[None]:
        """Within it, ``free`` is SGLang's ``free_segment`` (the pages back in the order given, not sorted).

        SGLang 0.5.23's unified tree frees each evicted node so, where 0.5.19's trees (and kvcore's,
        which follow them) call ``free``; the free-list order, and so every later allocation, differs.
        """
        self._segment_frees = True
        try:
            yield
        finally:
            self._segment_frees = False

    def free(self, free_index: torch.Tensor) -> None:
        if self._segment_frees:
            self.sglang.free_segment(self.unclaimed(free_index), start_pos=0)
        else:
            self.sglang.free(self.unclaimed(free_index))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int = 0) -> None:
        self.sglang.free_segment(self.unclaimed(free_index), start_pos=start_pos)

    def free_segments(self, segments: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.sglang.free_segments([(self.unclaimed(f), start) for f, start in segments])

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None:
        # SGLang's own row release: split at the window floor, then free_full / free_segments.
        segments = [(self.unclaimed(f), start) for f, start in segments]
        free_kv_row_segments(self.sglang, segments, swa_evicted_seqlen=swa_evicted_seqlen)

    def free_group_begin(self) -> None:
        self.sglang.free_group_begin()

    def free_group_end(self) -> None:
        self.sglang.free_group_end()


class AllocatorView(_AllocatorCalls):
    """kvcore's ``TokenAllocator`` over one of SGLang's single-pool allocators.

    ``TokenToKVPoolAllocator`` (page 1: its free list holds slots) and
    ``PagedTokenToKVPoolAllocator`` (its free list holds pages).  Frees go to
    SGLang's own ``free`` / ``free_segment(s)`` and ``free_kv_row_segments``, so the
    free-list order is SGLang's.
    """

    def __init__(self, allocator: Any):
        self.sglang = allocator
        self.page_size = int(allocator.page_size)
        self.device = allocator.device
        self.num_pages = int(allocator.size) // self.page_size
        self.ops = ops_for(self.device)
        self.claims = SlotOwnership(cast(Any, _SGLangPages(allocator, self.ops)), self.device)

    def free_slots(self) -> torch.Tensor:
        """Every free slot, in the order SGLang hands them out (``free_pages``, then ``release_pages``)."""
        a = self.sglang
        ids = free_page_ids(a).to(torch.int64).cpu()
        if self.page_size == 1:
            return ids
        return (ids[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def pool_views(self) -> list[PoolView]:
        return [PoolView("full", self)]


class SWAAllocatorView(_AllocatorCalls):
    """kvcore's ``SWATokenToKVPoolAllocator`` over SGLang's (a full and a window pool joined by a map).

    kvcore's (full, swa) tree calls what SGLang's hybrid-SWA trees call (``free``,
    ``free_full``, ``free_swa``, ``free_kv_row_segments``, the full-to-window map
    it re-points when it heals a locked tombstone), all answered by SGLang's own
    allocator, so both free lists and the map are SGLang's.
    """

    def __init__(self, allocator: Any):
        self.sglang = allocator
        self.page_size = int(allocator.page_size)
        self.device = allocator.device
        self.full = AllocatorView(allocator.full_attn_allocator)
        self.swa = AllocatorView(allocator.swa_attn_allocator)
        # The tree owns full-side slots: their claims are the full pool's.
        self.ops = self.full.ops
        self.claims = self.full.claims

    @property
    def size_full(self) -> int:
        return int(self.sglang.size_full)

    @property
    def size_swa(self) -> int:
        return int(self.sglang.size_swa)

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        return self.sglang.full_to_swa_index_mapping

    def full_available_size(self) -> int:
        return int(self.sglang.full_available_size())

    def swa_available_size(self) -> int:
        return int(self.sglang.swa_available_size())

    def full_free_slots(self) -> torch.Tensor:
        return self.full.free_slots()

    def swa_free_slots(self) -> torch.Tensor:
        return self.swa.free_slots()

    def translate_loc_from_full_to_swa(self, indices: Any) -> torch.Tensor:
        return self.sglang.full_to_swa_index_mapping[torch.as_tensor(indices).to(torch.int64)]

    def free_full(self, free_index: torch.Tensor) -> None:
        self.sglang.free_full(self.unclaimed(free_index))

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.sglang.free_swa(free_index)

    def pool_views(self) -> list[PoolView]:
        return [
            PoolView("full", self.full),
            PoolView("swa", self.swa, translate=self.translate_loc_from_full_to_swa, windowed=True),
        ]


class ReqToTokenPoolView:
    """kvcore's req_to_token pool protocol over SGLang's ``ReqToTokenPool`` (rows 1..size; row 0 is padding)."""

    def __init__(self, pool: Any):
        self.sglang = pool

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.sglang.req_to_token

    @property
    def max_context_len(self) -> int:
        return int(self.sglang.max_context_len)

    @property
    def num_rows(self) -> int:
        return int(self.sglang.size)

    @property
    def device(self) -> Any:
        return self.sglang.device

    def available_size(self) -> int:
        return int(self.sglang.available_size())

    def free_rows(self) -> list[int]:
        return list(self.sglang.free_slots)

    def holds(self, kv: Any) -> bool:
        """Whether the record holds a row this pool handed out (SGLang keeps no holder per row: in range, not free)."""
        row = kv.req_pool_idx
        return row is not None and 1 <= int(row) <= int(self.sglang.size) and int(row) not in self.sglang.free_slots


class _SGLangStateSlots:
    """What kvcore's :class:`~kvcore.pools.claims.SlotOwnership` reads of SGLang's ``MambaSlotAllocator``."""

    page_size = 1

    def __init__(self, allocator: Any, ops: Any):
        self.sglang = allocator
        self.size = int(allocator.size)
        self.ops = ops

    @property
    def free(self) -> Any:
        """Per slot id (0 is padding): non-zero where SGLang's allocator holds the slot free."""
        a = self.sglang
        mask = torch.zeros(self.size + 1, dtype=torch.int32, device=a.free_slots.device)
        mask[a.free_slots.to(torch.int64)] = 1
        return self.ops.view(mask)

    def page_ids(self, s: Any) -> Any:
        return s


class MambaStatePoolView(_TreeClaims):
    """kvcore's state pool and its slot allocator over SGLang's ``MambaPool`` and ``MambaSlotAllocator``.

    kvcore-mamba takes and gives back state slots with SGLang's own ``alloc`` / ``free``
    (so the free list is SGLang's, in its order) and copies and zeroes states with
    SGLang's ``copy_from`` / ``clear_slots`` on the pool the model's Mamba layers read.
    One object answers both of kvcore's roles, ``mamba_pool`` and ``mamba_allocator``.
    """

    page_size = 1

    def __init__(self, r2t: Any):
        self.sglang = r2t.mamba_allocator
        self.states = r2t.mamba_pool
        self.device = self.sglang.device
        self.size = self.num_pages = int(self.sglang.size)
        self.ops = ops_for(self.device)
        self.claims = SlotOwnership(cast(Any, _SGLangStateSlots(self.sglang, self.ops)), self.device)

    @property
    def mamba_cache(self) -> Any:
        """SGLang's state tensors (``conv`` list, ``temporal``), as kvcore's retraction backups read them."""
        return self.states.mamba_cache

    def available_size(self) -> int:
        return int(self.sglang.available_size())

    def free_slots(self) -> torch.Tensor:
        return self.sglang.free_slots.to(torch.int64).cpu()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.sglang.alloc(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        self.sglang.free(self.unclaimed(free_index.reshape(-1)))

    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> None:
        self.states.copy_from(src_indices.reshape(-1), dst_indices.reshape(-1))

    def clear_slots(self, indices: torch.Tensor) -> None:
        self.states.clear_slots(indices.reshape(-1))


class HybridReqToTokenPoolView(ReqToTokenPoolView, MambaRequestTable):
    """kvcore's request table with state slots over SGLang's ``HybridReqToTokenPool``.

    SGLang's own ``alloc`` (called by its ``alloc_req_slots``) gives a request its row and
    state slot (and, extra-buffer strategy, its two ping-pong tracking slots), so kvcore's
    admission hooks (``evict_states``, ``prepare_state``) are never called here.  SGLang's
    scheduler sets the tracking fields and its kernels write the snapshots
    (``tracks_states``).  ``free_mamba_cache`` and ``set_ping_pong_slot`` are SGLang's, which
    also keep its device-side maps.
    """

    tracks_states = True

    def __init__(self, pool: Any):
        super().__init__(pool)
        self.mamba_pool = self.mamba_allocator = MambaStatePoolView(pool)
        self.extra_buffer = bool(pool.enable_mamba_extra_buffer)
        self.evict_states = None
        self.prepare_state = None

    def free_mamba_cache(self, kv: Any, keep: int | None = None) -> None:
        state = mamba_state_of(kv)
        if state is not None:
            self.mamba_allocator.unclaimed(state.slots())
        self.sglang.free_mamba_cache(_RecordHolder(kv.sglang), mamba_ping_pong_track_buffer_to_keep=keep)

    def set_ping_pong_slot(self, kv: Any, idx: int, slot: torch.Tensor) -> None:
        self.sglang.set_mamba_ping_pong_slot(_RecordHolder(kv.sglang), idx, slot)


class _RecordHolder:
    """What SGLang's pool methods read of a ``Req``: its ``kv`` record."""

    __slots__ = ("kv",)

    def __init__(self, kv: Any):
        self.kv = kv

"""SGLang 0.5.19's tree-cache contract, met by kvcore backends built on SGLang's own pools.

Everything that names an SGLang 0.5.19 class or field lives here; another SGLang
version gets a module of its own beside this one.

Three layers:

* pool views (:class:`AllocatorView`, :class:`ReqToTokenPoolView`): kvcore's
  pool protocol over SGLang's allocator and ``ReqToTokenPool`` objects.  They hold
  no state of their own: every alloc and free is SGLang's own call, so the free
  lists the model runner's kernels read are the ones kvcore's backend changes.
* record views (:class:`KvRecordView`, :class:`ReqView`): SGLang's ``Req`` and
  ``ReqKvInfo`` as kvcore's release and tree code reads them (``is_held`` for
  ``holds_kv``, the committed length SGLang hands over, ...), writing through.
* :class:`KvcoreTreeCache`: SGLang's ``BasePrefixCache`` over one kvcore backend,
  translating SGLang's params and results, lock results and KV events.
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref
from array import array
from collections.abc import Sequence
from typing import Any, cast

import torch
from sglang.srt.disaggregation.kv_events import (  # type: ignore[import-not-found,unused-ignore]
    BlockRemoved,
    BlockStored,
    BlockStoredMetadata,
    BlockStoredWithMetadata,
    StorageMedium,
)
from sglang.srt.environ import envs  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.allocator.paged import (  # type: ignore[import-not-found,unused-ignore]
    PagedTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found,unused-ignore]
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.common import (  # type: ignore[import-not-found,unused-ignore]
    free_kv_row_segments,
    free_swa_out_of_window_slots,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.unified_cache.component_type import (  # type: ignore[import-not-found,unused-ignore]
    ComponentType,
)
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.runtime_context import mamba_cache_chunk_size  # type: ignore[import-not-found,unused-ignore]

import kvcore
from kvcore.cache import LockResult
from kvcore.config import CacheInitParams
from kvcore.factory import attach_lifecycle
from kvcore.keys import CheckedIds
from kvcore.plugins import get_backend, get_plugin_manager
from kvcore.pools.array_ops import ops_for
from kvcore.pools.claims import SlotOwnership
from kvcore.pools.mamba_pool import COMPONENT as MAMBA
from kvcore.pools.mamba_pool import MambaReqState, MambaRequestTable, mamba_state_of
from kvcore.pools.views import PoolView
from kvcore.record import ReqKvInfo
from kvcore.tree.events import AllPagesCleared, PageRemoved, PageStored
from kvcore_sglang.config import Target

__all__ = [
    "AllocatorView",
    "KvRecordView",
    "MambaStatePoolView",
    "MambaStateView",
    "HybridReqToTokenPoolView",
    "KvcoreMambaTreeCache",
    "KvcoreSWATreeCache",
    "KvcoreTreeCache",
    "KvcoreUnifiedMambaTreeCache",
    "KvcoreUnifiedSWATreeCache",
    "KvcoreUnifiedTreeCache",
    "ReqToTokenPoolView",
    "ReqView",
    "SWAAllocatorView",
    "SWAReqView",
    "UnifiedSWAReqView",
    "UnsupportedContext",
    "build_tree_cache",
    "owner_of",
    "strict_slots",
]

SGLANG_VERSION = "0.5.19"


class UnsupportedContext(kvcore.KvcoreError, ValueError):
    """SGLang asked a kvcore name for a tree cache it cannot serve (the message says what to change)."""


# ---------------------------------------------------------------------------- pool views


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
        mask[torch.cat((a.free_pages, a.release_pages)).to(torch.int64)] = 1
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

    def _unclaimed(self, slots: torch.Tensor) -> torch.Tensor:
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

    def free(self, free_index: torch.Tensor) -> None:
        self.sglang.free(self._unclaimed(free_index))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int = 0) -> None:
        self.sglang.free_segment(self._unclaimed(free_index), start_pos=start_pos)

    def free_segments(self, segments: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.sglang.free_segments([(self._unclaimed(f), start) for f, start in segments])

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None:
        # SGLang's own row release: split at the window floor, then free_full / free_segments.
        segments = [(self._unclaimed(f), start) for f, start in segments]
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
        ids = torch.cat((a.free_pages, a.release_pages)).to(torch.int64).cpu()
        if self.page_size == 1:
            return ids
        return (ids[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def pool_views(self) -> list[PoolView]:
        return [PoolView("full", self)]


class SWAAllocatorView(_AllocatorCalls):
    """kvcore's ``SWATokenToKVPoolAllocator`` over SGLang's (a full and a window pool joined by a map).

    kvcore-swa's tree calls what SGLang's ``SWARadixCache`` calls (``free``,
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
        self.sglang.free_full(self._unclaimed(free_index))

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
        self.sglang.free(self._unclaimed(free_index.reshape(-1)))

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
            self.mamba_allocator._unclaimed(state.slots())
        self.sglang.free_mamba_cache(_RecordHolder(kv.sglang), mamba_ping_pong_track_buffer_to_keep=keep)

    def set_ping_pong_slot(self, kv: Any, idx: int, slot: torch.Tensor) -> None:
        self.sglang.set_mamba_ping_pong_slot(_RecordHolder(kv.sglang), idx, slot)


class _RecordHolder:
    """What SGLang's pool methods read of a ``Req``: its ``kv`` record."""

    __slots__ = ("kv",)

    def __init__(self, kv: Any):
        self.kv = kv


# ---------------------------------------------------------------------------- record views


class KvRecordView:
    """SGLang's ``ReqKvInfo`` under kvcore's names, writing through.

    ``committed`` overrides ``kv_committed_len`` for one call: SGLang hands
    ``cache_finished_req`` the length to cache (``kv_len_to_handle``, which
    ``strip_thinking_cache`` shortens) and caches ``len(fill_ids)`` in
    ``cache_unfinished_req``; kvcore's backends read it from the record.
    ``resume`` (kvcore's resume point, which SGLang's record has no field for) lives
    in ``resumes``, the cache's table keyed by SGLang's ``Req`` (``owner``).
    """

    __slots__ = ("sglang", "_committed", "_resumes", "_owner")

    def __init__(self, kv: Any, committed: int | None = None, resumes: weakref.WeakKeyDictionary | None = None,
                 owner: Any = None):
        self.sglang = kv
        self._committed = committed
        self._resumes = resumes
        self._owner = owner

    @property
    def req_pool_idx(self) -> int | None:
        return self.sglang.req_pool_idx

    @req_pool_idx.setter
    def req_pool_idx(self, value: int | None) -> None:
        self.sglang.req_pool_idx = value

    @property
    def cache_protected_len(self) -> int:
        return int(self.sglang.cache_protected_len)

    @cache_protected_len.setter
    def cache_protected_len(self, value: int) -> None:
        self.sglang.cache_protected_len = value

    @property
    def kv_committed_len(self) -> int:
        return int(self.sglang.kv_committed_len) if self._committed is None else self._committed

    @property
    def kv_allocated_len(self) -> int:
        return int(self.sglang.kv_allocated_len)

    @property
    def swa_evict_floor(self) -> int:
        return int(self.sglang.swa_evict_floor)

    @property
    def swa_evicted_seqlen(self) -> int:
        return int(self.sglang.swa_evicted_seqlen)

    @swa_evicted_seqlen.setter
    def swa_evicted_seqlen(self, value: int) -> None:
        self.sglang.swa_evicted_seqlen = value

    @property
    def resume(self) -> Any:
        """Where the request's next chunk may be inserted from (None: the whole-prefix path)."""
        return None if self._resumes is None else self._resumes.get(self._owner)

    @resume.setter
    def resume(self, value: Any) -> None:
        if self._resumes is None:
            return
        if value is None:
            self._resumes.pop(self._owner, None)
        else:
            self._resumes[self._owner] = value

    def swa_dead_lo(self, page_size: int) -> int:
        return int(self.sglang.swa_dead_lo(page_size))

    @property
    def components(self) -> dict[str, Any]:
        """kvcore's per-backend parts of the record: SGLang's record holds the Mamba fields of every request."""
        return {MAMBA: MambaStateView(self.sglang)}

    # kvcore's one check of a record's lengths (BasePrefixCache.check_req), on SGLang's record.
    check_fields = ReqKvInfo.check_fields

    @property
    def is_held(self) -> bool:
        return bool(self.sglang.holds_kv)

    @property
    def is_released(self) -> bool:
        return bool(self.sglang.is_kv_released)

    def mark_released(self) -> None:
        self.sglang.mark_kv_released()


def _record_field(name: str) -> Any:
    """A field of SGLang's ``ReqKvInfo`` under the same name, written through."""
    return property(lambda self: getattr(self.sglang, name), lambda self, value: setattr(self.sglang, name, value),
                    doc=f"SGLang's ``ReqKvInfo.{name}``")


#: A field of kvcore's record that SGLang's does not keep: reads None, writes are dropped.
_NOT_KEPT: Any = property(lambda self: None, lambda self, value: None)


class MambaStateView:
    """The Mamba fields of SGLang's ``ReqKvInfo`` as kvcore's :class:`~kvcore.pools.mamba_pool.MambaReqState`.

    The names are SGLang's (kvcore kept them), written through.  Three of kvcore's fields
    have no SGLang counterpart on the record: ``mamba_branching_seqlen`` lives on the view
    only (SGLang's ``Req`` takes it from the ``MatchResult``); ``mamba_tracked_len`` (kvcore's
    replay of the scheduler's tracking; SGLang's scheduler tracks itself) and ``cow_node``
    (kvcore's own admission; SGLang copies from ``mamba_cow_src_index`` in the forward) are
    not kept.
    """

    __slots__ = ("sglang", "mamba_branching_seqlen")

    mamba_pool_idx = _record_field("mamba_pool_idx")
    mamba_cow_src_index = _record_field("mamba_cow_src_index")
    mamba_needs_clear = _record_field("mamba_needs_clear")
    mamba_ping_pong_track_buffer = _record_field("mamba_ping_pong_track_buffer")
    mamba_next_track_idx = _record_field("mamba_next_track_idx")
    mamba_last_track_idx = _record_field("mamba_last_track_idx")
    mamba_last_track_seqlen = _record_field("mamba_last_track_seqlen")
    mamba_tracked_len = _NOT_KEPT
    cow_node = _NOT_KEPT

    def __init__(self, kv: Any):
        self.sglang = kv
        self.mamba_branching_seqlen: int | None = None

    @property
    def holds_mamba(self) -> bool:
        return bool(self.sglang.holds_mamba)

    slots = MambaReqState.slots
    clear_tracking = MambaReqState.clear_tracking


def namespace(extra_key: str | None, cache_salt: str | None) -> Any:
    """kvcore's ``extra_key`` for SGLang's pair: keys differing in either never share a prefix (SGLang's child_key)."""
    return extra_key if cache_salt is None else (extra_key, cache_salt)


class MatchedIds:
    """The list kvcore's match made of a request's token ids, and the SGLang arrays it was made from.

    SGLang's ``Req.init_next_round_input`` matches ``full_untruncated_fill_ids`` (capped by
    the key's ``limit``), and kvcore's trees read that key as a list: every prompt id becomes
    an ``int`` object once.  The request's later cache calls insert the same prompt ids
    again, chunk by chunk; they take them from this list (a slice: no conversion, and the
    tree's keys share these ``int`` objects) instead of converting SGLang's array again.

    Taken on trust, as SGLang's own path and kvcore's resumed insert take it: the prompt of a
    request is not rewritten in place while it runs (SGLang rebuilds ``full_untruncated_fill_ids``
    when it changes more than its tail, and an abort gives ``origin_input_ids`` a new array).
    So the list counts only while the request still holds the very arrays it was made from,
    and only over the prompt (``origin_input_ids``): outputs come from SGLang's arrays.
    """

    __slots__ = ("req", "full", "origin", "ids")

    def __init__(self, req: Any, full: Any, ids: list[int]):
        self.req = weakref.ref(req)
        self.full = full
        self.origin = req.origin_input_ids
        self.ids = ids

    def stands_for(self, req: Any) -> bool:
        """Whether the list still stands for ``req``'s prompt: made for it, from the arrays it holds now."""
        owner: Any = self.req()
        return owner is req and self.full is req.full_untruncated_fill_ids and self.origin is req.origin_input_ids

    def prompt_len(self) -> int:
        """How many of the first ids the list covers (its length, at most the prompt's)."""
        return min(len(self.ids), len(self.origin))


class RequestTables:
    """What a kvcore cache keeps per SGLang ``Req`` that SGLang's ``Req`` has no field for (weakly keyed).

    ``matched``: the latest match's :class:`MatchedIds` (one, whatever request it was);
    ``ids``: those of a request in chunked prefill, kept from chunk to chunk until it finishes.
    """

    __slots__ = ("locks", "resumes", "ids", "matched")

    def __init__(self) -> None:
        self.locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.resumes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.matched: MatchedIds | None = None

    def known_ids(self, req: Any, *, keep: bool | None = None) -> tuple[list[int], int] | None:
        """``req``'s prompt ids as its match listed them and how many count (None: no such list holds).

        ``keep``: True keeps them for the request's next call (a chunk of a chunked prefill),
        False drops them (its last call), None leaves the table as it is.
        """
        entry = self.ids.get(req)
        if entry is None or not entry.stands_for(req):
            matched = self.matched
            entry = matched if matched is not None and matched.stands_for(req) else None
        if keep:
            if entry is not None:
                self.ids[req] = entry
        elif keep is not None:
            self.ids.pop(req, None)
        return None if entry is None else (entry.ids, entry.prompt_len())


class FillIds:
    """The token ids one cache call hands kvcore: the first ``end`` of SGLang's arrays ``parts`` joined.

    Read as lists only over the range asked (``slice``), never joined or copied whole: a
    resumed chunk costs its own length, not the prompt's.  The first ``known_len`` ids come
    from ``known`` (:class:`MatchedIds`: the list the request's match made, of a key it
    validated), the rest from the arrays (``tolist()`` in C).  Both are valid ids once an
    array passed its sign test, so a slice is a :class:`~kvcore.keys.CheckedIds` that
    kvcore's insert does not scan again; one with a bad id is a plain list, which kvcore
    checks and refuses, naming it.
    """

    __slots__ = ("parts", "end", "known", "known_len")

    def __init__(self, parts: tuple, end: int, known: tuple[list[int], int] | None = None):
        self.parts = parts
        self.end = min(end, sum(len(p) for p in parts))
        self.known: list[int] | None = None
        self.known_len = 0
        if known is not None:
            self.known, self.known_len = known

    def __len__(self) -> int:
        return self.end

    def slice(self, start: int, end: int) -> list[int]:
        """``ids[start:end]`` (clipped to ``end``) as a new list."""
        end = min(end, self.end)
        if start >= end:
            return []
        n = self.known_len
        if start < n:
            ids = CheckedIds(cast(list, self.known)[start:min(end, n)])  # known_len > 0: a list is known
            start = n
        else:
            ids = CheckedIds()
        valid = True
        offset = 0
        for part in self.parts:
            lo, hi = max(start - offset, 0), min(end - offset, len(part))
            if lo < hi:
                piece = part[lo:hi]
                if type(piece) is array:
                    key = kvcore.RadixKey(piece)  # its sign test, in C; token_ids: tolist()
                    valid = valid and key.validated
                    ids += key.token_ids
                else:
                    valid = False
                    ids += piece
            offset += len(part)
            if offset >= end:
                break
        return ids if valid else list(ids)


#: No token ids (a ChunkCache call caches none; a match's view inserts none).
NO_IDS = FillIds((), 0)


def fill_len(req: Any) -> int:
    """``len(req.get_fill_ids())`` without its copy (0.5.19: ``full_untruncated_fill_ids[:extend_range.end]``)."""
    return min(len(req.full_untruncated_fill_ids), req.extend_range.end)


class ReqView:
    """SGLang's ``Req`` as kvcore's tree code reads it, writing ``last_node`` and ``prefix_indices`` through.

    ``fill_ids`` are the tokens SGLang caches in this call (:class:`FillIds`), as a list made
    on first use: a resumed chunk reads only its own part (``fill_slice``).  kvcore keeps the
    lock and the resume point of a request in the cache's tables (``tables``), not on SGLang's ``Req``.
    """

    __slots__ = ("sglang", "kv", "_fill", "_fill_list", "_locks")

    def __init__(self, req: Any, fill_ids: FillIds, committed: int | None, tables: RequestTables):
        self.sglang = req
        self.kv = KvRecordView(req.kv, committed, tables.resumes, req)
        self._fill = fill_ids
        self._fill_list: list[int] | None = None
        self._locks = tables.locks

    @property
    def fill_ids(self) -> list[int]:
        if self._fill_list is None:
            self._fill_list = self._fill.slice(0, len(self._fill))
        return self._fill_list

    @property
    def rid(self) -> str:
        return self.sglang.rid

    @property
    def seqlen(self) -> int:
        return int(self.sglang.seqlen)

    def fill_slice(self, start: int, end: int) -> list[int]:
        if self._fill_list is not None:
            return self._fill_list[start:end]
        return self._fill.slice(start, end)

    @property
    def extra_key(self) -> Any:
        return namespace(self.sglang.extra_key, self.sglang.cache_salt)

    @property
    def priority(self) -> int:
        return int(self.sglang.priority or 0)

    @property
    def last_node(self) -> Any:
        return self.sglang.last_node

    @last_node.setter
    def last_node(self, node: Any) -> None:
        self.sglang.last_node = node

    @property
    def lock(self) -> Any:
        return self._locks.get(self.sglang)

    @lock.setter
    def lock(self, lock: Any) -> None:
        if lock is None:
            self._locks.pop(self.sglang, None)
        else:
            self._locks[self.sglang] = lock

    @property
    def prefix_indices(self) -> torch.Tensor:
        return self.sglang.prefix_indices

    @prefix_indices.setter
    def prefix_indices(self, value: torch.Tensor) -> None:
        self.sglang.prefix_indices = value


class SWAReqView(ReqView):
    """A request of a hybrid SWA model: its lock is SGLang's own pair of fields.

    SGLang's scheduler keeps where a request's window lock stopped in
    ``req.swa_uuid_for_lock`` (from ``inc_lock_ref``) and whether the window part
    went back early in ``req.swa_prefix_lock_released`` (``dec_swa_lock_only``); the
    kvcore lock handed to kvcore-swa is made from them, and a new lock is written
    back to them, so the scheduler's own calls and the cache's agree.
    """

    __slots__ = ()

    @staticmethod
    def lock_from(swa_uuid_for_lock: int | None, skip_lock_node_ids: Any = None,
                  swa_released: bool = False) -> LockResult:
        """The kvcore lock SGLang's lock handle stands for (``skip_lock_node_ids``: SWARadixCache keeps none)."""
        lock = LockResult(stop=swa_uuid_for_lock)
        if swa_released:
            lock.released_early.add("swa")
        return lock

    @staticmethod
    def store(req: Any, lock: LockResult) -> None:
        """Write a new kvcore lock back to SGLang's fields of ``req``."""
        req.swa_uuid_for_lock = lock.stop

    @property
    def lock(self) -> Any:
        req = self.sglang
        if req.last_node is None:
            return None
        return self.lock_from(req.swa_uuid_for_lock, req.skip_lock_node_ids, req.swa_prefix_lock_released)

    @lock.setter
    def lock(self, lock: Any) -> None:
        req = self.sglang
        # SGLang's cache_finished_req / cache_unfinished_req clear the early-release mark.
        req.swa_prefix_lock_released = False
        if lock is not None:
            self.store(req, lock)


#: Where kvcore's unified swa component keeps the tombstones its window lock passed over (LockResult.extras).
UNIFIED_SWA_SKIP = "swa_skip"


class UnifiedSWAReqView(SWAReqView):
    """A request of a hybrid SWA model on SGLang's ``UnifiedRadixCache``: its lock adds the skipped tombstones.

    SGLang's unified window lock passes over tombstones and records them in
    ``req.skip_lock_node_ids[ComponentType.SWA]`` (so a tombstone healed since is not
    unlocked); kvcore's unified swa component does the same in its lock's extras.
    """

    __slots__ = ()

    @staticmethod
    def lock_from(swa_uuid_for_lock: int | None, skip_lock_node_ids: Any = None,
                  swa_released: bool = False) -> LockResult:
        lock = SWAReqView.lock_from(swa_uuid_for_lock, swa_released=swa_released)
        lock.extras[UNIFIED_SWA_SKIP] = set((skip_lock_node_ids or {}).get(ComponentType.SWA, ()))
        return lock

    @staticmethod
    def store(req: Any, lock: LockResult) -> None:
        SWAReqView.store(req, lock)
        req.skip_lock_node_ids = skip_ids(lock)


def skip_ids(lock: LockResult) -> dict:
    """SGLang's ``skip_lock_node_ids`` of a kvcore unified lock (empty when no tombstone was passed over)."""
    skip = lock.extras.get(UNIFIED_SWA_SKIP)
    return {ComponentType.SWA: set(skip)} if skip else {}


class _Owner:
    """A running SGLang request as :class:`kvcore.InvariantChecker` names and reads it."""

    __slots__ = ("rid", "kv")

    def __init__(self, req: Any):
        self.rid = req.rid
        self.kv = KvRecordView(req.kv)


def owner_of(req: Any) -> Any:
    """``req`` (SGLang's) as an owner for ``kvcore.InvariantChecker(cache.kvcore_cache).check(owners=...)``."""
    return _Owner(req)


# ---------------------------------------------------------------------------- KV events


def salt_of(extra_key: Any) -> str | None:
    """The ``cache_salt`` of a kvcore namespace made by :func:`namespace` (None when unsalted)."""
    return extra_key[1] if isinstance(extra_key, tuple) else None


def salt_namespace_hash(salt: str) -> str:
    """SGLang's prior hash of a salted chain's first page (``compute_node_event_hash_values``)."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode("utf-8")).hexdigest()


class _EventTranslator:
    """kvcore's page events as SGLang's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.

    SGLang's block hashes chain SGLang's own page hash (``get_hash_str``) and ignore
    ``extra_key``; kvcore's chain covers the namespace too.  So each kvcore page hash
    is mapped to the SGLang hash of the same page (chained on its parent's), and the
    events go through SGLang's own recorder, which coalesces them as SGLang does.  A
    ``cache_salt`` page is SGLang's ``BlockStoredWithMetadata`` with its namespace-aware
    hash (the chain starts from the salt's hash), as SGLang publishes it.
    """

    def __init__(self, page_size: int):
        self.recorder = KVCacheEventRecorder(enabled=True, page_size=page_size)
        self._sglang_hash: dict[str, str] = {}

    def feed(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, PageStored):
                parent = None if ev.parent_hash is None else self._sglang_hash[ev.parent_hash]
                salt = salt_of(ev.extra_key)
                # A salted page's SGLang hash chains from the salt's namespace hash under the root
                # (its compute_node_event_hash_values); an unsalted one from nothing.
                prior = parent if parent is not None or salt is None else salt_namespace_hash(salt)
                h = get_hash_str(list(ev.token_ids), prior)
                self._sglang_hash[ev.page_hash] = h
                fields = dict(
                    block_hashes=[hash_str_to_int64(h)],
                    parent_block_hash=None if parent is None else hash_str_to_int64(parent),
                    token_ids=list(ev.token_ids),
                    block_size=len(ev.token_ids),
                    lora_id=None,
                    medium=StorageMedium.GPU,
                )
                self.recorder.enqueue(BlockStored(**fields) if salt is None else BlockStoredWithMetadata(
                    **fields, metadata=BlockStoredMetadata(cache_salt=salt)))
            elif isinstance(ev, PageRemoved):
                h = self._sglang_hash.pop(ev.page_hash)
                self.recorder.enqueue(BlockRemoved(block_hashes=[hash_str_to_int64(h)], medium=StorageMedium.GPU))
            elif isinstance(ev, AllPagesCleared):
                self._sglang_hash.clear()
                self.recorder.record_all_cleared()
            else:
                raise TypeError(f"kvcore event {ev!r} has no SGLang {SGLANG_VERSION} counterpart")

    def take(self) -> list:
        return self.recorder.take()


# ---------------------------------------------------------------------------- the tree cache


class KvcoreTreeCache(BasePrefixCache):
    """SGLang 0.5.19's ``BasePrefixCache`` answered by one kvcore backend (``kvcore_cache``) on SGLang's pools.

    ``req_to_token_pool`` and ``token_to_kv_pool_allocator`` are SGLang's own
    objects (the scheduler and SGLang's ``common.py`` use them); the kvcore
    backend runs on views of the same objects.
    """

    # How this cache's kvcore backend reads SGLang's Req.
    req_view: type[ReqView] = ReqView

    def __init__(self, target: Target, kvcore_cache: Any, params: Any, *, chunk_when_disabled: bool = False):
        self.target = target
        # SGLang's UnifiedRadixCache, disabled, calls itself a chunk cache (its RadixCache does not).
        self._chunk_when_disabled = chunk_when_disabled
        self.kvcore_cache = kvcore_cache
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.disable_finished_insert = bool(params.disable_finished_insert)
        self._tables = RequestTables()
        self._events = _EventTranslator(self.page_size) if params.enable_kv_cache_events else None
        if self._events is not None:
            # SGLang's RadixCache records a clear when it builds its (empty) tree.
            self._events.recorder.record_all_cleared()
        if params.enable_metrics:
            self.init_metrics_collector()

    def __repr__(self) -> str:
        return f"<KvcoreTreeCache {self.target.name} on kvcore {type(self.kvcore_cache).__name__}>"

    # -- traits
    @property
    def disable(self) -> bool:
        return bool(self.kvcore_cache.disable)

    @property
    def root_node(self) -> Any:
        return self.kvcore_cache.root_node

    def is_chunk_cache(self) -> bool:
        return bool(self.kvcore_cache.is_chunk_cache()) or (self._chunk_when_disabled and self.disable)

    # -- lookups
    def _key(self, key: Any) -> kvcore.RadixKey:
        if key.is_bigram:
            raise UnsupportedContext(f"{self.target.name}: EAGLE bigram keys are not supported by kvcore")
        return kvcore.RadixKey(key.raw_token_ids(), namespace(key.extra_key, key.cache_salt))

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = self._key(params.key)
        found = self.kvcore_cache.match_prefix(key)
        self._note_matched(params, key)
        node = found.last_device_node
        return MatchResult(device_indices=found.device_indices, last_device_node=node, last_host_node=node,
                           best_match_node=node)

    def _note_matched(self, params: MatchPrefixParams, key: kvcore.RadixKey) -> None:
        """Keep the list the match made of a request's ids (:class:`MatchedIds`) for its cache calls."""
        req = params.req
        if req is not None and key.validated and not self.is_chunk_cache():
            # A tree reads the key as a list to match it, so token_ids is that list here (no conversion).
            self._tables.matched = MatchedIds(req, params.key.token_ids, key.token_ids)

    def reset(self) -> None:
        self.kvcore_cache.reset()
        self._flush_events()

    # -- request lifecycle (through the kvcore cache's hook relay, so extension plugins see them)
    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{self.target.name}: cache_finished_req got unknown arguments {sorted(kwargs)}")
        if self.disable_finished_insert:
            is_insert = False
        # SGLang caches (origin_input_ids + output_ids)[:kv_len_to_handle]; kvcore reads only what it inserts.
        known = self._tables.known_ids(req, keep=False)
        fill = FillIds((req.origin_input_ids, req.output_ids), kv_len_to_handle, known)
        view = self.req_view(req, fill, kv_len_to_handle, self._tables)
        self.kvcore_cache.hook.cache_finished_req(req=view, is_insert=is_insert)
        self._flush_events()

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{self.target.name}: cache_unfinished_req got unknown arguments {sorted(kwargs)}")
        if self.is_chunk_cache():
            # SGLang's ChunkCache keeps the row up to the chunk's end as the prefix.
            fill = NO_IDS
            committed = req.extend_range.end
        else:
            # SGLang caches req.get_fill_ids() (full_untruncated_fill_ids[:extend_range.end], a copy of the
            # whole prefix per chunk); kvcore reads only what it inserts, from the arrays themselves.
            committed = fill_len(req)
            fill = FillIds((req.full_untruncated_fill_ids,), committed, self._tables.known_ids(req, keep=chunked))
        view = self.req_view(req, fill, committed, self._tables)
        self.kvcore_cache.hook.cache_unfinished_req(req=view, chunked=chunked)
        self._flush_events()

    # -- eviction and locks
    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        done = self.kvcore_cache.evict(params.num_tokens)
        self.update_eviction_metrics(done.num_tokens_evicted, start)
        self._flush_events()
        return EvictResult(num_tokens_evicted=done.num_tokens_evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        # SGLang's delta is the change in evictable tokens; kvcore's the change in protected ones.
        return IncLockRefResult(delta=-self.kvcore_cache.inc_lock_ref(node).delta)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        return DecLockRefResult(delta=-self.kvcore_cache.dec_lock_ref(node).delta)

    # -- sizes
    def evictable_size(self) -> int:
        return int(self.kvcore_cache.evictable_size())

    def protected_size(self) -> int:
        return int(self.kvcore_cache.protected_size())

    def total_size(self) -> int:
        return int(self.kvcore_cache.total_size())

    def pretty_print(self) -> Any:
        return self.kvcore_cache.pretty_print()

    # -- KV events
    def take_events(self) -> list:
        return [] if self._events is None else self._events.take()

    def _flush_events(self) -> None:
        if self._events is not None:
            self._events.feed(self.kvcore_cache.take_events())



class _FullPoolSizes:
    """The full pool's sizes of a hybrid model's tree (SGLang's base answers 0 for a full-attention one)."""

    kvcore_cache: Any

    def full_evictable_size(self) -> int:
        return int(self.kvcore_cache.full_evictable_size())

    def full_protected_size(self) -> int:
        return int(self.kvcore_cache.full_protected_size())


class KvcoreSWATreeCache(_FullPoolSizes, KvcoreTreeCache):
    """SGLang 0.5.19's ``SWARadixCache`` contract answered by kvcore-swa on SGLang's ``SWATokenToKVPoolAllocator``.

    On top of the base: the window (``supports_swa``, ``sliding_window_size``), the
    four full/window sizes, ``total_size() -> (full, swa)``, SGLang's window lock
    handles (``swa_uuid_for_lock`` in ``IncLockRefResult``, ``DecLockRefParams`` and
    ``skip_swa``), ``dec_swa_lock_only`` and two-pool eviction.
    """

    req_view: type[SWAReqView] = SWAReqView
    # SGLang's SWARadixCache reports full + window tokens to its eviction metrics.
    metrics_count_swa = True

    def __init__(self, target: Target, kvcore_cache: Any, params: Any, **kw: Any):
        super().__init__(target, kvcore_cache, params, **kw)
        self.sliding_window_size = int(kvcore_cache.sliding_window_size)

    def supports_swa(self) -> bool:
        return True

    # -- eviction and locks
    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        done = self.kvcore_cache.evict(params.num_tokens, swa_num_tokens=params.swa_num_tokens)
        self.update_eviction_metrics(
            done.num_tokens_evicted + (done.swa_num_tokens_evicted if self.metrics_count_swa else 0), start)
        self._flush_events()
        return EvictResult(num_tokens_evicted=done.num_tokens_evicted,
                           swa_num_tokens_evicted=done.swa_num_tokens_evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        # SGLang's SWARadixCache reports no delta, only where the window lock stopped.
        return IncLockRefResult(swa_uuid_for_lock=self.kvcore_cache.inc_lock_ref(node).stop)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None, skip_swa: bool = False
                     ) -> DecLockRefResult:
        lock = (self.req_view.lock_from(None, swa_released=skip_swa) if params is None else
                self.req_view.lock_from(params.swa_uuid_for_lock, params.skip_lock_node_ids, skip_swa))
        self.kvcore_cache.dec_lock_ref(node, lock)
        return DecLockRefResult()

    def dec_swa_lock_only(self, node: Any, swa_uuid_for_lock: int | None = None,
                          skip_lock_node_ids: Any = None) -> None:
        # skip_lock_node_ids: SGLang's SWARadixCache ignores it; its UnifiedRadixCache's window release too.
        self.kvcore_cache.dec_swa_lock_only(node, self.req_view.lock_from(swa_uuid_for_lock, skip_lock_node_ids))

    # -- sizes (SGLang's SWARadixCache raises for the plain ones; the full side is answered; full_*: _FullPoolSizes)
    def swa_evictable_size(self) -> int:
        return int(self.kvcore_cache.swa_evictable_size())

    def swa_protected_size(self) -> int:
        return int(self.kvcore_cache.swa_protected_size())

    def total_size(self) -> Any:
        return int(self.kvcore_cache.total_size()), int(self.kvcore_cache.swa_total_size())

    def available_and_evictable_str(self) -> str:
        alloc = self.token_to_kv_pool_allocator
        full, swa = alloc.full_available_size(), alloc.swa_available_size()
        return (f"Available full tokens: {full + self.full_evictable_size()} ({full=} + "
                f"full_evictable_size={self.full_evictable_size()})\n"
                f"Available swa tokens: {swa + self.swa_evictable_size()} ({swa=} + "
                f"swa_evictable_size={self.swa_evictable_size()})\n")


class _UnifiedAnswers:
    """What SGLang's ``UnifiedRadixCache`` answers whatever its components (kvcore's ``unified`` behind it).

    A disabled tree is a chunk cache, and ``inc_lock_ref`` reports the full tokens it
    newly protected (its full component's delta; SGLang's RadixCache reports the change in
    evictable tokens), the window lock's stop and the tombstones it passed over (none
    without a swa component).
    """

    kvcore_cache: Any
    disable: bool

    def __init__(self, target: Target, kvcore_cache: Any, params: Any):
        super().__init__(target, kvcore_cache, params, chunk_when_disabled=True)  # type: ignore[call-arg]

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult()
        lock = self.kvcore_cache.inc_lock_ref(node)
        return IncLockRefResult(delta=lock.delta, swa_uuid_for_lock=lock.stop, skip_lock_node_ids=skip_ids(lock))


class KvcoreUnifiedTreeCache(_UnifiedAnswers, KvcoreTreeCache):
    """SGLang 0.5.19's ``UnifiedRadixCache`` with its one component full (a full-attention model)."""

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        # SGLang's unified tree core aggregates no delta here ("no caller uses it yet").
        self.kvcore_cache.dec_lock_ref(node)
        return DecLockRefResult()


class KvcoreUnifiedSWATreeCache(_UnifiedAnswers, KvcoreSWATreeCache):
    """SGLang 0.5.19's ``UnifiedRadixCache`` with components full + swa, answered by kvcore's ``unified``.

    The window contract is the SWA tree's (:class:`KvcoreSWATreeCache`); where SGLang's
    unified tree answers otherwise, its answers (:class:`_UnifiedAnswers`, and: the plain
    sizes are the full pool's where its SWARadixCache raises for them, the lock's skipped
    tombstones go back to ``dec_lock_ref`` through ``req.skip_lock_node_ids``, its eviction
    metrics count full tokens only, and ``cache_unfinished_req`` first frees what left the
    request's window (``SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS``, on by default in 0.5.19).
    """

    req_view = UnifiedSWAReqView
    metrics_count_swa = False

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        if not self.disable and envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get():
            # SGLang's unified swa component, before its insert: the frontier a page below the insert's end.
            free_swa_out_of_window_slots(
                req, fill_len(req) - 1, sliding_window_size=self.sliding_window_size,
                page_size=self.page_size, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, retain_floor=self.swa_retain_floor(req),
            )
        super().cache_unfinished_req(req, chunked, **kwargs)

    def available_and_evictable_str(self) -> str:
        alloc = self.token_to_kv_pool_allocator
        full, swa = alloc.full_available_size(), alloc.swa_available_size()
        full_ev, swa_ev = self.full_evictable_size(), self.swa_evictable_size()
        return (f"Available full tokens: {full + full_ev} (full_available_size={full} + "
                f"full_evictable_size_={full_ev})\n"
                f"Available swa: {swa + swa_ev} (available_size={swa} + component_evictable_size_={swa_ev})\n")


class KvcoreMambaTreeCache(_FullPoolSizes, KvcoreTreeCache):
    """SGLang 0.5.19's ``MambaRadixCache`` contract answered by kvcore-mamba on SGLang's ``HybridReqToTokenPool``.

    On top of the base: ``supports_mamba``, the admission match's copy-on-write
    (``MatchPrefixParams.cow_mamba`` with ``req``: a state slot for the request and
    ``mamba_cow_src_index`` on its record, copied by the forward) and
    ``mamba_branching_seqlen``, two-pool eviction (``EvictParams.mamba_num``), the
    full/mamba sizes and ``total_size() -> (full tokens, states)``.  Locks answer empty
    results, as SGLang's do.  The request's state fields are SGLang's own ``ReqKvInfo``
    fields, read and written by the kvcore tree through :class:`MambaStateView`.
    """

    def supports_mamba(self) -> bool:
        return True

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        cow = bool(params.cow_mamba) and req is not None
        # SGLang's scheduler matches a waiting request again each round; one that kept its state
        # slot from an earlier match is only pointed at the new source (SGLang's match does that).
        rematch = cow and bool(req.kv.holds_mamba)
        view = self.req_view(req, NO_IDS, None, self._tables) if cow and not rematch else None
        key = self._key(params.key)
        found = self.kvcore_cache.match_prefix(key, cow_mamba=view is not None, req=view)
        self._note_matched(params, key)
        node = found.last_device_node
        if rematch and node.mamba_value is not None:
            req.kv.mamba_cow_src_index = node.mamba_value
            req.kv.mamba_needs_clear = False
        return MatchResult(device_indices=found.device_indices, last_device_node=node, last_host_node=node,
                           best_match_node=node, mamba_branching_seqlen=found.mamba_branching_seqlen)

    # -- eviction and locks
    def evict(self, params: EvictParams) -> EvictResult:
        # SGLang's MambaRadixCache records no eviction metrics.
        done = self.kvcore_cache.evict(params.num_tokens, mamba_num=params.mamba_num)
        self._flush_events()
        return EvictResult(num_tokens_evicted=done.num_tokens_evicted, mamba_num_evicted=done.mamba_num_evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        self.kvcore_cache.inc_lock_ref(node)
        return IncLockRefResult()

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        self.kvcore_cache.dec_lock_ref(node)
        return DecLockRefResult()

    # -- sizes (SGLang's MambaRadixCache raises for the plain ones; the full side is answered; full_*: _FullPoolSizes)
    def mamba_evictable_size(self) -> int:
        return int(self.kvcore_cache.mamba_evictable_size())

    def mamba_protected_size(self) -> int:
        return int(self.kvcore_cache.mamba_protected_size())

    def total_size(self) -> Any:
        return int(self.kvcore_cache.total_size()), self.mamba_evictable_size() + self.mamba_protected_size()

    def sanity_check(self) -> None:
        if not self.disable:
            self.kvcore_cache.sanity_check()

    # -- what SGLang's leak diagnosis (the scheduler's watchdog dump) reads
    def all_values_flatten(self) -> torch.Tensor:
        return self._tree_slots("full")

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return self._tree_slots("mamba")

    def _tree_slots(self, pool: str) -> torch.Tensor:
        parts = [owned.slots.reshape(-1) for owned in self.kvcore_cache.iter_owned_slots() if owned.pool == pool]
        return torch.cat(parts) if parts else torch.tensor([])

    def available_and_evictable_str(self) -> str:
        full = self.token_to_kv_pool_allocator.available_size()
        return (f"Available full tokens: {full + self.full_evictable_size()} ({full=} + "
                f"full_evictable_size={self.full_evictable_size()})\n"
                f"Available mamba states: {self.req_to_token_pool.mamba_allocator.available_size()} + "
                f"mamba_evictable_size={self.mamba_evictable_size()}\n")


class KvcoreUnifiedMambaTreeCache(_UnifiedAnswers, KvcoreMambaTreeCache):
    """SGLang 0.5.19's ``UnifiedRadixCache`` with components full + mamba, answered by kvcore's ``unified``.

    The state contract is the Mamba tree's (:class:`KvcoreMambaTreeCache`: the copy-on-write
    match, ``mamba_branching_seqlen``, two-pool eviction, the full/mamba sizes, ``total_size()
    -> (full tokens, states)``); the lock answers are SGLang's unified tree's
    (:class:`_UnifiedAnswers`).
    """

    def available_and_evictable_str(self) -> str:
        full = self.token_to_kv_pool_allocator.available_size()
        states = self.req_to_token_pool.mamba_allocator.available_size()
        full_ev, states_ev = self.full_evictable_size(), self.mamba_evictable_size()
        return (f"Available full tokens: {full + full_ev} (full_available_size={full} + "
                f"full_evictable_size_={full_ev})\n"
                f"Available mamba: {states + states_ev} (available_size={states} + "
                f"component_evictable_size_={states_ev})\n")


# ---------------------------------------------------------------------------- factories


#: Set to 1 to turn kvcore's strict slot checks on over SGLang's pools (0, the default: off).
STRICT_ENV = "KVCORE_SGLANG_STRICT"


def strict_slots() -> bool:
    """Whether kvcore's strict slot checks run on SGLang's pools (``KVCORE_SGLANG_STRICT=1``).

    Off by default: SGLang's allocator keeps its free pages as a list, so every insert's
    check builds the free mask from that list (a pass over the free list per insert).  On,
    an insert or a request's cache call refuses padding, out-of-range, free, repeated or
    already-owned slots before anything changes, and a free refuses a slot a tree node still
    owns, before SGLang frees anything.
    """
    value = os.environ.get(STRICT_ENV, "0")
    if value not in ("0", "1"):
        raise UnsupportedContext(f"{STRICT_ENV}={value!r}: use 1 (strict slot checks on) or 0 (off)")
    return value == "1"


def _refuse(target: Target, ctx: Any) -> None:
    """One clear error for a context ``target`` cannot serve, before anything is built."""
    params = ctx.params
    name = target.name
    kind = "hybrid-ssm" if ctx.is_hybrid_ssm else "hybrid-swa" if ctx.is_hybrid_swa else "full"
    problems = []
    if kind not in target.serves:
        others = _targets_for(kind)
        instead = (f"use {' or '.join(others)}" if others else
                   "no kvcore name serves it yet: leave --radix-cache-backend unset for SGLang's own tree")
        problems.append(f"this is a {kind} model, which {name} does not serve ({instead})")
    if ctx.enable_hierarchical_cache:
        problems.append("--enable-hierarchical-cache is not supported by kvcore (drop it)")
    if params.is_eagle:
        problems.append("EAGLE speculative decoding keys the tree by token bigrams, which kvcore does not support")
    if params.cache_ttl_seconds is not None:
        problems.append("cache entry TTL (cache_ttl_seconds) is not supported by kvcore")
    if params.enable_session_radix_cache:
        problems.append("--enable-session-radix-cache is not supported by kvcore")
    if getattr(ctx, "is_dsa", False):
        problems.append("DSA (DeepSeek sparse attention) pools are not supported by kvcore")
    if params.token_to_kv_pool_allocator is not None and isinstance(
        params.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator
    ) and kind == "full":
        problems.append("a hybrid SWA allocator on a model not marked hybrid SWA")
    if problems:
        raise UnsupportedContext(f"--radix-cache-backend {name} (SGLang {SGLANG_VERSION}): " + "; ".join(problems))


def _targets_for(kind: str) -> list[str]:
    from kvcore_sglang.config import TARGETS

    return [t.name for t in TARGETS if kind in t.serves]


def _build_kvcore(target: Target, backend: str, params: Any, **options: Any) -> Any:
    """Build kvcore backend ``backend`` on views of SGLang's pools, with its lifecycle relay."""
    spec = get_backend(backend)
    alloc = params.token_to_kv_pool_allocator
    r2t = params.req_to_token_pool
    page_size = int(params.page_size)
    swa = isinstance(alloc, SWATokenToKVPoolAllocator)
    if alloc is not None:
        # The config records the pools' shape; the pools themselves are SGLang's.
        options.setdefault("size", int(alloc.size_full if swa else alloc.size) // page_size * page_size)
    if r2t is not None:
        options.setdefault("max_num_reqs", int(r2t.size))
        options.setdefault("max_context_len", -(-int(r2t.max_context_len) // page_size) * page_size)
    try:
        config = spec.config(page_size=page_size, **options)
        # SGLang's tree-only RadixCache (its unit tests) has no pools: the radix backend serves it without.
        init = CacheInitParams(
            req_to_token_pool=cast(Any, None if r2t is None else HybridReqToTokenPoolView(r2t)
                                   if isinstance(r2t, HybridReqToTokenPool) else ReqToTokenPoolView(r2t)),
            token_to_kv_pool_allocator=cast(
                Any, None if alloc is None else SWAAllocatorView(alloc) if swa else AllocatorView(alloc)
            ),
            page_size=page_size,
            config=config,
        )
        cache = spec.factory(init)
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise UnsupportedContext(
            f"--radix-cache-backend {target.name} (SGLang {SGLANG_VERSION}): kvcore backend {backend!r} "
            f"refuses SGLang's options: {exc}"
        ) from None
    cache.backend_name = backend
    attach_lifecycle(cache)
    get_plugin_manager().hook.kvcore_cache_created(cache=cache)
    return cache


def _swa_options(target: Target, params: Any) -> dict[str, int]:
    """The window options of a kvcore SWA tree on SGLang's pools; refuses pools it cannot model."""
    alloc = params.token_to_kv_pool_allocator
    # Exactly SGLang's two-pool allocator: its pure-SWA and shared (multi-ended) variants keep
    # other free lists, which kvcore's SWA allocator view does not model.
    if type(alloc) is not SWATokenToKVPoolAllocator:
        raise UnsupportedContext(
            f"--radix-cache-backend {target.name}: needs SGLang's SWATokenToKVPoolAllocator (full + window "
            f"pools), got {type(alloc).__name__}"
        )
    if isinstance(params.req_to_token_pool, HybridReqToTokenPool):
        raise UnsupportedContext(f"--radix-cache-backend {target.name}: a model with both sliding-window and "
                                 "mamba layers (HybridReqToTokenPool) is not supported by kvcore")
    if not params.sliding_window_size:
        raise UnsupportedContext(f"--radix-cache-backend {target.name}: SGLang gave no sliding_window_size")
    page_size = int(params.page_size)
    return {"swa_size": int(alloc.size_swa) // page_size * page_size,
            "sliding_window_size": int(params.sliding_window_size)}


def _mamba_options(target: Target, params: Any) -> dict[str, Any]:
    """The state options of a kvcore tree on SGLang's ``HybridReqToTokenPool``; refuses what it cannot serve."""
    r2t, alloc = params.req_to_token_pool, params.token_to_kv_pool_allocator
    name = f"--radix-cache-backend {target.name}"
    # Exactly SGLang's static pools: the unified (shared-memory) variants hand out virtual state ids.
    if type(r2t) is not HybridReqToTokenPool:
        raise UnsupportedContext(f"{name}: needs SGLang's HybridReqToTokenPool (a request row and a Mamba state "
                                 f"slot per request), got {type(r2t).__name__}")
    if type(alloc) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        raise UnsupportedContext(f"{name}: needs SGLang's TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator, "
                                 f"got {type(alloc).__name__}")
    if bool(r2t.enable_mamba_extra_buffer) != bool(params.enable_mamba_extra_buffer):
        raise UnsupportedContext(f"{name}: the cache and SGLang's HybridReqToTokenPool disagree on the "
                                 "extra-buffer Mamba strategy")
    if r2t.enable_mamba_extra_buffer_lazy or params.enable_mamba_extra_buffer_lazy:
        raise UnsupportedContext(f"{name}: the lazy extra-buffer Mamba strategy (--mamba-scheduler-strategy "
                                 "extra_buffer_lazy) is not supported by kvcore: use extra_buffer or no_buffer")
    if int(params.page_size) > 1 and not r2t.enable_mamba_extra_buffer:
        raise UnsupportedContext(f"{name}: page size {params.page_size} needs the extra-buffer Mamba strategy "
                                 "(--mamba-scheduler-strategy extra_buffer), as SGLang's Mamba trees do")
    if r2t.mamba_ckpt_pool is not None:
        raise UnsupportedContext(f"{name}: int8 Mamba checkpoints (--enable-int8-mamba-checkpoint) are not "
                                 "supported by kvcore (drop the flag)")
    if r2t.mamba_pool.replayssm_write_pos is not None:
        raise UnsupportedContext(f"{name}: ReplaySSM (--enable-linear-replayssm) is not supported by kvcore "
                                 "(drop the flag)")
    return {
        "mamba_size": int(r2t.mamba_allocator.size),
        # SGLang's caching point granularity, as its own Mamba trees read it.
        "mamba_cache_chunk_size": int(mamba_cache_chunk_size()),
    }


def _tree_options(params: Any) -> dict[str, Any]:
    """The options every kvcore tree takes from SGLang's ``CacheInitParams`` (and ``KVCORE_SGLANG_STRICT``)."""
    return {
        "eviction_policy": str(params.eviction_policy).lower(),
        "enable_kv_events": bool(params.enable_kv_cache_events),
        "disable": bool(params.disable),
        # Key checks are always on; the slot checks (claims) on request, with an allocator to check against.
        "strict": strict_slots() and params.token_to_kv_pool_allocator is not None,
    }


def build_tree_cache(target: Target, ctx: Any) -> KvcoreTreeCache:
    """The factory behind every kvcore name: refuse what cannot be served, else build on SGLang's pools."""
    _refuse(target, ctx)
    params = ctx.params
    if target.backend == "radix":
        if isinstance(params.req_to_token_pool, HybridReqToTokenPool):
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: a HybridReqToTokenPool (mamba states) "
                                     "on a model not marked hybrid SSM")
        cache = _build_kvcore(
            target, "radix", params,
            **_tree_options(params),
        )
    elif target.backend == "unified" and ctx.is_hybrid_swa:
        # SGLang's default tree on a hybrid SWA model: components full + swa on its two-pool allocator.
        cache = _build_kvcore(
            target, "unified", params,
            components=("full", "swa"),
            **_swa_options(target, params),
            **_tree_options(params),
        )
        return KvcoreUnifiedSWATreeCache(target, cache, params)
    elif target.backend == "unified" and ctx.is_hybrid_ssm:
        # SGLang's default tree on a hybrid SSM model: components full + mamba on its HybridReqToTokenPool.
        cache = _build_kvcore(target, "unified", params, components=("full", "mamba"),
                              **_mamba_options(target, params), **_tree_options(params))
        return KvcoreUnifiedMambaTreeCache(target, cache, params)
    elif target.backend == "unified":
        # SGLang's default tree; on a full-attention model its one component is full.
        cache = _build_kvcore(
            target, "unified", params,
            components=("full",),
            **_tree_options(params),
        )
        return KvcoreUnifiedTreeCache(target, cache, params)
    elif target.backend == "swa":
        cache = _build_kvcore(
            target, "swa", params,
            **_swa_options(target, params),
            **_tree_options(params),
        )
        return KvcoreSWATreeCache(target, cache, params)
    elif target.backend == "mamba":
        cache = _build_kvcore(target, "mamba", params, **_mamba_options(target, params), **_tree_options(params))
        return KvcoreMambaTreeCache(target, cache, params)
    elif target.backend == "chunk":
        if params.token_to_kv_pool_allocator is None:
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: needs SGLang's token_to_kv_pool_allocator")
        cache = _build_kvcore(target, "chunk", params, strict=False)
    elif target.serves == ("full",):
        # Another distribution's backend for full-attention models (declared in kvcore_sglang.targets):
        # on SGLang's pools as kvcore-radix is, with the options every kvcore tree config has.
        try:
            get_backend(target.backend)
        except kvcore.KvcoreError as exc:
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: {exc}") from None
        cache = _build_kvcore(
            target, target.backend, params,
            **_tree_options(params),
        )
    else:
        raise UnsupportedContext(
            f"--radix-cache-backend {target.name}: kvcore-sglang {SGLANG_VERSION} builds another "
            f"distribution's backend ({target.backend!r}) for full-attention models only; give the Target a "
            "builder for the other model kinds"
        )
    return KvcoreTreeCache(target, cache, params)

"""The core's release paths: finishing a request and freeing what left the window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvcore.capabilities import Capability
from kvcore.record import ceil_align, floor_align

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache
    from kvcore.pools.req_to_token import ReqToTokenPool
    from kvcore.record import Req, ReqKvInfo

__all__ = [
    "release_kv_cache",
    "cache_unfinished_req",
    "free_swa_out_of_window_slots",
    "free_swa_out_of_window_slots_batch",
]


class WindowSlotFreer(Protocol):
    """An allocator with a separate window (SWA) pool: the pooled and the pure SWA allocators."""

    def free_swa(self, free_index: torch.Tensor) -> None: ...


def _check_released_iff_not_held(req: Req, when: str) -> None:
    kv = req.kv
    assert (not kv.is_held) == kv.is_released, (
        f"request {req.rid!r} {when}: is_held={kv.is_held} but is_released={kv.is_released} "
        f"(kv_allocated_len={kv.kv_allocated_len}, swa_evicted_seqlen={kv.swa_evicted_seqlen})"
    )


def release_kv_cache(req: Req, cache: BasePrefixCache, is_insert: bool = True, *, speculative: bool = True) -> None:
    """Finish ``req``: hand its KV to the cache, free the rest, give back its row.

    Frees the over-allocation past the page-aligned committed length, calls the
    cache's ``cache_finished_req`` (through its lifecycle hook), frees the row and
    marks the record released.  A request that holds nothing is left as it is.

    The cache keeps ``req.effective_kv_committed_len()`` tokens (the committed
    length, or less for an engine that strips reasoning tokens from the cache);
    the record's committed length is lowered to it before the cache sees it.
    ``speculative=False`` keeps SGLang's check that nothing was allocated past
    the committed length without speculative decoding (ValueError, nothing
    changed); :class:`kvcore.Engine` passes its own setting, the default stays
    lenient for callers that over-allocate on purpose.
    """
    kv = req.kv
    if kv.is_held and not cache.req_to_token_pool.holds(kv):
        raise ValueError(
            f"request {req.rid!r}: its req_to_token row {kv.req_pool_idx} was not handed to it by this cache's "
            "pool: release it on the cache that admitted it"
        )
    if not kv.is_held and kv.is_released:
        return  # holds nothing: released already, or never admitted
    kv.check_fields(f"request {req.rid!r}", cache.page_size, cache.req_to_token_pool.max_context_len,
                    windowed=Capability.WINDOWED in cache.capabilities)
    _check_released_iff_not_held(req, "before release")
    effective = req.effective_kv_committed_len()
    if not speculative and effective == kv.kv_committed_len and kv.kv_committed_len != kv.kv_allocated_len:
        raise ValueError(
            f"request {req.rid!r}: kv_committed_len={kv.kv_committed_len} != kv_allocated_len={kv.kv_allocated_len} "
            "without speculative decoding (unexpected over-allocated KV)"
        )
    if effective < kv.kv_committed_len:
        kv.kv_committed_len = effective
    committed = kv.kv_committed_len
    page_size = cache.page_size
    hook = cache.hook
    if hook is None:
        cache.cache_finished_req(req, is_insert)
    else:
        hook.cache_finished_req(req=req, is_insert=is_insert)

    # A streaming session may have taken the record over.
    _check_released_iff_not_held(req, "after cache_finished_req")
    if not req.kv.is_held:
        return
    start = committed
    if page_size > 1:
        # The committed partial page went back with the cache's tail free.
        start = ceil_align(start, page_size)
    if start < kv.kv_allocated_len:
        cache.free_kv_row(kv, [(start, kv.kv_allocated_len)])
    cache.req_to_token_pool.free(req)
    kv.mark_released()
    _check_released_iff_not_held(req, "after release")


def cache_unfinished_req(req: Req, cache: BasePrefixCache, chunked: bool = False) -> None:
    """Cache ``req``'s committed prefix after a prefill chunk, through the lifecycle hook."""
    hook = cache.hook
    if hook is None:
        cache.cache_unfinished_req(req, chunked)
    else:
        hook.cache_unfinished_req(req=req, chunked=chunked)


def _check_window_request(req: Req, pre_len: int, page_size: int, req_to_token_pool: ReqToTokenPool) -> None:
    """Refuse a window free the record or ``pre_len`` cannot support, before any cursor moves."""
    kv = req.kv
    if not req_to_token_pool.holds(kv):
        raise ValueError(
            f"request {req.rid!r}: its req_to_token row {kv.req_pool_idx} is not one this cache's pool handed "
            "out; free its window on the cache that admitted it (nothing was changed)"
        )
    kv.check_fields(f"request {req.rid!r}", page_size, req_to_token_pool.max_context_len)
    if type(pre_len) is not int or not 0 <= pre_len <= kv.kv_allocated_len:
        raise ValueError(
            f"request {req.rid!r}: pre_len={pre_len!r} must be an int in [0, kv_allocated_len={kv.kv_allocated_len}] "
            "(nothing was changed)"
        )


def _window_cursor(req: Req, pre_len: int, window: int, page_size: int, is_chunk_cache: bool,
                   retain_floor: int | None) -> int:
    """Where ``req``'s SWA cursor moves to; also lifts the cursor to ``swa_dead_lo``."""
    kv = req.kv
    if kv.cache_protected_len % page_size:
        raise ValueError(
            f"request {req.rid!r}: cache_protected_len={kv.cache_protected_len} is not aligned to page_size={page_size}"
        )
    kv.swa_evicted_seqlen = max(kv.swa_evicted_seqlen, kv.swa_dead_lo(page_size))
    if is_chunk_cache:
        # No tree, so no tombstone-leaf concern: keep exactly the window.
        threshold = pre_len - window
    else:
        # Keep max(window, page) so the frontier stays below the insert boundary and
        # the request's last leaf is never all tombstone.
        threshold = pre_len - max(window, page_size)
        if retain_floor is not None:
            threshold = min(threshold, retain_floor)
    new_cursor = max(kv.swa_evicted_seqlen, threshold)
    if page_size > 1:
        new_cursor = floor_align(new_cursor, page_size)
    return new_cursor


def free_swa_out_of_window_slots(
    req: Req,
    pre_len: int,
    *,
    sliding_window_size: int,
    page_size: int,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool_allocator: WindowSlotFreer,
    is_chunk_cache: bool = False,
    retain_floor: int | None = None,
) -> None:
    """Free ``req``'s window slots that fell out of the window, never below ``swa_dead_lo``.

    Tree caches keep ``max(window, page)`` tokens so the last inserted leaf is never
    all tombstone; chunk caches keep exactly the window.  ``retain_floor`` (tree
    caches only) caps how far the cursor may move.
    """
    kv = req.kv
    if not kv.is_held:
        return
    _check_window_request(req, pre_len, page_size, req_to_token_pool)
    new_cursor = _window_cursor(req, pre_len, sliding_window_size, page_size, is_chunk_cache, retain_floor)
    if new_cursor > kv.swa_evicted_seqlen:
        slots = req_to_token_pool.req_to_token[kv.req_pool_idx, kv.swa_evicted_seqlen:new_cursor]
        token_to_kv_pool_allocator.free_swa(slots)
        kv.swa_evicted_seqlen = new_cursor


def free_swa_out_of_window_slots_batch(
    reqs: Sequence[Req],
    pre_lens: Sequence[int],
    *,
    sliding_window_size: int,
    page_size: int,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool_allocator: WindowSlotFreer,
    is_chunk_cache: bool = False,
    retain_floors: Sequence[int | None] | None = None,
) -> int:
    """``free_swa_out_of_window_slots`` for a decode batch, with one free for all of it.

    A free costs a dozen tensor operations whatever its size, so a scheduler that
    frees window slots every step calls this once per step, not once per request.
    Returns the number of window positions released.
    """
    if len(pre_lens) != len(reqs) or (retain_floors is not None and len(retain_floors) != len(reqs)):
        raise ValueError(
            f"free_swa_out_of_window_slots_batch: {len(reqs)} requests but {len(pre_lens)} pre_lens"
            + ("" if retain_floors is None else f" and {len(retain_floors)} retain_floors")
            + " (nothing was changed)"
        )
    seen: set[int] = set()
    for req, pre_len in zip(reqs, pre_lens):
        if req.kv.is_held:
            if id(req.kv) in seen:
                raise ValueError(f"request {req.rid!r} appears twice in the window free (nothing was changed)")
            seen.add(id(req.kv))
            _check_window_request(req, pre_len, page_size, req_to_token_pool)
    table = req_to_token_pool.req_to_token
    pieces: list[torch.Tensor] = []
    total = 0
    moves: list[tuple[ReqKvInfo, int]] = []
    for i, req in enumerate(reqs):
        kv = req.kv
        if not kv.is_held:
            continue
        floor = retain_floors[i] if retain_floors is not None else None
        new_cursor = _window_cursor(req, pre_lens[i], sliding_window_size, page_size, is_chunk_cache, floor)
        if new_cursor > kv.swa_evicted_seqlen:
            # Row slices, in batch order: cheaper than a gather through a list of flat indices.
            pieces.append(table[kv.req_pool_idx, kv.swa_evicted_seqlen : new_cursor])
            total += new_cursor - kv.swa_evicted_seqlen
            moves.append((kv, new_cursor))
    if pieces:
        token_to_kv_pool_allocator.free_swa(pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces))
        for kv, new_cursor in moves:
            kv.swa_evicted_seqlen = new_cursor
    return total

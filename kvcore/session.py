"""Streaming sessions: keep a finished turn's KV for the next turn of the conversation.

``StreamingSession(cache)`` wraps any backend.  A request with a ``session_id``
that finishes does not give its KV to the tree: the session's slot adopts the
record (row, lengths, backend state) and, on the first turn, the tree lock.
The next turn's ``match_prefix(key, req)`` hands the same record back, so the
slot and the request share one ``ReqKvInfo``.

A later turn reuses the session's KV only as far as its tokens (and ``extra_key``)
agree with the tokens that KV was computed for; the rest of the tail is freed and
recomputed.  A turn that differs inside the part the tree holds (the first turn's
matched or cached prompt) is refused with ValueError, nothing changed: end the
session and admit the request afresh (the tree still serves the common prefix).
``release_session`` while a turn runs on the session's record is refused with
RuntimeError: finish or abort that request first (``Engine.abort`` does both).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvcore.cache import BasePrefixCache, LockResult, MatchResult
from kvcore.capabilities import stateful
from kvcore.forwarding import ForwardingCache
from kvcore.keys import as_radix_key
from kvcore.record import ReqKvInfo, ceil_align, floor_align
from kvcore.release import cache_unfinished_req as _dispatch_unfinished
from kvcore.release import release_kv_cache

if TYPE_CHECKING:
    from kvcore.keys import KeyLike
    from kvcore.record import Req

__all__ = ["SessionSlot", "StreamingSession", "SessionNode"]


class SessionNode:
    """Stands in for a tree node while a request runs on a session's KV; locking it is a no-op."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str):
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"SessionNode({self.session_id!r})"


@dataclass(eq=False)
class SessionSlot:
    """The KV one conversation keeps between turns."""

    session_id: str
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    # The first turn's tree node and lock, held until the session is released.
    last_node: Any = None
    lock: LockResult | None = None
    node: SessionNode = None  # type: ignore[assignment]
    # The tokens whose KV the record holds (``fill_ids[:kv_committed_len]`` of the last turn) and their namespace.
    token_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    # The request running on the record now (restored, not yet finished), if any.
    turn: Req | None = None

    def __post_init__(self) -> None:
        if self.node is None:
            self.node = SessionNode(self.session_id)

    @property
    def rid(self) -> str:
        return f"session {self.session_id}"

    def save_from_req(self, req: Req, is_first: bool) -> None:
        """Adopt a finishing request's record (and, on the first turn, its tree lock)."""
        if not is_first:
            # Later turns ran on the slot's own record; the tree prefix cannot have moved.
            assert req.kv is self.kv, f"{req.rid!r} does not run on session {self.session_id!r}'s record"
            assert req.kv.cache_protected_len == self.kv.cache_protected_len
        self.token_ids = req.fill_ids[: req.kv.kv_committed_len]
        self.extra_key = req.extra_key
        kv = req.detach_kv()
        if is_first:
            self.kv = kv
            self.last_node = req.last_node
            self.lock = req.lock
        req.last_node = None
        req.lock = None
        self.turn = None

    def restore_to_req(self, req: Req) -> None:
        """Share the slot's record with ``req``; the slot keeps it, so restoring twice is harmless."""
        req.kv = self.kv
        req.last_node = self.node
        req.lock = None
        self.turn = req

    def running_turn(self) -> Req | None:
        """The request running on this slot's record now (restored and not finished, aborted or cancelled)."""
        turn = self.turn
        if turn is not None and turn.kv is not self.kv:
            self.turn = turn = None
        return turn


def common_prefix_len(a: list, b: list, n: int) -> int:
    """Length of the common prefix of ``a[:n]`` and ``b[:n]`` (one slice comparison when they agree)."""
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class StreamingSession(ForwardingCache):
    """Adds streaming-session save/restore on top of any backend.

    Every protocol call the session does not change reaches the backend through
    :class:`~kvcore.forwarding.ForwardingCache`, which forwards each one explicitly.
    """

    def __init__(self, inner: BasePrefixCache):
        super().__init__(inner)
        self.slots: dict[str, SessionSlot] = {}

    # -- sessions ----------------------------------------------------------
    def _active_slot(self, req: Req | None) -> SessionSlot | None:
        if req is None or req.session_id is None:
            return None
        slot = self.slots.get(req.session_id)
        return slot if slot is not None and slot.kv.is_held else None

    def try_match_prefix(self, key: KeyLike, req: Req) -> MatchResult | None:
        """Reuse the session's KV for ``req``, or None when the session holds none.

        Reuse reaches as far as the new turn's tokens agree with the tokens the
        session's KV was computed for (never past the committed length or the
        key, nothing across a different ``extra_key``); the tail beyond it is
        freed so the new turn recomputes those positions.  A turn that differs
        inside the part the tree holds (the first turn's matched prefix) is
        refused with ValueError, nothing changed: end the session and admit the
        request afresh.  A backend with a per-request recurrent state (``Capability.REQUEST_STATE``:
        mamba) cannot rewind it, so a turn that does not extend the whole previous
        record ends the session and the tree matches it afresh.  On pools that reuse only whole pages
        (``inner.session_page_aligned``, SGLang's NPU rule) the reused prefix is
        rounded down to a page; when that falls below the protected prefix or to
        0, the session is released and None returned (the tree matches the turn).
        """
        slot = self._active_slot(req)
        if slot is None:
            return None
        key = as_radix_key(key)
        kv = slot.kv
        limit = min(kv.kv_committed_len, len(key), len(slot.token_ids))
        if key.extra_key != slot.extra_key:
            prefix_len = 0
        else:
            prefix_len = common_prefix_len(slot.token_ids, key.token_ids, limit)
        page = self.page_size
        holder = stateful(self.inner)
        if prefix_len < kv.kv_committed_len and holder is not None and holder.request_state_slots(kv):
            # A recurrent state (mamba) summarises every position the record committed and cannot be
            # rewound to the common prefix: reusing the record would compute the turn from a stale
            # state.  End the session; the tree matches the turn afresh (its states are per node).
            self.release_session(slot.session_id)
            return None
        if self.inner.session_page_aligned and page > 1:
            # Pools that reuse only whole pages (SGLang's NPU rule): below the protected prefix or at 0
            # pages, release the session and let the tree match the turn afresh (a full prefill).
            prefix_len = floor_align(prefix_len, page)
            if prefix_len < kv.cache_protected_len or prefix_len == 0:
                self.release_session(slot.session_id)
                return None
        if prefix_len < kv.cache_protected_len:
            raise ValueError(
                f"session {slot.session_id!r}: the new turn shares only {prefix_len} tokens with the previous one "
                f"but the tree protects {kv.cache_protected_len} (streaming sessions are append-only there); "
                f"end the session and admit {req.rid!r} afresh"
            )
        # A rewind below the window cursor must land on a page boundary, or a page is freed twice.
        if page > 1 and kv.swa_evicted_seqlen > prefix_len:
            prefix_len = floor_align(prefix_len, page)
        slot.restore_to_req(req)
        self._free_tail(kv, prefix_len)
        indices = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :prefix_len].to(torch.int64)
        return MatchResult(
            device_indices=indices,
            last_device_node=slot.node,
            best_match_node=slot.node,
            cache_protected_len=kv.cache_protected_len,
        )

    def _free_kv_aligned(self, kv: ReqKvInfo, target: int) -> None:
        """Free ``kv``'s row from the page boundary at or above ``target`` to ``kv_allocated_len``.

        Whole pages only: ``[target, ceil_align(target))`` stays with the record
        until the session is released.
        """
        start = ceil_align(target, self.page_size) if self.page_size > 1 else target
        if start < kv.kv_allocated_len:
            self.free_kv_row(kv, [(start, kv.kv_allocated_len)])

    def _free_tail(self, kv: ReqKvInfo, prefix_len: int) -> None:
        self._free_kv_aligned(kv, prefix_len)
        kv.kv_allocated_len = prefix_len
        kv.kv_committed_len = min(kv.kv_committed_len, prefix_len)
        kv.swa_evicted_seqlen = min(kv.swa_evicted_seqlen, prefix_len)

    def release_session(self, session_id: str) -> int:
        """Drop the session's tree lock, free ``[protected, allocated)`` and its row.

        Returns the number of token slots freed; an unknown session frees nothing.
        """
        slot = self.slots.get(session_id)
        if slot is None:
            return 0
        running = slot.running_turn()
        if running is not None:
            raise RuntimeError(
                f"release_session({session_id!r}): request {running.rid!r} is running on the session's KV; "
                "finish or abort that request first (nothing was released)"
            )
        del self.slots[session_id]
        if slot.last_node is not None:
            self.inner.dec_lock_ref(slot.last_node, slot.lock)
        freed = 0
        kv = slot.kv
        if kv.is_held:
            freed = max(0, kv.kv_allocated_len - kv.cache_protected_len)
            self.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
            self.req_to_token_pool.free(slot)
            kv.mark_released()
        return freed

    def session_slots(self) -> list[SessionSlot]:
        return list(self.slots.values())

    def session_held_tokens(self, active_pool_idxs: set[int] | None = None) -> int:
        """Full-pool slots session slots hold outside the tree (not counting slots a live request runs on)."""
        return sum(
            ceil_align(s.kv.kv_allocated_len, self.page_size) - s.kv.cache_protected_len
            for s in self._idle_slots(active_pool_idxs)
        )

    def session_held_req_count(self, active_pool_idxs: set[int] | None = None) -> int:
        """req_to_token rows session slots hold (not counting slots a live request runs on)."""
        return sum(1 for _ in self._idle_slots(active_pool_idxs))

    def session_held_mamba_slots(self, active_pool_idxs: set[int] | None = None) -> int:
        """State-pool slots session slots hold (not counting slots a live request runs on).

        SGLang's name; the count comes from the backend (``request_state_slots`` of
        ``Capability.REQUEST_STATE``), 0 for backends without a per-request state pool.
        """
        holder = stateful(self.inner)
        if holder is None:
            return 0
        return sum(
            holder.request_state_slots(s.kv)
            for s in self.slots.values()
            if not (active_pool_idxs and s.kv.req_pool_idx in active_pool_idxs)
        )

    def _idle_slots(self, active_pool_idxs: set[int] | None) -> Iterator[SessionSlot]:
        for s in self.slots.values():
            if s.kv.is_held and not (active_pool_idxs and s.kv.req_pool_idx in active_pool_idxs):
                yield s

    # -- BasePrefixCache ---------------------------------------------------
    def match_prefix(self, key: KeyLike, req: Req | None = None, **kwargs: Any) -> MatchResult:
        """The session's KV for ``req``'s turn when it holds some, else the backend's match of ``key``."""
        result = self.try_match_prefix(key, req) if req is not None else None
        return result if result is not None else self.inner.match_prefix(key, **kwargs)

    def match_request(self, req: Req, key: KeyLike) -> MatchResult:
        result = self.try_match_prefix(key, req) if req.session_id is not None else None
        return result if result is not None else self.inner.match_request(req, key)


    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """A turn of a session: the session adopts the record; any other request: the backend's finish."""
        if req.session_id is None:
            self._finish_inner(req, is_insert)
            return
        existing = self.slots.get(req.session_id)
        is_first = existing is None
        slot = self.slots[req.session_id] = existing or SessionSlot(req.session_id)
        kv = req.kv
        finished_len = req.finished_len if req.finished_len is not None else len(req.output_ids)
        target = len(req.origin_input_ids) + finished_len
        self._trim_overshoot(req, finished_len)
        # The slot inherits the finished length (clamped to what is allocated), not the request's clock.
        kv.kv_committed_len = min(target, kv.kv_allocated_len)
        slot.save_from_req(req, is_first=is_first)

    def _trim_overshoot(self, req: Req, finished_len: int) -> None:
        """Cut the record back to ``len(origin_input_ids) + finished_len`` (SGLang's ``_trim_overshoot``).

        Speculative decoding may commit past ``max_new_tokens``; the next turn's
        input holds only ``output_ids[:finished_len]``, so KV past that goes back
        (from the page boundary above it) and ``output_ids`` is cut to match.  Below
        the window cursor the target is rounded down to a page, as for a rewind.
        """
        kv = req.kv
        target = len(req.origin_input_ids) + finished_len
        page = self.page_size
        if page > 1 and kv.swa_evicted_seqlen > target:
            target = floor_align(target, page)
        self._free_kv_aligned(kv, target)
        kv.kv_allocated_len = min(kv.kv_allocated_len, target)
        kv.kv_committed_len = min(kv.kv_committed_len, target)
        kv.swa_evicted_seqlen = min(kv.swa_evicted_seqlen, target)
        req.output_ids = req.output_ids[:finished_len]

    def _finish_inner(self, req: Req, is_insert: bool) -> None:
        hook = self.inner.hook
        if hook is None:
            self.inner.cache_finished_req(req, is_insert)
        else:
            hook.cache_finished_req(req=req, is_insert=is_insert)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        if req.session_id is not None:
            if chunked or req.session_id in self.slots:
                # The session keeps this KV itself; the tree is not told.
                row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len]
                req.prefix_indices = row.to(torch.int64, copy=True)
                return
        _dispatch_unfinished(req, self.inner, chunked)


    def inc_lock_ref(self, node: Any) -> LockResult:
        if isinstance(node, SessionNode):
            return LockResult()
        return self.inner.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any, lock: LockResult | None = None) -> LockResult:
        if isinstance(node, SessionNode):
            return LockResult()
        return self.inner.dec_lock_ref(node, lock)

    def dec_swa_lock_only(self, node: Any, lock: LockResult | None = None) -> LockResult:
        if isinstance(node, SessionNode):
            return LockResult()
        return super().dec_swa_lock_only(node, lock)

    def check_node_locked(self, node: Any, what: str) -> None:
        # A turn on a session's record locks nothing in the tree (the session holds the first turn's lock).
        if not isinstance(node, SessionNode):
            self.inner.check_node_locked(node, what)

    def check_req(self, req: Req, what: str) -> None:
        if not isinstance(req.last_node, SessionNode):
            self.inner.check_req(req, what)

    def check_req_lock(self, req: Req, what: str) -> None:
        if not isinstance(req.last_node, SessionNode):
            self.inner.check_req_lock(req, what)

    def release_req_lock(self, req: Req) -> None:
        if isinstance(req.last_node, SessionNode):
            req.last_node = None
            req.lock = None
            return
        self.inner.release_req_lock(req)

    def abort_req(self, req: Req) -> None:
        """Release ``req``'s KV without caching any of it and without making it a session turn.

        For a request that does not run on a session's record (a first turn, or a
        request without a session): the backend's ``release_kv_cache(is_insert=False)``.
        """
        release_kv_cache(req, self.inner, is_insert=False)

    def reset(self) -> None:
        for session_id in list(self.slots):
            self.release_session(session_id)
        self.inner.reset()

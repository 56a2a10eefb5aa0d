"""Resumable insert for chunked prefill: a running request's next chunk goes in from its locked node.

SGLang's ``cache_unfinished_req`` re-inserts the request's whole prefix after every
chunk (a walk from the root over every token, a copy of the whole row, a re-match
that concatenates every slot), so a long prompt costs its length once per chunk.
The request's path is locked, though: ``req.last_node`` and everything above it
stay in the tree, with the same slots, until the lock goes (a split keeps the
original node as the *lower* half, so ``last_node`` still ends at the same
depth).  So the next insert can start at ``last_node`` with only
``fill_ids[protected:aligned]`` and ``row[protected:aligned]``: every node above
it gets what SGLang's walk from the root would give it (the access time, the hit
count, the priority: one pass over the path's nodes, O(depth)), the walk below it
is the one SGLang's would make, and the re-match's touch is one pass up again.
What the answer needs of the prefix's slots comes from a per-request buffer of the
tree's slots on the path (:class:`ResumePoint`), grown by each chunk's new part:
``prefix_indices`` is a view of it, never an O(prefix) copy.

:class:`ResumableInsert` holds that flow once; a tree backend supplies its own
per-node parts (:meth:`ResumableInsert.resume_insert`,
:meth:`ResumableInsert.resume_stamp`, :meth:`ResumableInsert.resume_lock`) and
calls :meth:`ResumableInsert.resume_unfinished` first in ``cache_unfinished_req``
(and :meth:`ResumableInsert.resume_finished` in ``cache_finished_req``: the last
insert of a request also covers only what it added).
The resume points are the tree's own state (:attr:`ResumableInsert.resume_points`,
by request row), not a field of the request's record: a record stays plain data,
a record on another cache has no point there, and an engine's own record type (a
view of SGLang's, say) needs no field for it.  A point is used only where the
request's own lock holds the node it names, at the depth it names: its slots are
then the tree's slots of that request's path, whichever request it was made for
(a row's point outlives its request only where a row was freed without the cache:
it is replaced or dropped by the row's next request).
Whenever the precondition is not proven (no resume point of this cache, the
request's node or protected length moved, another namespace, the lock given back,
fewer ids than committed) it answers False and the backend runs SGLang's
whole-prefix path, then :meth:`ResumableInsert.note_resume_point` for the next chunk.

What the precondition takes on trust, as SGLang's re-insert does: a running
request's ``fill_ids[:cache_protected_len]`` are the tokens that were cached for
it (the engine never rewrites them; the fuzz checks every row's K/V against them).
A caller writing into ``req_to_token[row, :cache_protected_len]`` changes nothing
here: as on SGLang's path, those positions are the tree's and are not read.

Under ``strict`` the request's own part of its row, ``[cache_protected_len,
aligned)``, is checked as a whole before anything changes (the row's claim:
every slot in range, allocated, not a tree node's, named once, in whole pages).
It covers the new leaf's slots, which are then claimed without a second check,
and the duplicates freed after the insert, so nothing can be refused half-way.
It does not prove that a slot was handed to *this* request (``req_to_token`` is a
plain tensor: no per-row provenance), no more than the per-slot check did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcore.cache import BasePrefixCache, LockResult
from kvcore.record import floor_align

if TYPE_CHECKING:
    from kvcore.pools.req_to_token import ReqToTokenPool
    from kvcore.record import Req, ReqKvInfo

__all__ = ["ResumePoint", "ResumableInsert", "grow_slots", "path_below"]


@dataclass(slots=True, eq=False)
class ResumePoint:
    """Where a running request's next insert may start (kept by the tree, by request row).

    ``node``: the request's locked node then; ``length``: the tokens from
    the root to its end (the record's ``cache_protected_len`` then).  ``slots``:
    int64, at least ``length`` long, ``slots[:length]`` the tree's slots on that
    path.  Positions below ``length`` are never written again, so the views of
    ``slots`` handed out as ``prefix_indices`` keep their content.
    """

    node: Any
    length: int
    slots: torch.Tensor


def grow_slots(slots: torch.Tensor, keep: int, need: int) -> torch.Tensor:
    """``slots`` when it holds ``need`` positions, else a buffer twice as large with ``slots[:keep]``."""
    cap = int(slots.shape[0])
    if need <= cap:
        return slots
    out = torch.empty((max(need, 2 * cap),), dtype=torch.int64, device=slots.device)
    out[:keep] = slots[:keep]
    return out


def path_below(rp: ResumePoint, top: Any, last: Any, end: int) -> tuple[list[Any], torch.Tensor]:
    """The nodes a resumed insert hung below ``top`` (the locked node, ``rp.length`` tokens deep) down to
    ``last`` (``end`` tokens deep), root side first, and the resume point's slot buffer (grown when
    needed) with their slots written after ``rp.length``: the tree's slots of ``[0, end)``."""
    below: list[Any] = []
    x = last
    while x is not top:
        below.append(x)
        x = x.parent
    below.reverse()
    slots = grow_slots(rp.slots, rp.length, end)
    pos = rp.length
    for x in below:
        nxt = pos + len(x.key)
        slots[pos:nxt] = x.value
        pos = nxt
    return below, slots


class ResumableInsert:
    """The resumed ``cache_unfinished_req`` of a tree backend whose request lock is one plain path lock.

    Mixed into a :class:`kvcore.cache.BasePrefixCache` subclass (before it); the
    backend implements the three per-node parts below.
    """

    #: The running requests' resume points, by req_to_token row (at most one per row: bounded by the pool).
    resume_points: dict[int, ResumePoint]

    def __init__(self, params: Any) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the BasePrefixCache it is mixed into
        self.resume_points = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Mixed in after BasePrefixCache, this __init__ would never run (the base's does not chain on).
        mro = cls.__mro__
        if BasePrefixCache in mro and mro.index(BasePrefixCache) < mro.index(ResumableInsert):
            raise TypeError(f"{cls.__name__}: mix ResumableInsert in before BasePrefixCache "
                            f"(class {cls.__name__}(ResumableInsert, BasePrefixCache))")

    if TYPE_CHECKING:
        root_node: Any
        page_size: int
        disable: bool
        strict: bool
        req_to_token_pool: ReqToTokenPool
        token_to_kv_pool_allocator: Any  # under strict: kvcore.pools.claims.SlotClaims

        def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None: ...


    # -- the backend's parts ---------------------------------------------------

    def resume_insert(self, upper: list[Any], ids: list[int], values: torch.Tensor, base: int,
                      priority: int, chunked: bool) -> tuple[int, Any, bool]:
        """Insert ``ids`` -> ``values`` below ``upper[-1]`` as the whole-key insert would.

        ``upper``: the locked path, root side first (root excluded), ``base`` tokens
        long; the insert's walk passes it first (its per-node fields: one pass over
        ``upper``), then walks ``ids`` from its last node (splits, a new leaf, KV
        events).  Refuses (nothing changed) exactly what the whole-key insert refuses
        of these tokens; under strict ``values`` were checked claimable already (the
        row's claim), so the new leaf's slots are claimed without a second check.
        Returns the cached length from the root, the node the key ends on, and
        whether the duplicates of ``values`` were freed here (else the caller frees
        ``[base, prefix_len)`` of the row).
        """
        raise NotImplementedError

    def resume_stamp(self, node: Any) -> None:
        """The re-match's touch of the path from the root to ``node`` (what ``match_prefix`` of the key does)."""
        raise NotImplementedError

    def resume_lock(self, nodes: list[Any]) -> int:
        """Add one lock to each of ``nodes`` (below the locked node); returns the tokens that became protected."""
        raise NotImplementedError

    # -- the shared flow --------------------------------------------------------

    def resume_path(self, req: Req) -> list[Any] | None:
        """The locked path ``req``'s next insert may start below (root side first, root excluded), or None
        when that is not proven: no resume point of this cache, the request's node or protected length
        moved, another namespace, the cache disabled, fewer ids than committed.  Changes nothing."""
        kv = req.kv
        rp = self.resume_point(kv)
        node = req.last_node
        if rp is None or rp.node is not node or self.disable:
            return None
        base = kv.cache_protected_len
        if rp.length != base or base <= 0 or node.extra_key != req.extra_key or req.seqlen < kv.kv_committed_len:
            return None
        root = self.root_node
        upper: list[Any] = []
        depth = 0
        x = node
        while x is not root:
            if x is None:
                return None
            upper.append(x)
            depth += len(x.key)
            x = x.parent
        if depth != base:
            return None
        upper.reverse()
        return upper

    def _resume_insert_row(self, req: Req, chunked: bool) -> tuple[Any, int, int, Any, list[Any], bool] | None:
        """The precondition, the row's claim and the insert from the locked node; None (nothing changed) when
        the request's node and protected length are not proven its own.  Returns ``(resume point, protected,
        prefix_len, last node, the locked path, whether the insert freed the duplicates)``."""
        upper = self.resume_path(req)
        if upper is None:
            return None
        kv = req.kv
        rp = self.resume_points[kv.req_pool_idx]  # type: ignore[index]  # resume_path found it
        base = kv.cache_protected_len
        committed = kv.kv_committed_len
        aligned = floor_align(committed, self.page_size)
        ids = req.fill_slice(base, aligned)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        values = row[base:aligned].to(torch.int64)
        if self.strict and aligned > base:
            # The row's claim, before anything changes: every slot the request offers (the new leaf's and
            # the duplicates freed below) is allocated, not a tree node's, named once, in whole pages.
            self.token_to_kv_pool_allocator.check_claimable(values, what=f"request {req.rid!r}")
        prefix_len, last, freed = self.resume_insert(upper, ids, values, base, req.priority, chunked)
        return rp, base, prefix_len, last, upper, freed

    def resume_unfinished(self, req: Req, chunked: bool) -> bool:
        """Cache ``req``'s committed prefix from its locked node; False (nothing changed) when that is not proven.

        Call it after ``check_req``.  Same answers, tree, fields, events, frees and
        free-list order as the backend's whole-prefix path.
        """
        done = self._resume_insert_row(req, chunked)
        if done is None:
            return False
        rp, base, prefix_len, last, upper, freed = done
        kv = req.kv
        if not freed:
            self.free_kv_row(kv, [(base, prefix_len)])
        node = req.last_node
        committed = kv.kv_committed_len
        aligned = floor_align(committed, self.page_size)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        self.resume_stamp(last)
        below, slots = path_below(rp, node, last, aligned)
        if prefix_len > base:
            # The tree's slots where the request held duplicates (SGLang's row write; the rest is the row's own).
            row[base:prefix_len] = slots[base:prefix_len]
        old = req.lock
        if old is not None:
            old.released = True
        # As SGLang's dec_lock_ref(last_node) + inc_lock_ref(new node): the path above stays locked.
        delta = sum(len(x.key) for x in upper if x.lock_ref == 1) + self.resume_lock(below)
        req.lock = LockResult(delta=delta)
        req.last_node = last
        if aligned < committed:
            req.prefix_indices = torch.cat([slots[:aligned], row[aligned:committed].to(torch.int64)])
        else:
            req.prefix_indices = slots[:aligned]
        kv.cache_protected_len = aligned
        rp.node, rp.length, rp.slots = last, aligned, slots
        return True

    def resume_finished(self, req: Req) -> bool:
        """``cache_finished_req(req)`` (an insert) from the locked node: the insert of only what the request
        added, the duplicates and the unaligned tail freed, the lock given back; False (nothing changed) when
        the precondition is not proven.  Call it after ``check_req``."""
        done = self._resume_insert_row(req, False)
        if done is None:
            return False
        _, base, prefix_len, _, _, freed = done
        kv = req.kv
        committed = kv.kv_committed_len
        aligned = floor_align(committed, self.page_size)
        if not freed:
            # Duplicates of what the tree already held, then the unaligned tail: one free, as SGLang's.
            self.free_kv_row(kv, [(base, prefix_len), (aligned, committed)])
        elif committed > aligned:
            self.free_kv_row(kv, [(aligned, committed)])
        self.release_req_lock(req)
        return True

    def resume_point(self, kv: ReqKvInfo) -> ResumePoint | None:
        """The resume point this tree keeps for the row of the record ``kv``, or None."""
        return self.resume_points.get(kv.req_pool_idx)  # type: ignore[arg-type]

    def keep_resume_point(self, req: Req, slots: torch.Tensor) -> None:
        """The next chunk of ``req`` may resume from its locked node: ``slots[:cache_protected_len]`` are the
        tree's slots of its path (the buffer is kept, not copied; positions below that are never written)."""
        kv = req.kv
        self.resume_points[kv.req_pool_idx] = ResumePoint(  # type: ignore[index]
            req.last_node, kv.cache_protected_len, slots)

    def forget_resume_point(self, kv: ReqKvInfo) -> None:
        """Drop the resume point of the record's row (its lock went back, or the whole-prefix path proved nothing)."""
        self.resume_points.pop(kv.req_pool_idx, None)  # type: ignore[arg-type]

    def release_req_lock(self, req: Req) -> None:
        """The lock's release, and with it the resume point that names the lock's node."""
        self.forget_resume_point(req.kv)
        super().release_req_lock(req)  # type: ignore[misc]

    def note_resume_point(self, req: Req, indices: torch.Tensor) -> None:
        """After the whole-prefix path: ``indices`` are the tree's slots of ``[0, cache_protected_len)``."""
        n = int(indices.numel())
        kv = req.kv
        if n == 0 or n != kv.cache_protected_len or req.last_node is None:
            self.forget_resume_point(kv)
            return
        slots = torch.empty((2 * n,), dtype=torch.int64, device=indices.device)
        slots[:n] = indices
        self.keep_resume_point(req, slots)

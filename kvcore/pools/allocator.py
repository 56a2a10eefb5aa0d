"""Token-slot allocator: SGLang's free-list order, its paged batch rule, ownership claims.

The parts live in their own modules and are re-exported here: the free-page ring
(:mod:`kvcore.pools.free_pages`), the ownership claims (:mod:`kvcore.pools.claims`),
the argument checks (:mod:`kvcore.pools.alloc_args`), the batch slot rule
(:mod:`kvcore.pools.batch_alloc`) and the row pieces (:mod:`kvcore.pools.row_segments`),
all over one array form chosen at construction (:mod:`kvcore.pools.array_ops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore.pools.alloc_args import (
    Lens,
    SlotRequest,
    check_decode,
    check_extend,
    check_need_size,
    checked_count,
    host_lens,
)
from kvcore.pools.array_ops import Array, ArrayOps, ops_for
from kvcore.pools.batch_alloc import decode_slots, extend_slots
from kvcore.pools.claims import SlotClaims, SlotOwnership
from kvcore.pools.free_pages import FreePageRing
from kvcore.pools.row_segments import split_row_segments, trim_row_segments
from kvcore.pools.views import PoolView

__all__ = [
    "Lens",
    "SlotClaims",
    "TokenToKVPoolAllocator",
    "checked_count",
    "split_row_segments",
    "trim_row_segments",
]


class TokenToKVPoolAllocator:
    """Hands out token slots (whole pages when ``page_size > 1``).

    Page 0 is padding and never handed out, so slot ids lie in
    ``[page_size, size + page_size)``.  The free list has SGLang's order with
    ``need_sort=False`` (take from the front, give back at the end), but lives in
    a fixed ring buffer so alloc and free cost O(slots moved), not O(pool size).

    ``array_ops`` picks the array form (default: numpy views on the CPU, torch
    elsewhere); ``pages`` is the free-page ring, ``claims`` the ownership record.
    """

    def __init__(
        self, size: int, page_size: int = 1, device: str | torch.device = "cpu", *, array_ops: ArrayOps | None = None
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size={page_size} must be positive")
        if size <= 0 or size % page_size:
            raise ValueError(f"size={size} must be positive and a multiple of page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.device = device
        self._torch_device = torch.device(device)
        self.num_pages = size // page_size
        self.ops = array_ops if array_ops is not None else ops_for(device)
        self.pages = FreePageRing(self.num_pages, page_size, self.ops, device)
        self.claims = SlotOwnership(self.pages, device)
        self._group: list[torch.Tensor] | None = None
        self._rep_group: list[Array] = []

    # ---- state -------------------------------------------------------------

    def clear(self) -> None:
        self.pages.clear()
        self.claims.clear()
        self._group = None
        self._rep_group = []

    def available_size(self) -> int:
        return self.pages.count * self.page_size

    def free_slots(self) -> torch.Tensor:
        return self.ops.tensor(self.pages.expand(self.pages.peek(self.pages.count)))

    @property
    def in_free_group(self) -> bool:
        """Between ``free_group_begin`` and ``free_group_end``: frees are checked now, applied at the end."""
        return self._group is not None

    # ---- arguments ---------------------------------------------------------

    def as_slots(self, indices: Any) -> torch.Tensor:
        """``indices`` (a tensor or a sequence) as an int64 slot tensor on this pool's device."""
        if type(indices) is torch.Tensor and indices.dtype is torch.int64 and indices.dim() == 1 \
                and indices.device == self._torch_device:
            return indices  # the common case: a slot tensor of this pool (one .to() call costs as much)
        if not isinstance(indices, torch.Tensor):
            indices = list(indices)
            if not indices:
                return torch.empty(0, dtype=torch.int64, device=self.device)
            indices = torch.as_tensor(indices)
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ValueError(f"slot indices must be integers, got dtype {indices.dtype}")
        return indices.reshape(-1).to(device=self.device, dtype=torch.int64)

    def check_in_range(self, slots: torch.Tensor) -> None:
        """ValueError unless every slot is in ``[page_size, size + page_size)`` (not padding)."""
        if slots.numel():
            self.pages.check_range(self.ops.view(self.as_slots(slots)))

    def check_free(self, slots: torch.Tensor) -> None:
        """ValueError, changing nothing, unless ``free(slots)`` would succeed now."""
        if slots.numel():
            s = self.ops.view(self.as_slots(slots))
            self.pages.checked_pages(s)
            self.claims.check_unclaimed(s)

    # ---- ownership by a cache ----------------------------------------------

    def check_claimable(self, slots: torch.Tensor, *, commit: bool = False, what: str = "insert") -> None:
        """Raise ValueError, changing nothing, unless every slot may become a cache's own.

        A claimable slot is in range (not padding), handed out (not in the free
        list), named once, and not already claimed by a cache (another tree node).
        With ``commit`` the slots are claimed too: ``disown`` gives them up.
        """
        self.claims.check_claimable(self.ops.view(self.as_slots(slots)), commit=commit, what=what)

    def claim(self, slots: torch.Tensor, *, checked: bool = True) -> None:
        """Mark ``slots`` as a cache's own (``check_claimable(commit=True)``, or unchecked with ``checked=False``)."""
        if checked:
            self.check_claimable(slots, commit=True)
        else:
            self.claims.claim_unchecked(self.ops.view(self.as_slots(slots)))

    def disown(self, slots: torch.Tensor) -> None:
        """A cache gives up ``slots`` (before freeing them); ids outside the pool are ignored."""
        self.claims.disown(self.ops.view(self.as_slots(slots)))

    def free_and_claim(self, value: torch.Tensor, lo: int, mid: int, hi: int, cuts: Sequence[int] = (), *,
                       claim: bool) -> torch.Tensor | None:
        """A tree insert's pool work in one call, when it is simple: ``value[lo:mid]`` freed (the
        caller's duplicates of what the tree holds) and, with ``claim``, ``value[mid:hi]`` claimed
        (the new leaf's slots), when ``value[lo:hi]`` (non-empty, page-aligned positions) is one
        ascending run of whole pages in range, none of it free or claimed: one range check and a
        slice per map.  Paged, the freed part goes back as one ``free_segment`` per piece ending at
        each of ``cuts`` (ascending, the last one ``mid``), in order, as SGLang frees a path node by
        node; at page 1 a free appends, so one piece leaves the same order.

        Returns the new leaf's own copy of ``value[mid:hi]`` (made in the pool's array form: on the
        CPU a numpy copy, cheaper than a torch one), or None, changing nothing, otherwise (or inside
        a free group): the caller then takes the general path (``check_claimable``, ``free``), which
        names what is wrong.
        """
        if self._group is not None:
            return None
        ops = self.ops
        s = ops.view(value)
        a0 = self.claims.run_claimable(s[lo:hi])
        if a0 < 0:
            return None
        if claim:
            self.claims.claim_run(a0 + mid - lo, hi - mid)
        if mid > lo:
            p = self.page_size
            if p == 1 or len(cuts) < 2:
                counts: Sequence[int] = ((mid - lo) // p,)
            else:
                counts = [(end - start) // p for start, end in zip([lo, *cuts[:-1]], cuts)]
            self.pages.release_run(s[lo:mid] if p == 1 else self.pages.page_ids(s[lo:mid:p]), counts)
        return ops.tensor(ops.copy(s[mid:hi]))

    def claimed_slots(self) -> torch.Tensor:
        """Every slot a cache claimed and has not disowned, ascending."""
        claimed = self.claims.claimed()
        if claimed is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self.ops.tensor(claimed)

    # ---- alloc / free ------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        k = check_need_size(need_size, self.page_size) // self.page_size
        if k > self.pages.count:
            return None
        pages = self.pages.peek(k)
        self.pages.pop(pages)
        return self.ops.tensor(self.pages.expand(pages))

    def free(self, free_index: Any) -> None:
        slots = self.as_slots(free_index)
        if slots.numel() == 0:
            return
        if self._group is not None:
            # Checked now for an early error; the caller may reuse its tensor, so keep a copy.
            self.check_free(slots)
            self._group.append(slots.clone())
            return
        self.release(slots)

    def release(self, slots: torch.Tensor) -> Array:
        """``free`` of a non-empty int64 slot tensor outside a free group; returns the pages given back
        (distinct, of this pool's array form): what a pool mapped onto this one frees alongside."""
        s = self.ops.view(slots)
        self.claims.check_unclaimed(s)
        return self.pages.release(s)

    def free_segment(self, free_index: Any, *, start_pos: int = 0) -> None:
        """Free ``row[start_pos : start_pos + n]`` of one request (or a page-aligned tree value).

        SGLang's ``free_segment``: with ``page_size > 1`` the pages go back in row order
        (not sorted as ``free`` does), so later allocations get the same slots.
        """
        slots = self.as_slots(free_index)
        if slots.numel() == 0:
            return
        if self.page_size == 1:
            self.free(slots)
            return
        s = self.ops.view(slots)
        self.pages.check_range(s)
        self.claims.check_unclaimed(s)
        pages = self.pages.segment_pages(s, start_pos)
        if self._group is not None:
            self.pages.checked_page_ids(pages)
            self._rep_group.append(self.ops.copy(pages))
            return
        self.pages.push(self.pages.checked_page_ids(pages, commit=True))

    def free_segments(self, segments: Sequence[tuple[Any, int]]) -> None:
        """Free ascending, disjoint ``(slots, start_pos)`` pieces of one request's row.

        SGLang's ``free_segments``: a page shared by consecutive pieces goes back once,
        each piece as one ``free_segment`` (so, paged, the later piece ends up in front).
        Checked as a whole first: on a bad slot nothing is freed.
        """
        p = self.page_size
        pieces = trim_row_segments([(self.as_slots(f), start) for f, start in segments], p)
        if not pieces:
            return
        if len(pieces) == 1:
            self.free_segment(pieces[0][0], start_pos=pieces[0][1])
            return
        if p == 1:
            self.free(torch.cat([sl for sl, _ in pieces]))
            return
        views = [(self.ops.view(sl), st) for sl, st in pieces]
        for s, _ in views:
            self.pages.check_range(s)
            self.claims.check_unclaimed(s)
        pages = [self.pages.segment_pages(s, st) for s, st in views]
        if self._group is not None:
            self.pages.checked_page_ids(self.ops.cat(pages))
            self._rep_group.extend(self.ops.copy(pg) for pg in pages)
            return
        self.pages.checked_page_ids(self.ops.cat(pages), commit=True)
        for pg in pages:
            self.pages.push(pg)

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None:
        """Free ascending ``(slots, start_pos)`` pieces of one request's row, in SGLang's page order.

        This pool has no window side, so no piece may lie in ``[swa_dead_lo, swa_evicted_seqlen)``.
        """
        dead, alive = split_row_segments(segments, dead_lo=swa_dead_lo, dead_hi=swa_evicted_seqlen)
        if dead:
            raise ValueError(
                f"row positions in [{swa_dead_lo}, {swa_evicted_seqlen}) were window-evicted, "
                f"but {type(self).__name__} has no window pool"
            )
        if alive:
            self.free_segments(alive)

    def pool_views(self) -> list[PoolView]:
        """This allocator is one pool: ``full``."""
        return [PoolView("full", self)]

    def free_group_begin(self) -> None:
        self._group = []
        self._rep_group = []

    def free_group_end(self) -> None:
        pending, self._group = self._group, None
        reps, self._rep_group = self._rep_group, []
        if pending:
            self.free(torch.cat(pending))
        if reps:
            # SGLang releases a group's segment pages after its plain frees, in one block.
            self.pages.push(self.pages.checked_page_ids(self.ops.cat(reps), commit=True))

    # ---- batched paged allocation (SGLang's alloc_extend / alloc_decode) ----

    def num_new_pages_extend(self, prefix_lens_cpu: Lens, seq_lens_cpu: Lens) -> int:
        p = self.page_size
        pre, seq = host_lens(prefix_lens_cpu, "prefix_lens_cpu"), host_lens(seq_lens_cpu, "seq_lens_cpu")
        return sum(-(-b // p) for b in seq) - sum(-(-a // p) for a in pre)

    def num_new_pages_decode(self, seq_lens_cpu: Lens) -> int:
        # The new token sits at seq_len - 1; a page starts there iff that is aligned.
        return sum(1 for b in host_lens(seq_lens_cpu, "seq_lens_cpu") if (b - 1) % self.page_size == 0)

    def alloc_extend(
        self,
        prefix_lens: Lens,
        prefix_lens_cpu: Lens,
        seq_lens: Lens,
        seq_lens_cpu: Lens,
        last_loc: Lens,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        req = check_extend(self.pages, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                           extend_num_tokens, num_new_pages)
        if self.page_size == 1:
            return self.alloc(extend_num_tokens)
        return self.alloc_checked(req)

    def alloc_decode(self, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.alloc(len(host_lens(seq_lens_cpu, "seq_lens_cpu")))
        return self.alloc_checked(check_decode(self.pages, seq_lens, seq_lens_cpu, last_loc))

    def alloc_checked(self, req: SlotRequest) -> torch.Tensor | None:
        """The slots of a batch call checked on this pool (:mod:`kvcore.pools.alloc_args`), or None when short."""
        if req.num_new_pages > self.pages.count:
            return None
        pages = self.pages.peek(req.num_new_pages)
        out = decode_slots(self.pages, pages, req) if req.decode else extend_slots(self.pages, pages, req)
        self.pages.pop(pages)
        return self.ops.tensor(out)

"""Hybrid allocator: full-attention slots paired with sliding-window slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore.pools.alloc_args import Lens, SlotRequest, check_decode, check_extend, check_need_size, host_lens
from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.array_ops import Array, ops_for
from kvcore.pools.row_segments import split_row_segments, trim_row_segments
from kvcore.pools.views import PoolView

__all__ = ["SWATokenToKVPoolAllocator"]


class SWATokenToKVPoolAllocator:
    """A full pool and a window pool joined by ``full_to_swa_index_mapping`` (0 = no window slot).

    The window side of a slot can die first (``free_swa``); ``free_full`` then
    returns the full side alone.
    """

    def __init__(
        self, size: int, size_swa: int, page_size: int = 1, device: str | torch.device = "cpu"
    ) -> None:
        self.page_size = page_size
        self.device = device
        # Both sides and the map in one array form, chosen here (numpy views on the CPU).
        self.ops = ops_for(device)
        self.full_attn_allocator = TokenToKVPoolAllocator(size, page_size, device, array_ops=self.ops)
        self.swa_attn_allocator = TokenToKVPoolAllocator(size_swa, page_size, device, array_ops=self.ops)
        # One extra trailing -1 so a last_loc of -1 (empty prefix) translates to -1.
        self._mapping = torch.zeros(size + page_size + 1, dtype=torch.int64, device=device)
        self._mapping[-1] = -1
        self.full_to_swa_index_mapping = self._mapping[:-1]
        self._map_native = self.ops.view(self._mapping)
        self.clear()

    @property
    def size(self) -> int:
        return min(self.size_full, self.size_swa)

    @property
    def size_full(self) -> int:
        return self.full_attn_allocator.size

    @property
    def size_swa(self) -> int:
        return self.swa_attn_allocator.size

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping.zero_()
        self._group: list[torch.Tensor] | None = None
        self._swa_group: list[Array] = []
        self._full_group: list[torch.Tensor] = []

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def full_free_slots(self) -> torch.Tensor:
        return self.full_attn_allocator.free_slots()

    def swa_free_slots(self) -> torch.Tensor:
        return self.swa_attn_allocator.free_slots()

    def translate_loc_from_full_to_swa(self, indices: Any) -> torch.Tensor:
        return self.ops.tensor(self._translated(self.ops.view(self.full_attn_allocator.as_slots(indices))))

    def _translated(self, slots: Array) -> Array:
        """Window ids of full ``slots`` (native); -1 (an empty prefix's last_loc) maps to -1."""
        n = len(self._map_native) - 1
        if len(slots) and self.ops.any_outside(slots, -1, n):
            bad = slots[(slots < -1) | (slots >= n)]
            raise ValueError(f"full slot {int(bad[0])} is outside the pool (slots 0..{n - 1})")
        return self._map_native[slots]

    # ---- alloc -------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        need_size = check_need_size(need_size, self.page_size)
        if need_size > self.available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
        assert full is not None and swa is not None
        self._map(full, swa)
        return full

    def alloc_extend(
        self,
        prefix_lens: Lens,
        prefix_lens_cpu: Lens,
        seq_lens: Lens,
        seq_lens_cpu: Lens,
        last_loc: Lens,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        req = check_extend(self.full_attn_allocator.pages, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                           last_loc, extend_num_tokens)
        if self.page_size == 1:
            return self.alloc(extend_num_tokens)
        return self._alloc_both(req)

    def alloc_decode(self, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.alloc(len(host_lens(seq_lens_cpu, "seq_lens_cpu")))
        return self._alloc_both(check_decode(self.full_attn_allocator.pages, seq_lens, seq_lens_cpu, last_loc))

    def _alloc_both(self, req: SlotRequest) -> torch.Tensor | None:
        """A checked batch call on both sides; None (nothing taken) unless both have the pages."""
        # Check both sides first: SGLang allocates one side before learning the other is short.
        if req.num_new_pages * self.page_size > self.available_size():
            return None
        window = self.swa_attn_allocator
        swa_req = req.on(window.pages, self._translated(req.last_loc))
        full = self.full_attn_allocator.alloc_checked(req)
        swa = window.alloc_checked(swa_req)
        assert full is not None and swa is not None
        self._map(full, swa)
        return full

    def _map(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """Point the full slots at their window slots."""
        self._map_native[self.ops.view(full)] = self.ops.view(swa)

    # ---- ownership by a cache (full-side slot ids) ---------------------------

    def check_claimable(self, slots: torch.Tensor, *, commit: bool = False, what: str = "insert") -> None:
        """``TokenToKVPoolAllocator.check_claimable`` on the full side."""
        self.full_attn_allocator.check_claimable(slots, commit=commit, what=what)

    def claim(self, slots: torch.Tensor, *, checked: bool = True) -> None:
        self.full_attn_allocator.claim(slots, checked=checked)

    def disown(self, slots: torch.Tensor) -> None:
        self.full_attn_allocator.disown(slots)

    def claimed_slots(self) -> torch.Tensor:
        return self.full_attn_allocator.claimed_slots()

    # ---- free --------------------------------------------------------------

    def free(self, free_index: Any) -> None:
        """Full side and (where still mapped) window side."""
        slots = self._now_or_in_group(free_index, self._group)
        if slots is not None:
            # The full side checks range and double frees; the window slots are then the ones
            # this allocator mapped to those full slots, so they need no second check.
            self._free_mapped_window(self.full_attn_allocator.release(slots))

    def _now_or_in_group(self, free_index: Any, pending: list[torch.Tensor] | None) -> torch.Tensor | None:
        """The full slots of a free to apply now, or None: none given, or checked and kept in
        ``pending`` until the free group ends (the caller may reuse its tensor: a copy)."""
        full = self.full_attn_allocator
        slots = full.as_slots(free_index)
        if slots.numel() == 0:
            return None
        if self._group is not None:
            assert pending is not None
            full.check_free(slots)
            pending.append(slots.clone())
            return None
        return slots

    def free_segments(self, segments: Sequence[tuple[Any, int]]) -> None:
        """Free ascending ``(slots, start_pos)`` pieces of one row, each as a ``free``.

        As SGLang's base allocator does for its SWA pool: a page shared by two pieces
        goes back once, with the earlier piece.  Every piece is checked before any is freed.
        """
        full = self.full_attn_allocator
        pieces = trim_row_segments([(full.as_slots(f), start) for f, start in segments], self.page_size)
        if len(pieces) > 1:
            full.check_free(torch.cat([slots for slots, _ in pieces]))
        for slots, _ in pieces:
            self.free(slots)

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None:
        """Free ascending ``(slots, start_pos)`` pieces of one request's row.

        Positions in ``[swa_dead_lo, swa_evicted_seqlen)`` lost their window side
        while decoding, so only the full side goes back there; elsewhere both do,
        piece by piece in row order (SGLang's page order, so later allocations match).
        Positions below ``swa_dead_lo`` (a prefix the floor kept out of window
        eviction) still hold their window slots.
        """
        dead, alive = split_row_segments(segments, dead_lo=swa_dead_lo, dead_hi=swa_evicted_seqlen)
        if dead:
            if alive and swa_evicted_seqlen % self.page_size:
                # A page shared by the dead and alive sides would go back twice.
                raise ValueError(f"window cursor {swa_evicted_seqlen} splits a page (page_size {self.page_size})")
            self.free_full(dead[0] if len(dead) == 1 else torch.cat(dead))
        if alive:
            self.free_segments(alive)

    def pool_views(self) -> list[PoolView]:
        """Two pools: ``full``, and ``swa`` (the window side, reached through the full-to-window map)."""
        return [
            PoolView("full", self.full_attn_allocator),
            PoolView("swa", self.swa_attn_allocator, translate=self.translate_loc_from_full_to_swa, windowed=True),
        ]

    def free_full(self, free_index: Any) -> None:
        """Full side only: the caller already released the window side."""
        slots = self._now_or_in_group(free_index, self._full_group)
        if slots is not None:
            self.full_attn_allocator.free(slots)

    def free_swa(self, free_index: Any) -> None:
        """Window side only; full slots without a window slot are skipped."""
        full = self.full_attn_allocator
        slots = full.as_slots(free_index)
        if slots.numel() == 0:
            return
        p = self.page_size
        s = self.ops.view(slots)
        if self.ops.any_outside(s, 0, full.size + p):
            lo, hi = int(s.min()), int(s.max())
            raise ValueError(f"slot {lo if lo < 0 else hi} is out of range: full slots are [{p}, {full.size + p})")
        ring = full.pages
        if p > 1:
            s = ring.expand(self.ops.unique(ring.page_ids(s)))
        swa = self._map_native[s]
        swa = swa[swa > 0]
        if self._group is not None:
            # Resolve ownership now: a later action in the group may remap these full slots.
            if len(swa):
                self.swa_attn_allocator.pages.checked_pages(swa)
            self._swa_group.append(swa)
        elif len(swa):
            self.swa_attn_allocator.pages.release(swa)
        # Cleared only after the free succeeded, so an error changes nothing.
        self._map_native[s] = 0

    def _free_mapped_window(self, pages: Array) -> None:
        """Window side of the full ``pages`` (distinct) that the full side has just checked and freed."""
        p = self.page_size
        slots = self.full_attn_allocator.pages.expand(pages)
        swa = self._map_native[slots]
        swa = swa[swa > 0]
        if len(swa):
            window = self.swa_attn_allocator.pages
            window.push_owned(swa if p == 1 else self.ops.unique(window.page_ids(swa)))
        self._map_native[slots] = 0

    def free_group_begin(self) -> None:
        self._group = []
        self._swa_group = []
        self._full_group = []

    def free_group_end(self) -> None:
        pending, self._group = self._group, None
        swa_pending, self._swa_group = self._swa_group, []
        full_pending, self._full_group = self._full_group, []
        if pending:
            self.free(torch.cat(pending))
        if swa_pending:
            swa = self.ops.cat(swa_pending)
            if len(swa):
                self.swa_attn_allocator.pages.release(swa)
        if full_pending:
            self.full_attn_allocator.free(torch.cat(full_pending))

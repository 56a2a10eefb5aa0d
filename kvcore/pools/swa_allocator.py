"""Hybrid allocator: full-attention slots paired with sliding-window slots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvcore.pools.allocator import (
    Lens,
    TokenToKVPoolAllocator,
    _cpu_lens,
    _np_lens,
    checked_count,
    split_row_segments,
    trim_row_segments,
)
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
        self.full_attn_allocator = TokenToKVPoolAllocator(size, page_size, device)
        self.swa_attn_allocator = TokenToKVPoolAllocator(size_swa, page_size, device)
        # One extra trailing -1 so a last_loc of -1 (empty prefix) translates to -1.
        self._mapping = torch.zeros(size + page_size + 1, dtype=torch.int64, device=device)
        self._mapping[-1] = -1
        self.full_to_swa_index_mapping = self._mapping[:-1]
        # On the CPU the free path reads and clears the map through a numpy view (cheaper per op).
        self._mapping_np = self._mapping.numpy() if torch.device(device).type == "cpu" else None
        p = page_size
        self._offsets_np = np.arange(p, dtype=np.int64)
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
        self._swa_group: list[torch.Tensor] = []
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
        slots = self.full_attn_allocator._as_slots(indices)
        try:
            return self._mapping[slots]  # -1 (an empty prefix's last_loc) maps to -1
        except IndexError:
            bad = slots[slots >= self._mapping.numel() - 1]
            raise ValueError(
                f"full slot {int(bad[0])} is outside the pool (slots 0..{self._mapping.numel() - 2})"
            ) from None

    # ---- alloc -------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        need_size = checked_count(need_size, "need_size")
        if need_size < 0 or need_size % self.page_size:
            raise ValueError(f"need_size={need_size} must be >= 0 and a multiple of page_size={self.page_size}")
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
        if self.page_size == 1:
            return self.alloc(extend_num_tokens)
        n = self.full_attn_allocator.num_new_pages_extend(prefix_lens_cpu, seq_lens_cpu)
        if n * self.page_size > self.available_size():
            return None
        swa_last_loc = self._translate_last_loc(last_loc)
        full = self.full_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, n
        )
        swa = self.swa_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, swa_last_loc, extend_num_tokens, n
        )
        assert full is not None and swa is not None
        self._map(full, swa)
        return full

    def _translate_last_loc(self, last_loc: Lens) -> torch.Tensor:
        """``translate_loc_from_full_to_swa`` of last_loc (numpy on the CPU when every id is in [-1, size))."""
        mapping = self._mapping_np
        if mapping is not None:
            la = _np_lens(last_loc)
            if la is not None and (la.size == 0 or (la.min() >= -1 and la.max() < mapping.size - 1)):
                return torch.from_numpy(mapping[la])
        return self.translate_loc_from_full_to_swa(last_loc)

    def _map(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """Point the full slots at their window slots."""
        if self._mapping_np is not None and full.device.type == "cpu" and swa.device.type == "cpu":
            self._mapping_np[full.numpy()] = swa.numpy()
        else:
            self.full_to_swa_index_mapping[full] = swa

    def alloc_decode(self, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> torch.Tensor | None:
        if self.page_size == 1:
            return self.alloc(_cpu_lens(seq_lens_cpu).numel())
        # Check both sides first: SGLang allocates one side before learning the other is short.
        n = self.full_attn_allocator.num_new_pages_decode(seq_lens_cpu)
        if n * self.page_size > self.available_size():
            return None
        swa_last_loc = self._translate_last_loc(last_loc)
        full = self.full_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, swa_last_loc)
        assert full is not None and swa is not None
        self._map(full, swa)
        return full

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
        full = self.full_attn_allocator
        slots = full._as_slots(free_index)
        if slots.numel() == 0:
            return
        if self._group is not None:
            full._checked_pages(slots)
            self._group.append(slots.clone())
            return
        # The full side checks range and double frees; the window slots are then the ones
        # this allocator mapped to those full slots, so they need no second check.
        if self._mapping_np is not None:
            s = full._np_slots(slots)
            if s is not None:
                pages = full._checked_pages_np(s, commit=True)
                if pages is not None:
                    full._push_np(pages)
                    self._free_mapped_window_np(pages)
                    return
        full.free(slots)
        self._free_mapped_window(slots)

    def free_segments(self, segments: Sequence[tuple[Any, int]]) -> None:
        """Free ascending ``(slots, start_pos)`` pieces of one row, each as a ``free``.

        As SGLang's base allocator does for its SWA pool: a page shared by two pieces
        goes back once, with the earlier piece.  Every piece is checked before any is freed.
        """
        full = self.full_attn_allocator
        pieces = trim_row_segments([(full._as_slots(f), start) for f, start in segments], self.page_size)
        if len(pieces) > 1:
            full._checked_pages(torch.cat([slots for slots, _ in pieces]))
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
        full = self.full_attn_allocator
        slots = full._as_slots(free_index)
        if slots.numel() == 0:
            return
        if self._group is not None:
            full._checked_pages(slots)
            self._full_group.append(slots.clone())
            return
        full.free(slots)

    def free_swa(self, free_index: Any) -> None:
        """Window side only; full slots without a window slot are skipped."""
        full = self.full_attn_allocator
        slots = full._as_slots(free_index)
        if slots.numel() == 0:
            return
        p = self.page_size
        fast = self._mapping_np is not None and self._group is None and full._page_shift >= 0
        s = full._np_slots(slots) if fast else None
        if s is not None:
            if s.view(np.uint64).max() >= full.size + p:  # a negative id becomes huge: one max bounds both ends
                lo, hi = int(s.min()), int(s.max())
                raise ValueError(f"slot {lo if lo < 0 else hi} is out of range: full slots are [{p}, {full.size + p})")
            self._free_swa_np(s)
            return
        lo, hi = (int(v) for v in torch.aminmax(slots))
        if lo < 0 or hi >= full.size + p:
            raise ValueError(f"slot {lo if lo < 0 else hi} is out of range: full slots are [{p}, {full.size + p})")
        if p > 1:
            slots = full._expand(torch.unique(slots // p))
        swa = self.full_to_swa_index_mapping[slots]
        swa = swa[swa > 0]
        if self._group is not None:
            # Resolve ownership now: a later action in the group may remap these full slots.
            if swa.numel():
                self.swa_attn_allocator._checked_pages(swa)
            self._swa_group.append(swa)
        else:
            self.swa_attn_allocator.free(swa)
        # Cleared only after the free succeeded, so an error changes nothing.
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def _free_mapped_window(self, slots: torch.Tensor) -> None:
        """Window side of full ``slots`` that the full side has just checked and freed."""
        p = self.page_size
        if p > 1:
            slots = self.full_attn_allocator._expand(torch.unique(self.full_attn_allocator._page_ids(slots)))
        swa = self.full_to_swa_index_mapping[slots]
        swa = swa[swa > 0]
        if swa.numel():
            window = self.swa_attn_allocator
            window._push_owned_pages(swa if p == 1 else torch.unique(window._page_ids(swa)))
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def _free_swa_np(self, s: np.ndarray) -> None:
        """``free_swa`` outside a free group through numpy views (``s``: full slots, in range)."""
        mapping = self._mapping_np
        assert mapping is not None
        p = self.page_size
        window = self.swa_attn_allocator
        if p > 1:
            pages = self.full_attn_allocator._sorted_pages_np(s)
            assert pages is not None
            s = (pages[:, None] * p + self._offsets_np).reshape(-1)
        swa = mapping[s]
        swa = swa[swa > 0]
        if swa.size:
            pushed = window._checked_pages_np(swa, commit=True)
            if pushed is None:  # a bad window slot: the torch path names it, changing nothing
                window.free(torch.from_numpy(swa))
                raise AssertionError("unreachable: the window free above raises")
            window._push_np(pushed)
        # Cleared only after the free succeeded, so an error changes nothing.
        mapping[s] = 0

    def _free_mapped_window_np(self, pages: np.ndarray) -> None:
        """``_free_mapped_window`` through numpy views, given the full side's freed pages (sorted, distinct)."""
        mapping = self._mapping_np
        assert mapping is not None
        p = self.page_size
        slots = pages if p == 1 else (pages[:, None] * p + self._offsets_np).reshape(-1)
        swa = mapping[slots]
        swa = swa[swa > 0]
        if swa.size:
            window = self.swa_attn_allocator
            if p > 1:
                swa = window._sorted_pages_np(swa)
                assert swa is not None  # same page size as the full side, a power of two
            assert window._free_np is not None
            window._free_np[swa] = 1
            window._push_np(swa)
        mapping[slots] = 0

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
            self.swa_attn_allocator.free(torch.cat(swa_pending))
        if full_pending:
            self.full_attn_allocator.free(torch.cat(full_pending))

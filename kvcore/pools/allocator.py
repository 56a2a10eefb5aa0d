"""Token-slot allocator: SGLang's free-list order, kept in a ring buffer."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

import numpy as np
import torch

from kvcore.pools.views import PoolView

__all__ = ["SlotClaims", "TokenToKVPoolAllocator", "checked_count", "split_row_segments", "trim_row_segments"]

Lens = torch.Tensor | Sequence[int]


def _cpu_lens(x: Lens) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
    return torch.as_tensor(list(x), dtype=torch.int64).reshape(-1)


def _np_lens(x: Any) -> np.ndarray | None:
    """``x`` as a 1-D int64 numpy array when it is a CPU integer tensor or a list of ints, else None."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool \
                or x.requires_grad:
            return None
        try:
            a = x.numpy()
        except (TypeError, RuntimeError):
            return None
        return a.astype(np.int64, copy=False).reshape(-1)
    if isinstance(x, (list, tuple)) and all(type(v) is int for v in x):
        return np.array(x, dtype=np.int64)
    return None


def checked_count(value: Any, what: str) -> int:
    """``value`` as an int (anything with ``__index__``), or TypeError naming ``what``; bools are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} ({value!r})") from None


def trim_row_segments(segments: Sequence[tuple[torch.Tensor, int]], page_size: int) -> list[tuple[torch.Tensor, int]]:
    """Drop empty ``(slots, start_pos)`` pieces and trim a piece's head page when the
    piece before it already ends in that page, so a shared page is freed once."""
    pieces: list[tuple[torch.Tensor, int]] = []
    prev_end = None
    for slots, start in segments:
        n = slots.numel()
        if n == 0:
            continue
        end = start + n
        if prev_end is not None and start // page_size == (prev_end - 1) // page_size:
            boundary = (start // page_size + 1) * page_size
            slots = slots[boundary - start :]
            start = boundary
        prev_end = end
        if slots.numel():
            pieces.append((slots, start))
    return pieces


def split_row_segments(
    segments: Sequence[tuple[torch.Tensor, int]], *, dead_lo: int, dead_hi: int
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
    """Split ascending ``(slots, start_pos)`` pieces of one row at ``[dead_lo, dead_hi)``.

    Returns the slots inside that range (window-freed while decoding: only their
    full side is still held) and the ``(slots, start_pos)`` pieces outside it.
    """
    dead: list[torch.Tensor] = []
    alive: list[tuple[torch.Tensor, int]] = []
    for slots, start in segments:
        n = slots.numel()
        if n == 0:
            continue
        lo = min(max(dead_lo - start, 0), n)
        hi = min(max(dead_hi - start, lo), n)
        if lo:
            alive.append((slots[:lo], start))
        if hi > lo:
            dead.append(slots[lo:hi])
        if hi < n:
            alive.append((slots[hi:], start + hi))
    return dead, alive


class SlotClaims(Protocol):
    """Which slots a cache (its tree nodes) owns: what a tree backend calls under ``strict``.

    ``TokenToKVPoolAllocator`` and ``SWATokenToKVPoolAllocator`` (full-side ids) implement it.
    """

    def check_claimable(self, slots: torch.Tensor, *, commit: bool = False, what: str = "insert") -> None: ...

    def claim(self, slots: torch.Tensor, *, checked: bool = True) -> None: ...

    def disown(self, slots: torch.Tensor) -> None: ...

    def claimed_slots(self) -> torch.Tensor: ...


class TokenToKVPoolAllocator:
    """Hands out token slots (whole pages when ``page_size > 1``).

    Page 0 is padding and never handed out, so slot ids lie in
    ``[page_size, size + page_size)``.  The free list has SGLang's order with
    ``need_sort=False`` (take from the front, give back at the end), but lives in
    a fixed ring buffer so alloc and free cost O(slots moved), not O(pool size).
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if page_size <= 0:
            raise ValueError(f"page_size={page_size} must be positive")
        if size <= 0 or size % page_size:
            raise ValueError(f"size={size} must be positive and a multiple of page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.device = device
        self._torch_device = torch.device(device)
        self.num_pages = size // page_size
        self._ring = torch.empty(self.num_pages, dtype=torch.int64, device=device)
        # Per page id: 1 when free, 0 when handed out (page 0 never is free).
        self._free_cnt = torch.zeros(self.num_pages + 1, dtype=torch.int32, device=device)
        # On the CPU the ownership check reads the maps through numpy views sharing their memory:
        # a numpy op costs a fraction of a torch op's dispatch at these sizes.
        self._on_cpu = self._torch_device.type == "cpu"
        self._free_np = self._free_cnt.numpy() if self._on_cpu else None
        self._ring_np = self._ring.numpy() if self._on_cpu else None
        self._ones = torch.ones(self.num_pages, dtype=torch.int32, device=device)
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        # Per slot id: non-zero when a cache (a tree node) owns the slot -- see claim().  Made on first use.
        self._owned: torch.Tensor | None = None
        self._owned_np: np.ndarray | None = None
        # 1, 2, 3, ... (int32) and their bytes: the CPU check writes them and reads them back.
        self._stamps = np.arange(1, 1, dtype=np.int32)
        self._stamp_bytes = b""
        self._slot_ones: torch.Tensor | None = None
        self._slot_zeros = torch.empty(0, dtype=torch.int32, device=device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # log2(page_size) when a power of two (page of a slot by one shift), else -1.
        self._page_shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        self.clear()

    # ---- state -------------------------------------------------------------

    def clear(self) -> None:
        torch.arange(1, self.num_pages + 1, out=self._ring)
        self._head = 0
        self._count = self.num_pages
        self._free_cnt.fill_(1)
        self._free_cnt[0] = 0
        self._group: list[torch.Tensor] | None = None
        self._rep_group: list[torch.Tensor] = []
        if self._owned is not None:
            self._owned.zero_()
            self._owned[: self.page_size] = 1

    def available_size(self) -> int:
        return self._count * self.page_size

    def free_slots(self) -> torch.Tensor:
        return self._expand(self._peek(self._count))

    # ---- ring buffer -------------------------------------------------------

    def _peek(self, k: int) -> torch.Tensor:
        """A copy of the first k free pages; changes nothing."""
        end = self._head + k
        if end <= self.num_pages:
            return self._ring[self._head : end].clone()
        return torch.cat((self._ring[self._head :], self._ring[: end - self.num_pages]))

    def _pop(self, pages: torch.Tensor) -> None:
        """Commit taking ``pages`` (the result of _peek) off the front."""
        k = pages.numel()
        if k:
            if self._free_np is not None:
                self._free_np[pages.numpy()] = 0
            else:
                self._free_cnt.index_fill_(0, pages, 0)
            self._head = (self._head + k) % self.num_pages
            self._count -= k

    def _push(self, pages: torch.Tensor) -> None:
        """Return pages already marked free by _checked_pages(commit=True).

        SGLang appends freed slots at the back when page_size == 1 but puts freed
        pages in front when paged; both are kept so that slot numbers agree.
        """
        k = pages.numel()
        if not k:
            return
        if self._ring_np is not None:
            self._push_np(pages.numpy())
            return
        if self.page_size > 1:
            head = (self._head - k) % self.num_pages
            first = min(k, self.num_pages - head)
            self._ring[head : head + first] = pages[:first]
            if k > first:
                self._ring[: k - first] = pages[first:]
            self._head = head
            self._count += k
            return
        tail = (self._head + self._count) % self.num_pages
        first = min(k, self.num_pages - tail)
        self._ring[tail : tail + first] = pages[:first]
        if k > first:
            self._ring[: k - first] = pages[first:]
        self._count += k

    def _push_np(self, pages: np.ndarray) -> None:
        """``_push`` through the ring's numpy view (CPU): same order, a fraction of the cost."""
        k = pages.size
        if not k:
            return
        ring = self._ring_np
        assert ring is not None
        n = self.num_pages
        if self.page_size > 1:
            head = self._head = (self._head - k) % n
            self._count += k
        else:
            head = (self._head + self._count) % n
            self._count += k
        first = min(k, n - head)
        ring[head : head + first] = pages[:first]
        if k > first:
            ring[: k - first] = pages[first:]

    def _expand(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        # offsets + page_size * page, in one fused op (a multiply and an add cost two).
        return torch.add(self._offsets, pages[:, None], alpha=self.page_size).reshape(-1)

    def _page_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """The page of every slot (a shift when page_size is a power of two)."""
        shift = self._page_shift
        if shift == 0:
            return slots
        if shift > 0:
            return slots >> shift
        return torch.div(slots, self.page_size, rounding_mode="floor")

    # ---- validation --------------------------------------------------------

    def _as_slots(self, indices: Any) -> torch.Tensor:
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

    def _checked_pages(self, slots: torch.Tensor, commit: bool = False) -> torch.Tensor:
        """Pages to give back for ``slots``; raises ValueError (changing nothing) on a bad slot.

        With ``commit`` the pages are also marked free (the caller then pushes them).
        """
        s = self._np_slots(slots)
        if s is not None:
            pages = self._checked_pages_np(s, commit)
            if pages is not None:
                return torch.from_numpy(pages)
        if self.page_size == 1:
            self._check_range(slots)
            return self._checked_page_ids(slots, commit)
        # Several slots of one page in one call are normal when paged; SGLang frees unique pages.
        # They come sorted, so the first and last bound them all: no separate min/max pass.
        pages = torch.unique(self._page_ids(slots))
        lo, hi = pages[0].item(), pages[-1].item()
        if lo < 1 or hi > self.num_pages:
            self._check_range(slots)  # raises, naming the slot
        return self._checked_page_ids(pages, commit)

    def _np_slots(self, slots: torch.Tensor) -> np.ndarray | None:
        """``slots`` as a numpy view when this pool lives on the CPU and they are a plain int64 tensor."""
        if self._free_np is None or slots.dtype is not torch.int64:
            return None
        try:
            return slots.numpy()
        except (TypeError, RuntimeError):  # a tensor that needs grad, a conjugate view, ...
            return None

    def _sorted_pages_np(self, s: np.ndarray) -> np.ndarray | None:
        """The distinct pages of slots ``s``, ascending (``torch.unique``'s order); None when not a power of two."""
        shift = self._page_shift
        if shift < 0:
            return None
        q = np.sort(s >> shift if shift else s)
        if q.size > 1:
            keep = np.empty(q.size, dtype=bool)
            keep[0] = True
            np.not_equal(q[1:], q[:-1], out=keep[1:])
            q = q[keep]
        return q

    def _stamps_for(self, k: int) -> np.ndarray:
        """1, 2, ..., k (int32): written to a map and read back, a slot named twice reads another's."""
        stamps = self._stamps
        if stamps.size < k:
            stamps = self._stamps = np.arange(1, max(k, 2 * stamps.size, 1024) + 1, dtype=np.int32)
            self._stamp_bytes = stamps.tobytes()
        return stamps[:k]

    def _checked_pages_np(self, s: np.ndarray, commit: bool) -> np.ndarray | None:
        """``_checked_pages`` through numpy views (CPU); None where it does not apply."""
        free = self._free_np
        assert free is not None
        n = self.num_pages
        if not s.size:
            return None
        if self.page_size == 1:
            # Page ids are slot ids: one unsigned max bounds both ends (1..num_pages).
            if (s - 1).view(np.uint64).max() >= n:
                return None  # the torch path names the bad slot
            if np.count_nonzero(free[s]):
                return None
            k = s.size
            free[s] = self._stamps_for(k)
            if free[s].tobytes() != self._stamp_bytes[: 4 * k]:
                free[s] = 0
                return None  # a slot named twice: the torch path names it
            free[s] = 1 if commit else 0
            return s
        pages = self._sorted_pages_np(s)
        if pages is None:
            return None
        if pages[0] < 1 or pages[-1] > n or np.count_nonzero(free[pages]):
            return None
        if commit:
            free[pages] = 1
        return pages

    def _check_range(self, slots: torch.Tensor) -> None:
        p = self.page_size
        lo, hi = (int(v) for v in torch.aminmax(slots))
        if lo < p or hi >= self.size + p:
            raise ValueError(
                f"slot {lo if lo < p else hi} is padding or out of range: valid slots are [{p}, {self.size + p})"
            )

    def _checked_page_ids(self, pages: torch.Tensor, commit: bool = False) -> torch.Tensor:
        """Check (and with ``commit`` mark free) page ids, kept in the given order."""
        k = pages.numel()
        cnt = self._free_cnt
        ones = self._ones[:k]
        # After adding one per page every count must be exactly 1: a 2 is a double free
        # or a page named twice, found in O(k) without sorting.
        cnt.index_add_(0, pages, ones)
        ok = torch.equal(cnt.index_select(0, pages), ones)
        if not ok or not commit:
            cnt.index_add_(0, pages, ones, alpha=-1)
        if not ok:
            self._raise_bad(pages)
        return pages

    def _raise_bad(self, pages: torch.Tensor) -> None:
        p = self.page_size
        already = self._free_cnt[pages] != 0
        if bool(already.any()):
            page = int(pages[already][0])
            what = f"slot {page}" if p == 1 else f"page {page} (slots {page * p}..{page * p + p - 1})"
            raise ValueError(f"{what} is already free (double free)")
        s = torch.sort(pages).values
        slot = int(s[1:][s[1:] == s[:-1]][0])
        raise ValueError(f"slot {slot} appears twice in one free (double free)")

    # ---- ownership by a cache ----------------------------------------------

    def _owner_map(self) -> torch.Tensor:
        owned = self._owned
        if owned is None:
            n = self.size + self.page_size
            owned = self._owned = torch.zeros(n, dtype=torch.int32, device=self.device)
            owned[: self.page_size] = 1  # the padding page: never claimable
            if self._on_cpu:
                self._owned_np = owned.numpy()
        return owned

    def _ones_zeros(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``k`` ones and ``k`` zeros (int32), cached: slicing costs as much as a check op."""
        views = self._views.get(k)
        if views is None:
            if len(self._views) >= 64:
                self._views.clear()
            if self._slot_ones is None:  # made on first use (on the CPU only a non-int64 slot tensor needs them)
                n = self.size + self.page_size
                self._slot_ones = torch.ones(n, dtype=torch.int32, device=self.device)
                self._slot_zeros = torch.zeros(n, dtype=torch.int32, device=self.device)
            views = self._views[k] = (self._slot_ones[:k], self._slot_zeros[:k])
        return views

    def check_claimable(self, slots: torch.Tensor, *, commit: bool = False, what: str = "insert") -> None:
        """Raise ValueError, changing nothing, unless every slot may become a cache's own.

        A claimable slot is in range (not padding), handed out (not in the free
        list), named once, and not already claimed by a cache (another tree node).
        With ``commit`` the slots are claimed too: ``disown`` gives them up.

        On the CPU (an int64 slot tensor) the maps are read through numpy views:
        one max for the range, a gather of the owner and free maps (both must be
        all zero), then the slots are stamped 1, 2, 3, ... in the owner map and
        read back: a slot named twice holds one stamp for two positions.  Else
        three torch index operations: gather free counts, scatter-add ownership,
        gather it back (every count must then be 1).
        """
        k = slots.numel()
        if k == 0:
            return
        owned = self._owned
        if owned is None:
            owned = self._owner_map()
        if k > owned.numel():  # more slots than the pool has: some are bad or named twice
            self._raise_unclaimable(slots, what)
        onp = self._owned_np
        if onp is not None and slots.dtype is torch.int64:
            try:
                s = slots.numpy()
            except (TypeError, RuntimeError):  # not a plain CPU tensor: the torch path below
                pass
            else:
                self._check_claimable_np(onp, s, slots, commit, what)
                return
        try:
            # Bounds-checked (negative ids too) before anything is written: the page table
            # covers exactly the slot range, padding page included.
            free = self._free_cnt.index_select(0, self._page_ids(slots))
        except IndexError:
            self._raise_unclaimable(slots, what)
        views = self._views.get(k)
        ones, zeros = views if views is not None else self._ones_zeros(k)
        owned.index_add_(0, slots, ones)
        # After the add every count is 1 iff each slot was named once, not owned before and
        # not padding; every page is handed out iff its free count is 0.
        ok = torch.equal(owned.index_select(0, slots), ones) and torch.equal(free, zeros)
        if not ok or not commit:
            owned.index_add_(0, slots, ones, alpha=-1)
        if not ok:
            self._raise_unclaimable(slots, what)

    def _check_claimable_np(self, onp: np.ndarray, s: np.ndarray, slots: torch.Tensor, commit: bool,
                            what: str) -> None:
        """``check_claimable`` through the numpy views (``s`` shares ``slots``' memory)."""
        u = s.view(np.uint64)  # a negative id becomes huge: one max bounds both ends
        if u[u.argmax()] >= onp.size:
            self._raise_unclaimable(slots, what)
        shift = self._page_shift
        pages = s if shift == 0 else (s >> shift if shift > 0 else s // self.page_size)
        # Owner map: padding page 1, claimed slots non-zero; free counts: 1 per free page.
        if np.count_nonzero(onp[s]) or np.count_nonzero(self._free_np[pages]):  # type: ignore[index]
            self._raise_unclaimable(slots, what)
        k = s.size
        onp[s] = self._stamps_for(k)
        # Every position reads its own stamp back iff no slot is named twice.
        if onp[s].tobytes() != self._stamp_bytes[: 4 * k]:
            onp[s] = 0
            self._raise_unclaimable(slots, what)
        if not commit:
            onp[s] = 0

    def _raise_unclaimable(self, slots: torch.Tensor, what: str) -> NoReturn:
        p = self.page_size
        lo, hi = (int(v) for v in torch.aminmax(slots))
        if lo < p or hi >= self.size + p:
            bad = lo if lo < p else hi
            kind = "the padding page" if 0 <= bad < p else "out of range"
            raise ValueError(f"{what}: slot {bad} is {kind}: valid slots are [{p}, {self.size + p})")
        free = self._free_cnt.index_select(0, torch.div(slots, p, rounding_mode="floor")) != 0
        if bool(free.any()):
            raise ValueError(f"{what}: slot {int(slots[free][0])} is free (not allocated): a cache may only keep "
                             "slots a request holds")
        assert self._owned is not None
        taken = self._owned.index_select(0, slots) != 0
        if bool(taken.any()):
            raise ValueError(f"{what}: slot {int(slots[taken][0])} is already owned by another tree node")
        s = torch.sort(slots).values
        raise ValueError(f"{what}: slot {int(s[1:][s[1:] == s[:-1]][0])} appears twice in one value")

    def claim(self, slots: torch.Tensor, *, checked: bool = True) -> None:
        """Mark ``slots`` as a cache's own (``check_claimable(commit=True)``, or unchecked with ``checked=False``)."""
        if checked:
            self.check_claimable(slots, commit=True)
        elif slots.numel():
            self._owner_map().index_fill_(0, slots, 1)

    def disown(self, slots: torch.Tensor) -> None:
        """A cache gives up ``slots`` (before freeing them); ids outside the pool are ignored."""
        owned = self._owned
        if owned is None or slots.numel() == 0:
            return
        slots = slots.to(torch.int64)
        lo, hi = (int(v) for v in torch.aminmax(slots))
        p = self.page_size
        if lo < p or hi >= owned.numel():
            slots = slots[(slots >= p) & (slots < owned.numel())]
        owned.index_fill_(0, slots, 0)

    def claimed_slots(self) -> torch.Tensor:
        """Every slot a cache claimed and has not disowned, ascending."""
        if self._owned is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self._owned[self.page_size :].nonzero().flatten().add_(self.page_size)

    # ---- alloc / free ------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        need_size = checked_count(need_size, "need_size")
        if need_size < 0:
            raise ValueError(f"need_size={need_size} must be >= 0")
        if need_size % self.page_size:
            raise ValueError(f"need_size={need_size} is not a multiple of page_size={self.page_size}")
        k = need_size // self.page_size
        if k > self._count:
            return None
        pages = self._peek(k)
        self._pop(pages)
        return self._expand(pages)

    def free(self, free_index: Any) -> None:
        slots = self._as_slots(free_index)
        if slots.numel() == 0:
            return
        if self._group is not None:
            # Checked now for an early error; the caller may reuse its tensor, so keep a copy.
            self._checked_pages(slots)
            self._group.append(slots.clone())
            return
        self._push(self._checked_pages(slots, commit=True))

    def _push_owned_pages(self, pages: torch.Tensor) -> None:
        """Return distinct pages known to be handed out, without the double-free check.

        For a pool whose pages are only ever reached through another pool's checked slots
        (the window side of ``SWATokenToKVPoolAllocator``): the check there already covers them.
        """
        if self._free_np is not None:
            p = pages.numpy()
            self._free_np[p] = 1
            self._push_np(p)
            return
        self._free_cnt.index_fill_(0, pages, 1)
        self._push(pages)

    def _segment_pages(self, free_index: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Page ids of row positions ``[start_pos, start_pos + n)``, in row order (SGLang's stride picks)."""
        p = self.page_size
        off = start_pos % p
        reps = free_index[::p] if off == 0 else torch.cat((free_index[:1], free_index[p - off :: p]))
        return reps // p

    def free_segment(self, free_index: Any, *, start_pos: int = 0) -> None:
        """Free ``row[start_pos : start_pos + n]`` of one request (or a page-aligned tree value).

        SGLang's ``free_segment``: with ``page_size > 1`` the pages go back in row order
        (not sorted as ``free`` does), so later allocations get the same slots.
        """
        slots = self._as_slots(free_index)
        if slots.numel() == 0:
            return
        if self.page_size == 1:
            self.free(slots)
            return
        self._check_range(slots)
        pages = self._segment_pages(slots, start_pos)
        if self._group is not None:
            self._checked_page_ids(pages)
            self._rep_group.append(pages.clone())
            return
        self._push(self._checked_page_ids(pages, commit=True))

    def free_segments(self, segments: Sequence[tuple[Any, int]]) -> None:
        """Free ascending, disjoint ``(slots, start_pos)`` pieces of one request's row.

        SGLang's ``free_segments``: a page shared by consecutive pieces goes back once,
        each piece as one ``free_segment`` (so, paged, the later piece ends up in front).
        Checked as a whole first: on a bad slot nothing is freed.
        """
        p = self.page_size
        pieces = trim_row_segments([(self._as_slots(f), start) for f, start in segments], p)
        if not pieces:
            return
        if len(pieces) == 1:
            self.free_segment(pieces[0][0], start_pos=pieces[0][1])
            return
        if p == 1:
            self.free(torch.cat([sl for sl, _ in pieces]))
            return
        for sl, _ in pieces:
            self._check_range(sl)
        pages = [self._segment_pages(sl, st) for sl, st in pieces]
        if self._group is not None:
            self._checked_page_ids(torch.cat(pages))
            self._rep_group.extend(pg.clone() for pg in pages)
            return
        self._checked_page_ids(torch.cat(pages), commit=True)
        for pg in pages:
            self._push(pg)

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
            self._push(self._checked_page_ids(torch.cat(reps), commit=True))

    # ---- batched paged allocation (SGLang's alloc_extend / alloc_decode) ----

    def num_new_pages_extend(self, prefix_lens_cpu: Lens, seq_lens_cpu: Lens) -> int:
        p = self.page_size
        a, b = _np_lens(prefix_lens_cpu), _np_lens(seq_lens_cpu)
        if a is not None and b is not None and a.size == b.size:
            return int(((b + p - 1) // p - (a + p - 1) // p).sum())
        pre, seq = _cpu_lens(prefix_lens_cpu), _cpu_lens(seq_lens_cpu)
        return int(((seq + p - 1) // p - (pre + p - 1) // p).sum())

    def num_new_pages_decode(self, seq_lens_cpu: Lens) -> int:
        # The new token sits at seq_len - 1; a page starts there iff that is aligned.
        return int(((_cpu_lens(seq_lens_cpu) - 1) % self.page_size == 0).sum())

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
        if self._ring_np is not None:
            a_pre, a_pre_cpu, a_seq, a_seq_cpu, a_last = (
                _np_lens(x) for x in (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)
            )
            if a_pre is not None and a_pre_cpu is not None and a_seq is not None and a_seq_cpu is not None \
                    and a_last is not None and a_pre.size == a_pre_cpu.size == a_seq.size == a_seq_cpu.size \
                    == a_last.size:
                return self._alloc_extend_np(a_pre, a_pre_cpu, a_seq, a_seq_cpu, a_last, extend_num_tokens,
                                             num_new_pages)
        pre_cpu, seq_cpu = _cpu_lens(prefix_lens_cpu), _cpu_lens(seq_lens_cpu)
        if pre_cpu.numel() != seq_cpu.numel():
            raise ValueError(f"{pre_cpu.numel()} prefix lengths but {seq_cpu.numel()} sequence lengths")
        ext_cpu = seq_cpu - pre_cpu
        if bool((ext_cpu < 0).any()) or int(ext_cpu.sum()) != extend_num_tokens:
            raise ValueError(
                f"extend_num_tokens={extend_num_tokens} does not match seq_lens - prefix_lens"
                f" (sum {int(ext_cpu.sum())}, all must be >= 0)"
            )
        p = self.page_size
        if p == 1:
            return self.alloc(extend_num_tokens)
        if num_new_pages is None:
            num_new_pages = self.num_new_pages_extend(pre_cpu, seq_cpu)
        if num_new_pages > self._count:
            return None
        pages = self._peek(num_new_pages)

        dev = self.device
        pre = torch.as_tensor(prefix_lens, dtype=torch.int64, device=dev).reshape(-1)
        seq = torch.as_tensor(seq_lens, dtype=torch.int64, device=dev).reshape(-1)
        last = torch.as_tensor(last_loc, dtype=torch.int64, device=dev).reshape(-1)
        ext = seq - pre
        # num1: tokens that fit in the request's last partial page, right after last_loc.
        num1 = torch.minimum(seq, (pre + p - 1) // p * p) - pre
        new_per_req = (seq + p - 1) // p - (pre + p - 1) // p
        first_new = torch.cumsum(new_per_req, 0) - new_per_req
        first_tok = torch.cumsum(ext, 0) - ext
        req = torch.repeat_interleave(
            torch.arange(ext.numel(), device=dev), ext, output_size=extend_num_tokens
        )
        j = torch.arange(extend_num_tokens, dtype=torch.int64, device=dev) - first_tok[req]
        k = (j - num1[req]).clamp(min=0)
        # One padding entry keeps the gather in bounds for tokens that take no new page.
        padded = torch.cat((pages, pages.new_zeros(1)))
        fresh = padded[first_new[req] + k // p] * p + k % p
        out = torch.where(j < num1[req], last[req] + 1 + j, fresh)
        self._pop(pages)
        return out

    def _alloc_extend_np(
        self,
        pre: np.ndarray,
        pre_cpu: np.ndarray,
        seq: np.ndarray,
        seq_cpu: np.ndarray,
        last: np.ndarray,
        extend_num_tokens: int,
        num_new_pages: int | None,
    ) -> torch.Tensor | None:
        """``alloc_extend`` in numpy (CPU pool, plain integer lengths): the same slots, fewer dispatches."""
        ext_cpu = seq_cpu - pre_cpu
        if bool((ext_cpu < 0).any()) or int(ext_cpu.sum()) != extend_num_tokens:
            raise ValueError(
                f"extend_num_tokens={extend_num_tokens} does not match seq_lens - prefix_lens"
                f" (sum {int(ext_cpu.sum())}, all must be >= 0)"
            )
        p = self.page_size
        if p == 1:
            return self.alloc(extend_num_tokens)
        if num_new_pages is None:
            num_new_pages = int(((seq_cpu + p - 1) // p - (pre_cpu + p - 1) // p).sum())
        if num_new_pages > self._count:
            return None
        pages_t = self._peek(num_new_pages)
        pages = pages_t.numpy()
        if pre.size <= 16:
            # A few requests: per-request slices cost less than the vectorised form's ~20 array ops.
            fresh_all = (pages[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1)
            pieces = []
            used = 0
            for pr, sq, la in zip(pre.tolist(), seq.tolist(), last.tolist()):
                n1 = min(sq, (pr + p - 1) // p * p) - pr
                if n1:
                    pieces.append(np.arange(la + 1, la + 1 + n1, dtype=np.int64))
                rest = sq - pr - n1
                if rest > 0:
                    pieces.append(fresh_all[used : used + rest])
                    used += (rest + p - 1) // p * p
            out = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
            self._pop(pages_t)
            return torch.from_numpy(out)
        ext = seq - pre
        num1 = np.minimum(seq, (pre + p - 1) // p * p) - pre
        new_per_req = (seq + p - 1) // p - (pre + p - 1) // p
        first_new = np.cumsum(new_per_req) - new_per_req
        first_tok = np.cumsum(ext) - ext
        req = np.repeat(np.arange(ext.size), ext)
        j = np.arange(extend_num_tokens, dtype=np.int64) - first_tok[req]
        n1 = num1[req]
        k = np.maximum(j - n1, 0)
        # One padding entry keeps the gather in bounds for tokens that take no new page.
        padded = np.append(pages, 0)
        fresh = padded[first_new[req] + k // p] * p + k % p
        out = np.where(j < n1, last[req] + 1 + j, fresh)
        self._pop(pages_t)
        return torch.from_numpy(out)

    def alloc_decode(self, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> torch.Tensor | None:
        p = self.page_size
        if p == 1:
            return self.alloc(_cpu_lens(seq_lens_cpu).numel())
        num_new_pages = self.num_new_pages_decode(seq_lens_cpu)
        if num_new_pages > self._count:
            return None
        pages = self._peek(num_new_pages)
        dev = self.device
        seq = torch.as_tensor(seq_lens, dtype=torch.int64, device=dev).reshape(-1)
        last = torch.as_tensor(last_loc, dtype=torch.int64, device=dev).reshape(-1)
        needs = (seq - 1) % p == 0
        idx = (torch.cumsum(needs, 0) - 1).clamp(min=0)
        padded = torch.cat((pages, pages.new_zeros(1)))
        out = torch.where(needs, padded[idx] * p, last + 1)
        self._pop(pages)
        return out

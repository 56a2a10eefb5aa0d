"""The free pages of one pool: SGLang's free-list order, kept in a fixed ring buffer.

The list has SGLang's order with ``need_sort=False`` (take from the front; give
back at the end when ``page_size == 1``, at the front when paged), but lives in a
ring so that taking and giving back cost O(pages moved), not O(pool size).  A
per-page map (1 = free) catches a double free without sorting.  Page 0 is padding
and never free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

from kvcore.pools.array_ops import Array, ArrayOps

__all__ = ["FreePageRing"]


class FreePageRing:
    """Pages ``1..num_pages`` of ``page_size`` slots; every array is of the ``ops`` form."""

    def __init__(self, num_pages: int, page_size: int, ops: ArrayOps, device: str | torch.device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.size = num_pages * page_size
        self.ops = ops
        self.ring = ops.view(torch.empty(num_pages, dtype=torch.int64, device=device))
        #: Per page id: 1 when free, 0 when handed out (page 0, the padding page, never is free).
        self.free_cnt = torch.zeros(num_pages + 1, dtype=torch.int32, device=device)
        self.free = ops.view(self.free_cnt)
        self.offsets = ops.arange(0, page_size)
        # log2(page_size) when a power of two (the page of a slot by one shift), else -1.
        self.shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        self.head = 0
        self.count = num_pages
        self.clear()

    def clear(self) -> None:
        self.ring[:] = self.ops.arange(1, self.num_pages + 1)
        self.head = 0
        self.count = self.num_pages
        self.free[:] = 1
        self.free[0] = 0

    # ---- taking and giving back ---------------------------------------------

    def peek(self, k: int) -> Array:
        """A copy of the first ``k`` free pages; changes nothing."""
        end = self.head + k
        if end <= self.num_pages:
            return self.ops.copy(self.ring[self.head : end])
        return self.ops.cat([self.ring[self.head :], self.ring[: end - self.num_pages]])

    def pop(self, pages: Array) -> None:
        """Commit taking ``pages`` (the result of :meth:`peek`) off the front."""
        k = len(pages)
        if k:
            self.free[pages] = 0
            self.head = (self.head + k) % self.num_pages
            self.count -= k

    def push(self, pages: Array) -> None:
        """Give back pages already marked free (by ``checked_page_ids(commit=True)``).

        SGLang appends freed slots at the back when page_size == 1 but puts freed
        pages in front when paged; both are kept so that slot numbers agree.
        """
        k = len(pages)
        if not k:
            return
        n = self.num_pages
        if self.page_size > 1:
            head = self.head = (self.head - k) % n
        else:
            head = (self.head + self.count) % n
        self.count += k
        first = min(k, n - head)
        self.ring[head : head + first] = pages[:first]
        if k > first:
            self.ring[: k - first] = pages[first:]

    def push_owned(self, pages: Array) -> None:
        """Give back distinct pages known to be handed out, without the double-free check.

        For a pool whose pages are only reached through another pool's checked slots
        (the window side of ``SWATokenToKVPoolAllocator``): the check there covers them.
        """
        self.free[pages] = 1
        self.push(pages)

    def release_run(self, pages: Array, counts: Sequence[int]) -> None:
        """Give back ``pages``: handed-out page ids ``first, first + 1, ...`` (checked by the caller:
        in range, none free), as consecutive pieces of ``counts[i]`` pages, each pushed as one free
        of it would push it (paged: each piece in front of the ones before, SGLang's per-node order)."""
        first = int(pages[0])
        self.free[first : first + len(pages)] = 1
        if len(counts) == 1:
            self.push(pages)
            return
        at = 0
        for c in counts:
            self.push(pages[at : at + c])
            at += c

    def release(self, slots: Array) -> Array:
        """Check ``slots`` (non-empty) and give their pages back; returns those pages."""
        pages = self.checked_pages(slots, commit=True)
        self.push(pages)
        return pages

    # ---- slots and pages ----------------------------------------------------

    def expand(self, pages: Array) -> Array:
        """Every slot of ``pages``, page by page."""
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self.offsets).reshape(-1)

    def page_ids(self, slots: Array) -> Array:
        """The page of every slot (a shift when page_size is a power of two)."""
        shift = self.shift
        if shift == 0:
            return slots
        if shift > 0:
            return slots >> shift
        return slots // self.page_size

    def segment_pages(self, slots: Array, start_pos: int) -> Array:
        """Page ids of row positions ``[start_pos, start_pos + n)``, in row order (SGLang's stride picks)."""
        p = self.page_size
        off = start_pos % p
        reps = slots[::p] if off == 0 else self.ops.cat([slots[:1], slots[p - off :: p]])
        return reps // p

    # ---- checks -------------------------------------------------------------

    def check_range(self, slots: Array) -> None:
        """ValueError unless every slot (non-empty) is in ``[page_size, size + page_size)``."""
        p = self.page_size
        if self.ops.any_outside(slots, p, self.size + p):
            lo, hi = int(slots.min()), int(slots.max())
            raise ValueError(
                f"slot {lo if lo < p else hi} is padding or out of range: valid slots are [{p}, {self.size + p})"
            )

    def checked_pages(self, slots: Array, commit: bool = False) -> Array:
        """The pages to give back for ``slots`` (non-empty); ValueError, changing nothing, on a bad slot.

        With ``commit`` the pages are also marked free (the caller then pushes them).
        """
        if self.page_size == 1:
            if self.ops.any_outside(slots, 1, self.num_pages + 1):
                self.check_range(slots)
            return self.checked_page_ids(slots, commit)
        # Several slots of one page in one call are normal when paged; SGLang frees unique pages.
        pages = self.ops.unique(self.page_ids(slots))
        if int(pages[0]) < 1 or int(pages[-1]) > self.num_pages:
            self.check_range(slots)  # raises, naming the slot
        return self.checked_page_ids(pages, commit, distinct=True)

    def checked_page_ids(self, pages: Array, commit: bool = False, *, distinct: bool = False) -> Array:
        """Check (and with ``commit`` mark free) page ids in range, kept in the given order."""
        free = self.free
        if self.ops.count_nonzero(free[pages]):
            self._raise_bad(pages)
        if not distinct and not self.ops.stamp(free, pages):
            free[pages] = 0
            self._raise_bad(pages)
        if commit:
            free[pages] = 1
        elif not distinct:
            free[pages] = 0
        return pages

    def _raise_bad(self, pages: Array) -> NoReturn:
        p = self.page_size
        already = self.free[pages] != 0
        if bool(already.any()):
            page = int(pages[already][0])
            what = f"slot {page}" if p == 1 else f"page {page} (slots {page * p}..{page * p + p - 1})"
            raise ValueError(f"{what} is already free (double free)")
        s = self.ops.sort(pages)
        slot = int(s[1:][s[1:] == s[:-1]][0])
        raise ValueError(f"slot {slot} appears twice in one free (double free)")

"""Ownership claims: which slots of a pool a cache (its tree nodes) owns.

A tree backend under ``strict`` claims the slots it keeps (``check_claimable(...,
commit=True)``) and disowns them before freeing them, so a slot can never be owned
by two nodes, nor kept while free.
"""

from __future__ import annotations

from typing import NoReturn, Protocol

import torch

from kvcore.pools.array_ops import Array
from kvcore.pools.free_pages import FreePageRing

__all__ = ["SlotClaims", "SlotOwnership"]


class SlotClaims(Protocol):
    """Which slots a cache (its tree nodes) owns: what a tree backend calls under ``strict``.

    ``TokenToKVPoolAllocator`` and ``SWATokenToKVPoolAllocator`` (full-side ids) implement it.
    """

    def check_claimable(self, slots: torch.Tensor, *, commit: bool = False, what: str = "insert") -> None: ...

    def claim(self, slots: torch.Tensor, *, checked: bool = True) -> None: ...

    def disown(self, slots: torch.Tensor) -> None: ...

    def claimed_slots(self) -> torch.Tensor: ...


def _whole_pages(s: Array, page_size: int) -> bool:
    """Whether ``s`` is whole pages, each one in order: ``[k*p, k*p + 1, ..., k*p + p - 1]``."""
    if len(s) % page_size:
        return False
    rows = s.reshape(-1, page_size)
    return bool((rows[:, 0] % page_size == 0).all()) and bool((rows[:, 1:] - rows[:, :-1] == 1).all())


class SlotOwnership:
    """The owner map of one pool (per slot: non-zero when claimed), made on first use.

    Works on native int64 slot arrays of ``pages.ops``' form; the allocator converts.
    """

    def __init__(self, pages: FreePageRing, device: str | torch.device) -> None:
        self.pages = pages
        self.device = device
        self._owned_tensor: torch.Tensor | None = None
        self._owned: Array = None  # the native view of the owner map, once made

    def owner_map(self) -> torch.Tensor:
        """The owner map as a tensor (padding page 1, a claimed slot non-zero); made on first call."""
        if self._owned_tensor is None:
            p = self.pages.page_size
            t = self._owned_tensor = torch.zeros(self.pages.size + p, dtype=torch.int32, device=self.device)
            t[:p] = 1  # the padding page: never claimable
            self._owned = self.pages.ops.view(t)
        return self._owned_tensor

    def clear(self) -> None:
        if self._owned is not None:
            self._owned[:] = 0
            self._owned[: self.pages.page_size] = 1

    def check_claimable(self, s: Array, *, commit: bool, what: str) -> None:
        """Raise ValueError, changing nothing, unless every slot may become a cache's own.

        A claimable slot is in range (not padding), handed out (not in the free
        list), named once, and not already claimed.  One range check, a gather of
        the owner and free maps (both must be all zero), then the slots are stamped
        1, 2, 3, ... in the owner map and read back: a slot named twice holds one
        stamp for two positions.  With ``commit`` the stamps stay (the slots are claimed).
        """
        k = len(s)
        if k == 0:
            return
        if self._owned is None:
            self.owner_map()
        owned = self._owned
        ops = self.pages.ops
        a0 = self._run_in_range(s)
        if a0 >= 0 and self._run_claimable(a0, k):
            if commit:
                owned[a0 : a0 + k] = 1
            return
        if a0 < 0 and self.pages.page_size > 1 and self._pages_claimable(s, commit):
            return
        # The general path: also where a run or pages that are not claimable raise, so every
        # refusal reads the same whichever path found it.
        if k > len(owned) or ops.any_outside(s, 0, len(owned)):
            self._raise_unclaimable(s, what)
        if ops.count_nonzero(owned[s]) or ops.count_nonzero(self.pages.free[self.pages.page_ids(s)]):
            self._raise_unclaimable(s, what)
        if not ops.stamp(owned, s):
            owned[s] = 0
            self._raise_unclaimable(s, what)
        if not commit:
            owned[s] = 0
        p = self.pages.page_size
        if p > 1 and not _whole_pages(s, p):
            if commit:
                owned[s] = 0
            raise ValueError(
                f"{what}: the slots do not make whole pages of {p} in order (a value straddling pages would "
                "leave a node half of each page); a paged cache keeps the pages alloc_extend hands out"
            )

    def _run_in_range(self, s: Array) -> int:
        """``s[0]`` when ``s`` (non-empty) is one ascending run inside the pool (past the padding
        page, below its end), else -1: such a value is checked and changed by slices."""
        a0 = self.pages.ops.run_start(s)
        p = self.pages.page_size
        if a0 < p or a0 + len(s) > self.pages.size + p:
            return -1
        return a0

    def _run_claimable(self, a0: int, k: int) -> bool:
        """Whether the run ``[a0, a0 + k)`` (in range) may be claimed whole: whole pages in order
        (a run is in order), no page free, no slot claimed (a run names each slot once).
        Slices, not gathers: the cost is a memset-sized pass per map."""
        pages = self.pages
        p = pages.page_size
        if p > 1 and (a0 % p or k % p):
            return False
        first, last = pages.page_ids(a0), pages.page_ids(a0 + k - 1)
        ops = pages.ops
        owned = self._owned
        if owned is not None and ops.count_nonzero(owned[a0 : a0 + k]):
            return False
        return not ops.count_nonzero(pages.free[first : last + 1])

    def run_claimable(self, s: Array) -> int:
        """``s[0]`` when ``s`` (non-empty) is one ascending run of whole pages in range, none of it
        free or claimed, else -1 (nothing is changed either way).  Such a run may be claimed
        (``claim_run``) and any part of it freed without a further check: what a tree's insert
        does with the caller's value (its duplicates freed, the new leaf's slots claimed)."""
        a0 = self._run_in_range(s)
        return a0 if a0 >= 0 and self._run_claimable(a0, len(s)) else -1

    def claim_run(self, a0: int, k: int) -> None:
        """Claim ``[a0, a0 + k)``, part of a run ``run_claimable`` accepted (a slice fill)."""
        if k:
            if self._owned is None:
                self.owner_map()
            self._owned[a0 : a0 + k] = 1

    def _pages_claimable(self, s: Array, commit: bool) -> bool:
        """Whole pages (paged, not one run): True when every page may be claimed, and then (with
        ``commit``) claimed; False, changing nothing, when some check fails (the general path then
        names it).  Range, free and repeats are checked on the page ids (a page_size-th of the
        work); only the owner map is read per slot."""
        pages = self.pages
        p = pages.page_size
        if not _whole_pages(s, p):
            return False
        ops = pages.ops
        first = s[::p]
        if ops.any_outside(first, p, pages.size + p):
            return False
        ids = pages.page_ids(first)
        free = pages.free
        if ops.count_nonzero(free[ids]) or ops.count_nonzero(self._owned[s]):
            return False
        # A page named twice: stamp the page ids into the free map (all zero there) and read back.
        distinct = ops.stamp(free, ids)
        free[ids] = 0
        if not distinct:
            return False
        if commit:
            self._owned[s] = 1
        return True

    def _raise_unclaimable(self, s: Array, what: str) -> NoReturn:
        p = self.pages.page_size
        n = self.pages.size
        lo, hi = int(s.min()), int(s.max())
        if lo < p or hi >= n + p:
            bad = lo if lo < p else hi
            kind = "the padding page" if 0 <= bad < p else "out of range"
            raise ValueError(f"{what}: slot {bad} is {kind}: valid slots are [{p}, {n + p})")
        free = self.pages.free[self.pages.page_ids(s)] != 0
        if bool(free.any()):
            raise ValueError(f"{what}: slot {int(s[free][0])} is free (not allocated): a cache may only keep "
                             "slots a request holds")
        taken = self._owned[s] != 0
        if bool(taken.any()):
            raise ValueError(f"{what}: slot {int(s[taken][0])} is already owned by another tree node")
        q = self.pages.ops.sort(s)
        raise ValueError(f"{what}: slot {int(q[1:][q[1:] == q[:-1]][0])} appears twice in one value")

    def check_unclaimed(self, s: Array) -> None:
        """ValueError unless no slot of ``s`` (non-empty) is claimed: a cache's slot is freed only
        after the cache disowns it, so a free cannot take back what a tree node still holds.
        Out-of-range ids are left to the free's own range check."""
        owned = self._owned
        if owned is None:
            return  # nothing was ever claimed (``strict=False``, or no tree on this pool)
        ops = self.pages.ops
        p = self.pages.page_size
        a0 = self._run_in_range(s)
        if a0 >= 0:
            if not ops.count_nonzero(owned[a0 : a0 + len(s)]):
                return  # a run in range, none of it claimed: one slice, no gather
        elif ops.any_outside(s, p, len(owned)):
            s = s[(s >= p) & (s < len(owned))]
        taken = owned[s] != 0
        if bool(taken.any()):
            raise ValueError(f"slot {int(s[taken][0])} is owned by a tree node of the cache: "
                             "the cache disowns a slot before it is freed (use after free)")

    def claim_unchecked(self, s: Array) -> None:
        if len(s):
            if self._owned is None:
                self.owner_map()
            self._owned[s] = 1

    def disown(self, s: Array) -> None:
        """Give up ``s``; ids outside the pool are ignored."""
        owned = self._owned
        if owned is None or len(s) == 0:
            return
        p = self.pages.page_size
        a0 = self._run_in_range(s)
        if a0 >= 0:
            owned[a0 : a0 + len(s)] = 0  # a run in range: a slice fill, no scatter
            return
        if self.pages.ops.any_outside(s, p, len(owned)):
            s = s[(s >= p) & (s < len(owned))]
        owned[s] = 0

    def claimed(self) -> Array:
        """Every claimed slot, ascending (None before the first claim)."""
        if self._owned is None:
            return None
        p = self.pages.page_size
        return self.pages.ops.nonzero(self._owned[p:]) + p

"""The checks on an allocator's arguments, in one place.

Every ``alloc`` / ``alloc_extend`` / ``alloc_decode`` of every token allocator
(plain, paged, NPU, the two sides of SWA) runs its arguments through here before
it takes a page: bad input is a ValueError (TypeError for a wrong type) that
names the argument, and nothing has changed.  A checked batch call is a
:class:`SlotRequest`; the allocation itself trusts it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvcore.pools.array_ops import Array, cpu_ints
from kvcore.pools.free_pages import FreePageRing

__all__ = ["Lens", "SlotRequest", "check_decode", "check_extend", "check_need_size", "checked_count", "host_lens"]

Lens = torch.Tensor | Sequence[int]


def checked_count(value: Any, what: str) -> int:
    """``value`` as an int (anything with ``__index__``), or TypeError naming ``what``; bools are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} ({value!r})") from None


def check_need_size(need_size: Any, page_size: int) -> int:
    """``alloc``'s ``need_size``: an int >= 0, a multiple of the page size."""
    need_size = checked_count(need_size, "need_size")
    if need_size < 0:
        raise ValueError(f"need_size={need_size} must be >= 0")
    if need_size % page_size:
        raise ValueError(f"need_size={need_size} is not a multiple of page_size={page_size}")
    return need_size


def host_lens(x: Any, what: str) -> np.ndarray:
    """Lengths (a tensor on any device, a sequence of ints) as a host 1-D int64 array; TypeError naming ``what``."""
    try:
        return cpu_ints(x)
    except TypeError as e:
        raise TypeError(f"{what} must hold integers: {e}") from None


def native_lens(pages: FreePageRing, x: Any, what: str) -> Array:
    try:
        return pages.ops.ints(x)
    except TypeError as e:
        raise TypeError(f"{what} must hold integers: {e}") from None


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """A checked ``alloc_extend`` (or ``alloc_decode``: one token per request) of one pool.

    ``prefix`` and ``seq`` are the host lengths (the layout of the new slots comes
    from them, as in SGLang's naive path); ``last_loc`` is of the pool's array form.
    """

    prefix: np.ndarray
    seq: np.ndarray
    last_loc: Array
    num_new_pages: int
    num_tokens: int
    decode: bool

    def on(self, pages: FreePageRing, last_loc: Array) -> SlotRequest:
        """The same request on another pool (the window side of SWA), continuing after ``last_loc`` there."""
        check_continues(pages, self.prefix, self.seq, last_loc)
        return replace(self, last_loc=last_loc)


def _check_one_per_request(n: int, **arrays: Any) -> None:
    for name, a in arrays.items():
        k = a.numel() if isinstance(a, torch.Tensor) else len(a)
        if k != n:
            raise ValueError(f"{name} has {k} entries for {n} requests")


def check_continues(pages: FreePageRing, prefix: np.ndarray, seq: np.ndarray, last_loc: Array) -> None:
    """``last_loc[i]`` is where request i's prefix ends, wherever its new tokens continue that page.

    A request whose prefix ends inside a page (``prefix % page_size != 0``) gets its
    next slots right after ``last_loc`` in that page: so ``last_loc`` must be a slot
    of this pool (not padding) at the prefix's offset in its page.  Whether the
    request really holds that page is the caller's record, not checked here.
    """
    p = pages.page_size
    if p == 1:
        return
    rows = np.flatnonzero((prefix % p != 0) & (seq > prefix))
    if not rows.size:
        return
    ops = pages.ops
    last = last_loc[ops.ints(rows)] if rows.size != len(last_loc) else last_loc
    want = ops.ints((prefix[rows] - 1) % p)
    # Valid iff last - want is the first slot of a page 1..num_pages.
    first = last - want
    if not ops.any_outside(first, p, pages.size + 1) and not ops.count_nonzero(first % p):
        return
    for i in range(rows.size):  # an error: name the first bad entry
        r, v, w = int(rows[i]), int(last[i]), int(want[i])
        if not p <= v < pages.size + p:
            raise ValueError(f"last_loc[{r}]={v} is padding or out of range: valid slots are [{p}, {pages.size + p})"
                             f" (a prefix of {int(prefix[r])} tokens ends inside a page: its new slots follow last_loc)")
        if v % p != w:
            raise ValueError(f"last_loc[{r}]={v} does not end a prefix of {int(prefix[r])} tokens: it is at offset "
                             f"{v % p} of its page, the prefix ends at offset {w} (page_size {p})")
    raise AssertionError("unreachable: the fast check found a bad entry")


def check_extend(
    pages: FreePageRing,
    prefix_lens: Lens,
    prefix_lens_cpu: Lens,
    seq_lens: Lens,
    seq_lens_cpu: Lens,
    last_loc: Lens,
    extend_num_tokens: int,
    num_new_pages: int | None = None,
) -> SlotRequest:
    """``alloc_extend``'s arguments, checked: ValueError (TypeError for non-integers) naming what is wrong."""
    pre = host_lens(prefix_lens_cpu, "prefix_lens_cpu")
    seq = host_lens(seq_lens_cpu, "seq_lens_cpu")
    if pre.size != seq.size:
        raise ValueError(f"{pre.size} prefix lengths but {seq.size} sequence lengths")
    ext = seq - pre
    if bool((ext < 0).any()) or int(ext.sum()) != extend_num_tokens:
        raise ValueError(
            f"extend_num_tokens={extend_num_tokens} does not match seq_lens - prefix_lens"
            f" (sum {int(ext.sum())}, all must be >= 0)"
        )
    p = pages.page_size
    last = native_lens(pages, last_loc, "last_loc")
    _check_one_per_request(pre.size, prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last)
    need = int(((seq + p - 1) // p - (pre + p - 1) // p).sum())
    if num_new_pages is not None and num_new_pages != need:
        raise ValueError(f"num_new_pages={num_new_pages} does not match the lengths ({need} new pages)")
    check_continues(pages, pre, seq, last)
    return SlotRequest(pre, seq, last, need, int(extend_num_tokens), decode=False)


def check_decode(pages: FreePageRing, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> SlotRequest:
    """``alloc_decode``'s arguments, checked: one new token per request, at position ``seq_len - 1``."""
    seq = host_lens(seq_lens_cpu, "seq_lens_cpu")
    if seq.size and int(seq.min()) < 1:
        i = int(np.argmin(seq))
        raise ValueError(f"seq_lens_cpu[{i}]={int(seq[i])} must be >= 1 (it counts the new token)")
    last = native_lens(pages, last_loc, "last_loc")
    _check_one_per_request(seq.size, seq_lens=seq_lens, last_loc=last)
    pre = seq - 1
    p = pages.page_size
    check_continues(pages, pre, seq, last)
    need = int((pre % p == 0).sum())
    return SlotRequest(pre, seq, last, need, int(seq.size), decode=True)

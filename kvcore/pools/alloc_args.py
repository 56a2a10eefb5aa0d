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


def host_lens(x: Any, what: str) -> list[int]:
    """Lengths (a tensor on any device, a sequence of ints) as a list of ints; TypeError naming ``what``.

    A batch holds a few requests, so the host-side checks run on plain ints: at these sizes
    that costs less than numpy's per-call overhead.
    """
    if type(x) is list and all(type(v) is int for v in x):
        return x
    try:
        if isinstance(x, torch.Tensor | np.ndarray):
            return [int(v) for v in cpu_ints(x).tolist()]
        return [operator.index(v) for v in x]
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
    from them, as in SGLang's naive path); ``last_loc`` is of the pool's array form,
    ``last_host`` its values on the host once read (None when no request continues a page).
    """

    prefix: list[int]
    seq: list[int]
    last_loc: Array
    last_host: list[int] | None
    num_new_pages: int
    num_tokens: int
    decode: bool

    def on(self, pages: FreePageRing, last_loc: Array) -> SlotRequest:
        """The same request on another pool (the window side of SWA), continuing after ``last_loc`` there."""
        return replace(self, last_loc=last_loc, last_host=check_continues(pages, self.prefix, self.seq, last_loc))


def _check_one_per_request(n: int, **arrays: Any) -> None:
    for name, a in arrays.items():
        k = a.numel() if isinstance(a, torch.Tensor) else len(a)
        if k != n:
            raise ValueError(f"{name} has {k} entries for {n} requests")


def check_continues(pages: FreePageRing, prefix: list[int], seq: list[int], last_loc: Array) -> list[int] | None:
    """``last_loc[i]`` is where request i's prefix ends, wherever its new tokens continue that page.

    A request whose prefix ends inside a page (``prefix % page_size != 0``) gets its
    next slots right after ``last_loc`` in that page: so ``last_loc`` must be a slot
    of this pool (not padding) at the prefix's offset in its page.  Whether the
    request really holds that page is the caller's record, not checked here.
    Returns ``last_loc`` read to the host, or None where no request continues a page.
    """
    p = pages.page_size
    if p == 1:
        return None
    hi = pages.size + p
    if all(a % p == 0 or b <= a for a, b in zip(prefix, seq)):
        return None  # every request's new tokens start a page: last_loc is not used
    last: list[int] = last_loc.tolist()  # one read (a device sync on an accelerator)
    for r, (a, b, v) in enumerate(zip(prefix, seq, last)):
        if a % p == 0 or b <= a or (p <= v < hi and v % p == (a - 1) % p):
            continue
        if not p <= v < hi:
            raise ValueError(f"last_loc[{r}]={v} is padding or out of range: valid slots are [{p}, {hi})"
                             f" (a prefix of {a} tokens ends inside a page: new slots follow last_loc)")
        raise ValueError(f"last_loc[{r}]={v} does not end a prefix of {a} tokens: it is at offset "
                         f"{v % p} of its page, the prefix ends at offset {(a - 1) % p} (page_size {p})")
    return last


def check_extend(pages: FreePageRing, prefix_lens: Lens, prefix_lens_cpu: Lens, seq_lens: Lens, seq_lens_cpu: Lens,
                 last_loc: Lens, extend_num_tokens: int, num_new_pages: int | None = None) -> SlotRequest:
    """``alloc_extend``'s arguments, checked: ValueError (TypeError for non-integers) naming what is wrong."""
    pre = host_lens(prefix_lens_cpu, "prefix_lens_cpu")
    seq = host_lens(seq_lens_cpu, "seq_lens_cpu")
    if len(pre) != len(seq):
        raise ValueError(f"{len(pre)} prefix lengths but {len(seq)} sequence lengths")
    total = sum(seq) - sum(pre)
    if total != extend_num_tokens or any(map(operator.lt, seq, pre)):
        raise ValueError(
            f"extend_num_tokens={extend_num_tokens} does not match seq_lens - prefix_lens"
            f" (sum {total}, all must be >= 0)"
        )
    last = native_lens(pages, last_loc, "last_loc")
    _check_one_per_request(len(pre), prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last)
    p = pages.page_size
    need = sum([(b + p - 1) // p - (a + p - 1) // p for a, b in zip(pre, seq)])
    if num_new_pages is not None and num_new_pages != need:
        raise ValueError(f"num_new_pages={num_new_pages} does not match the lengths ({need} new pages)")
    return SlotRequest(pre, seq, last, check_continues(pages, pre, seq, last), need, total, decode=False)


def check_decode(pages: FreePageRing, seq_lens: Lens, seq_lens_cpu: Lens, last_loc: Lens) -> SlotRequest:
    """``alloc_decode``'s arguments, checked: one new token per request, at position ``seq_len - 1``."""
    seq = host_lens(seq_lens_cpu, "seq_lens_cpu")
    for i, b in enumerate(seq):
        if b < 1:
            raise ValueError(f"seq_lens_cpu[{i}]={b} must be >= 1 (it counts the new token)")
    last = native_lens(pages, last_loc, "last_loc")
    _check_one_per_request(len(seq), seq_lens=seq_lens, last_loc=last)
    pre = [b - 1 for b in seq]
    host = check_continues(pages, pre, seq, last)
    p = pages.page_size
    return SlotRequest(pre, seq, last, host, sum(1 for a in pre if a % p == 0), len(seq), decode=True)

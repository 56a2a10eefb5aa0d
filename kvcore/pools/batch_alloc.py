"""The slots of a checked batch call (SGLang's ``alloc_extend`` / ``alloc_decode`` rule).

Written once for both array forms.  Request by request, the new tokens first fill
the rest of the page the prefix ends in (right after ``last_loc``), then take whole
new pages in order; a decode token opens a new page exactly when its position is
page-aligned.  The layout comes from the host lengths (as SGLang's naive path), so
the count of new slots always matches the pages taken.
"""

from __future__ import annotations

from kvcore.pools.alloc_args import SlotRequest
from kvcore.pools.array_ops import Array
from kvcore.pools.free_pages import FreePageRing

__all__ = ["decode_slots", "extend_slots"]


def extend_slots(ring: FreePageRing, pages: Array, req: SlotRequest) -> Array:
    """The slots of ``req`` (an extend) given its new ``pages``, in token order."""
    p = ring.page_size
    ops = ring.ops
    fresh = ring.expand(pages)
    last = req.last_host  # read by the argument check wherever a request continues a page
    pieces: list[Array] = []
    put, arange = pieces.append, ops.arange
    used = 0
    # One short piece per request costs less than a vectorised form's ~20 array ops up to
    # about a hundred requests (benchmarks/bench_allocator.py --batch-calls).
    for i, (a, b) in enumerate(zip(req.prefix, req.seq)):
        n1 = min(b, -(-a // p) * p) - a
        if n1 > 0:
            assert last is not None
            start = last[i] + 1
            put(arange(start, start + n1))
        rest = b - a - n1
        if rest > 0:
            put(fresh[used : used + rest])
            used += -(-rest // p) * p
    return ring.ops.cat(pieces)


def decode_slots(ring: FreePageRing, pages: Array, req: SlotRequest) -> Array:
    """The slot of each request's new token: ``last_loc + 1``, or the next new page where one starts."""
    out = req.last_loc + 1
    if len(pages):
        p = ring.page_size
        out[ring.ops.ints([i for i, a in enumerate(req.prefix) if a % p == 0])] = pages * p
    return out

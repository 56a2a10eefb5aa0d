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
    """The slots of ``req`` (an extend) given its new ``pages``, in token order.

    The new slots are runs of consecutive ids: per request, the rest of the prefix's
    page (from ``last_loc + 1``), then one run per new page.  The runs are laid out
    on the host from the lengths (cheap int arithmetic per request); one vectorised
    step (a dozen array ops, whatever the batch) expands them.
    """
    p = ring.page_size
    ops = ring.ops
    last = req.last_host  # read by the argument check wherever a request continues a page
    n_pages = len(pages)
    after: list[int] = []  # continuation starts: entries n_pages.. of the run-start candidates
    order: list[int] = []  # per run, its start among the candidates (new pages first)
    lens: list[int] = []
    used = 0
    for i, (a, b) in enumerate(zip(req.prefix, req.seq)):
        n1 = min(b, -(-a // p) * p) - a
        if n1 > 0:
            assert last is not None
            order.append(n_pages + len(after))
            after.append(last[i] + 1)
            lens.append(n1)
        rest = b - a - n1
        if rest > 0:
            m = -(-rest // p)
            order.extend(range(used, used + m))
            used += m
            lens.extend([p] * (m - 1))
            lens.append(rest - (m - 1) * p)
    if not lens:
        return ops.cat([])
    starts = ops.cat([pages * p, ops.of(after)])[ops.of(order)]
    run_lens = ops.of(lens)
    # Token t of run j is starts[j] + (t - first token of run j).
    first = ops.cumsum(run_lens) - run_lens
    return ops.repeat(starts - first, run_lens, req.num_tokens) + ops.arange(0, req.num_tokens)


def decode_slots(ring: FreePageRing, pages: Array, req: SlotRequest) -> Array:
    """The slot of each request's new token: ``last_loc + 1``, or the next new page where one starts."""
    out = req.last_loc + 1
    if len(pages):
        p = ring.page_size
        out[ring.ops.of([i for i, a in enumerate(req.prefix) if a % p == 0])] = pages * p
    return out

"""Small drivers that follow the engine protocol of docs/CONTRACT-NOTES.md.

Each helper does what an engine does for one request step, on the pools the
cache itself exposes (``req_to_token_pool``, ``token_to_kv_pool_allocator``), so
the conformance suite, the SWA suite and benchmarks drive every backend the
same way:

    req = make_req("r1", [1, 2, 3, 4, 5])
    admit(cache, req)            # match_prefix, lock, take a row, write the prefix
    prefill(cache, req, upto=3)  # a chunk: allocate, commit, cache_unfinished_req
    prefill(cache, req)          # the rest of the prompt
    decode(cache, req, 2)        # two generated tokens
    finish(cache, req)           # kvcore.release_kv_cache
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from kvcore.keys import RadixKey
from kvcore.record import Req, ceil_align

__all__ = [
    "make_req",
    "admit",
    "prefill",
    "decode",
    "finish",
    "run_request",
    "alloc_slots",
    "extend_slots",
    "check_invariants",
    "pool_total",
]


def make_req(
    rid: str,
    input_ids: Sequence[int],
    output_ids: Sequence[int] = (),
    *,
    extra_key: str | None = None,
    session_id: str | None = None,
) -> Req:
    """A fresh request holding nothing."""
    return Req(rid, list(input_ids), list(output_ids), extra_key=extra_key, session_id=session_id)


def alloc_slots(cache, n: int) -> torch.Tensor | None:
    """``n`` slots (page-aligned ``n`` when paged), evicting from the cache once if short."""
    if n <= 0:
        return torch.empty((0,), dtype=torch.int64)
    allocator = cache.token_to_kv_pool_allocator
    slots = allocator.alloc(n)
    if slots is None:
        cache.evict(n)
        slots = allocator.alloc(n)
    return slots


def extend_slots(cache, req: Req, end: int) -> bool:
    """Give ``req`` slots for row positions ``[kv_allocated_len, end)``; False (nothing changed) if short.

    With pages, positions inside the last partial page reuse that page (SGLang's
    rule: fill the partial page first, then whole new pages).
    """
    kv = req.kv
    start = kv.kv_allocated_len
    if end <= start:
        return True
    if end > cache.req_to_token_pool.max_context_len:
        raise ValueError(f"request {req.rid!r}: {end} tokens exceed the row width {cache.req_to_token_pool.max_context_len}")
    page = cache.page_size
    row = cache.req_to_token_pool.req_to_token[kv.req_pool_idx]
    parts = []
    pos = start
    if page > 1 and pos % page:
        fill_to = min(end, ceil_align(pos, page))
        last = int(row[pos - 1])
        parts.append(torch.arange(last + 1, last + 1 + fill_to - pos, dtype=torch.int64))
        pos = fill_to
    rest = end - pos
    if rest > 0:
        slots = alloc_slots(cache, ceil_align(rest, page))
        if slots is None:
            return False
        parts.append(slots[:rest].to(torch.int64).cpu())
    new = parts[0] if len(parts) == 1 else torch.cat(parts)
    row[start:end] = new.to(device=row.device, dtype=row.dtype)
    kv.kv_allocated_len = end
    return True


def _match(cache, key: RadixKey, req: Req):
    if req.session_id is not None and hasattr(cache, "try_match_prefix"):
        return cache.match_prefix(key, req)
    return cache.match_prefix(key)


def admit(cache, req: Req, max_prefix_len: int | None = None) -> bool:
    """Engine step 1: match, lock, take a row, write the prefix.  False (nothing held) when rows run out.

    ``max_prefix_len`` defaults to ``len(fill_ids) - 1`` (SGLang leaves one token to compute).
    """
    pool = cache.req_to_token_pool
    fill = req.fill_ids
    n = len(fill) - 1 if max_prefix_len is None else min(max_prefix_len, len(fill))
    n = max(n, 0)
    if not req.kv.is_held and pool.available_size() == 0:
        return False
    held_before = req.kv.is_held
    m = _match(cache, RadixKey(fill[:n], req.extra_key), req)
    restored = not held_before and req.kv.is_held
    prefix = m.device_indices
    plen = int(prefix.shape[0])
    req.prefix_indices = prefix
    req.last_node = m.last_device_node
    req.lock = cache.inc_lock_ref(req.last_node)
    if pool.alloc([req]) is None:
        cache.dec_lock_ref(req.last_node, req.lock)
        req.last_node = req.lock = None
        return False
    kv = req.kv
    if restored:
        # A streaming session handed its record back: the row already holds the prefix.
        return True
    if plen:
        pool.req_to_token[kv.req_pool_idx, :plen] = prefix.to(pool.req_to_token.dtype)
    kv.cache_protected_len = plen
    kv.kv_committed_len = kv.kv_allocated_len = plen
    return True


def prefill(cache, req: Req, upto: int | None = None, *, chunked: bool | None = None) -> bool:
    """Engine step 2: compute ``[committed, upto)`` (default: all of ``fill_ids``).

    When the chunk stops short of ``fill_ids`` (or ``chunked=True``) the committed
    prefix goes to the cache through ``kvcore.cache_unfinished_req``.  False, with
    nothing changed, when slots run short even after evicting.
    """
    from kvcore.release import cache_unfinished_req

    end = len(req.fill_ids) if upto is None else min(upto, len(req.fill_ids))
    if not extend_slots(cache, req, end):
        return False
    kv = req.kv
    kv.kv_committed_len = max(kv.kv_committed_len, end)
    if chunked is None:
        chunked = end < len(req.fill_ids)
    if chunked:
        cache_unfinished_req(req, cache, chunked=True)
    return True


def decode(cache, req: Req, n: int = 1, tokens: Iterable[int] | None = None) -> int:
    """Engine step 3: generate ``n`` tokens (default token: ``7``); returns how many got slots.

    SWA backends also free what left the window (``kvcore.free_swa_out_of_window_slots``).
    """
    toks = list(tokens) if tokens is not None else [7] * n
    done = 0
    kv = req.kv
    for tok in toks[:n]:
        if not extend_slots(cache, req, kv.kv_allocated_len + 1):
            break
        req.output_ids.append(tok)
        kv.kv_committed_len = kv.kv_allocated_len
        done += 1
        if cache.supports_swa() and getattr(cache, "sliding_window_size", None):
            from kvcore.release import free_window_slots

            free_window_slots(cache, [req], [req.seqlen - 1])
    return done


def finish(cache, req: Req, is_insert: bool = True) -> None:
    """Engine step 4: ``kvcore.release_kv_cache``.

    A request admitted with nothing allocated (no prefix hit, prefill never ran) is
    aborted instead: its lock and row go back, as an engine does for a dropped request.
    """
    from kvcore.release import release_kv_cache

    kv = req.kv
    if kv.is_held and kv.kv_allocated_len == 0 and kv.swa_evicted_seqlen == 0:
        if req.last_node is not None:
            cache.dec_lock_ref(req.last_node, req.lock)
        req.last_node = req.lock = None
        cache.req_to_token_pool.free(req)
        return

    release_kv_cache(req, cache, is_insert)


def run_request(cache, req: Req, *, chunk: int | None = None, decode_tokens: int = 0) -> bool:
    """Admit, prefill (in ``chunk``-token chunks), decode and finish one request."""
    if not admit(cache, req):
        return False
    ok = True
    total = len(req.fill_ids)
    if chunk:
        while ok and req.kv.kv_committed_len < total:
            ok = prefill(cache, req, req.kv.kv_committed_len + chunk)
    else:
        ok = prefill(cache, req)
    if ok and decode_tokens:
        decode(cache, req, decode_tokens)
    finish(cache, req)
    return ok


def check_invariants(cache, owners: Iterable[Any] = ()) -> list:
    """``kvcore.InvariantChecker(cache).check(owners=...)``."""
    from kvcore.invariants import InvariantChecker

    return InvariantChecker(cache).check(owners=list(owners))


def pool_total(cache) -> int:
    """Usable token slots of the (full) pool."""
    alloc = cache.token_to_kv_pool_allocator
    full = getattr(alloc, "full_attn_allocator", alloc)
    return int(full.size)

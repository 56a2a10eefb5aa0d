"""One-call engine steps for tests: thin wrappers over :class:`kvcore.engine.Engine`.

Each helper builds an ``Engine(cache, cache_prompt=False, release_idle_sessions=False)``
and does one step of the engine protocol (see ``kvcore.engine``), so the
conformance suite, the SWA suite and the benchmarks drive every backend the
same way::

    req = make_req("r1", [1, 2, 3, 4, 5])
    admit(cache, req)            # match_prefix, lock, take a row, write the prefix
    prefill(cache, req, upto=3)  # a chunk: allocate, commit, cache_unfinished_req(chunked=True)
    prefill(cache, req)          # the rest of the prompt
    decode(cache, req, 2)        # two generated tokens (window free first, one slot each)
    finish(cache, req)           # kvcore.release_kv_cache

Unlike ``Engine`` (whose default follows SGLang's scheduler), ``prefill`` does
not put a completed prompt in the cache: it goes in at ``finish``.  The helpers
keep no state between calls (idle sessions are not tracked); use an ``Engine``
for that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvcore.engine import Engine
from kvcore.record import Req

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache
    from kvcore.record import RetractionBackup

__all__ = [
    "make_req",
    "admit",
    "prefill",
    "decode",
    "finish",
    "abort",
    "retract",
    "resume",
    "run_request",
    "alloc_slots",
    "extend_slots",
    "check_invariants",
    "pool_total",
    "engine",
]

#: the token ``decode`` appends when none is given
DEFAULT_TOKEN = 7


def engine(cache: BasePrefixCache) -> Engine:
    """The engine the helpers drive ``cache`` with: no prompt caching at prefill, no automatic session release."""
    return Engine(cache, cache_prompt=False, release_idle_sessions=False)


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


def alloc_slots(cache: BasePrefixCache, n: int) -> torch.Tensor | None:
    """``n`` slots (page-aligned ``n`` when paged), after ``cache.make_room(n)`` once if short; None if still short."""
    return engine(cache).alloc_slots(n)


def extend_slots(cache: BasePrefixCache, req: Req, end: int) -> bool:
    """Give ``req`` slots for row positions ``[kv_allocated_len, end)``; False (nothing changed) if short.

    With pages, positions inside the last partial page reuse that page (SGLang's
    rule: fill the partial page first, then whole new pages).
    """
    return engine(cache).extend_slots(req, end)


def admit(cache: BasePrefixCache, req: Req, max_prefix_len: int | None = None) -> bool:
    """Engine step 1: match, lock, take a row, write the prefix.  False (nothing held) when rows run out.

    ``max_prefix_len`` defaults to ``len(fill_ids) - 1`` (SGLang leaves one token to compute).
    """
    return engine(cache).admit(req, max_prefix_len)


def prefill(cache: BasePrefixCache, req: Req, upto: int | None = None, *, chunked: bool | None = None) -> bool:
    """Engine step 2: compute ``[committed, upto)`` (default: all of ``fill_ids``).

    When the chunk stops short of ``fill_ids`` (or ``chunked=True``) the committed
    prefix goes to the cache through ``kvcore.cache_unfinished_req``.  False, with
    nothing changed, when slots run short even after evicting.
    """
    return engine(cache).extend(req, upto, chunked=chunked)


def decode(cache: BasePrefixCache, req: Req, n: int = 1, tokens: Iterable[int] | None = None) -> int:
    """Engine step 3: generate ``n`` tokens (default token: ``7``) one step at a time; returns how many got slots.

    Each step frees what left the window first (``cache.free_window_slots``).
    """
    toks = list(tokens) if tokens is not None else [DEFAULT_TOKEN] * n
    eng = engine(cache)
    done = 0
    for tok in toks[:n]:
        if not eng.decode([req], [tok]):
            break
        done += 1
    return done


def finish(cache: BasePrefixCache, req: Req, is_insert: bool = True) -> None:
    """Engine step 4: ``kvcore.release_kv_cache``.

    A request admitted with nothing allocated (no prefix hit, prefill never ran) is
    aborted instead: its lock and row go back, as an engine does for a dropped request.
    """
    engine(cache).finish(req, is_insert)


def abort(cache: BasePrefixCache, req: Req) -> None:
    """Give back everything ``req`` holds without caching any of it (``Engine.abort``)."""
    engine(cache).abort(req)


def retract(cache: BasePrefixCache, req: Req, mode: str = "recompute") -> RetractionBackup | None:
    """Abort ``req`` and ``req.reset_for_retract()``, keeping ``swa_evict_floor`` (``Engine.retract``).

    ``mode="offload"`` first backs the request's KV up to the host; returns that
    backup (None for a recompute).
    """
    return engine(cache).retract(req, mode)


def resume(cache: BasePrefixCache, req: Req) -> bool:
    """Bring an offload-retracted request back without recompute (``Engine.resume``); False if short."""
    return engine(cache).resume(req)


def run_request(cache: BasePrefixCache, req: Req, *, chunk: int | None = None, decode_tokens: int = 0) -> bool:
    """Admit, prefill (in ``chunk``-token chunks), decode and finish one request."""
    eng = engine(cache)
    if not eng.admit(req):
        return False
    ok = True
    total = len(req.fill_ids)
    if chunk:
        while ok and req.kv.kv_committed_len < total:
            ok = eng.extend(req, req.kv.kv_committed_len + chunk)
    else:
        ok = eng.extend(req)
    if ok and decode_tokens:
        decode(cache, req, decode_tokens)
    eng.finish(req)
    return ok


def check_invariants(cache: BasePrefixCache, owners: Iterable[Any] = ()) -> list:
    """``kvcore.InvariantChecker(cache).check(owners=...)``."""
    from kvcore.invariants import InvariantChecker

    return InvariantChecker(cache).check(owners=list(owners))


def pool_total(cache: BasePrefixCache) -> int:
    """Usable token slots of the ``full`` pool (the first pool ``cache.pools()`` lists)."""
    return cache.pools()[0].capacity

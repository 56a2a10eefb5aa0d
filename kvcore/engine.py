"""The engine protocol, driven in one place: what an engine does to a prefix cache.

kvcore is bookkeeping; an engine computes the KV.  Between the two runs a short
protocol that every scheduler follows (SGLang's ``ScheduleBatch`` and
``Scheduler``, kvcore's ``bench`` loop, the conformance kit, the stand-alone
benchmarks).  :class:`Engine` is that protocol written once, on the pools the
cache itself exposes, so that whatever the engine allocates goes back to the
allocator the cache frees to::

    engine = Engine(cache)                  # any built backend, or a StreamingSession over one
    req = Req("r1", prompt_ids)

    engine.admit(req)                       # 1. admission
    engine.extend(req, 512)                 # 2. a prefill chunk  (repeat)
    engine.extend(req)                      #    the last chunk
    engine.decode([req, other], [t1, t2])   # 3. one batched decode step (repeat)
    engine.finish(req)                      # 4. finish
    engine.check([other])                   # the invariant checker: nothing leaked

1. **Admit** (``admit`` = ``match`` + a row).  ``cache.match_prefix(RadixKey(
   fill_ids[:n], extra_key))`` with ``n = len(fill_ids) - 1`` by default (SGLang
   leaves one token to compute, so the first decode step has logits), or
   ``max_prefix_len``.  The matched node is locked (``inc_lock_ref``; the lock
   result is kept in ``req.lock`` so that ``dec_lock_ref`` gives exactly that
   back).  The request takes a req_to_token row, the matched slots are written at
   ``[0, prefix_len)`` of it, and ``kv_committed_len = kv_allocated_len =
   prefix_len``.  The cache owns ``[0, cache_protected_len)``: the match result's
   ``cache_protected_len`` where it names one, else ``prefix_len`` (SGLang's
   ``init_next_round_input``).
   On a :class:`~kvcore.StreamingSession` a follow-up turn of a live session gets
   the session's own record back instead (same row; the session frees the tail
   the new turn rewrites; the match names the record's own protected length, so
   the tree's part of the shared record is never overwritten with what the
   session reuses), and takes no second row.  When rows run
   short (after releasing idle sessions, see below) ``admit`` returns False with
   the lock dropped and nothing held.  A scheduler that wants to look at the
   prefix length before it commits (to check its memory budget) calls
   ``match`` first and then ``admit(req, matched=m)`` or ``cancel(m)``.

2. **Extend** (a prefill chunk, ``extend(req, end)``).  Slots for row positions
   ``[kv_allocated_len, end)`` come from the allocator with SGLang's rule: the
   rest of the last partial page first, then whole new pages (``alloc_extend``).
   They are written into the row, handed to ``kv_writer`` (the K/V computation
   writes there), and the record commits them (``kv_allocated_len =
   kv_committed_len = end``).  Then the cache learns about it:
   ``kvcore.cache_unfinished_req(req, cache, chunked=True)`` while more chunks
   follow (the tree takes the page-aligned committed prefix and the request's
   ``cache_protected_len`` moves up), and, once the prompt is complete,
   ``kvcore.cache_unfinished_req(req, cache)`` as SGLang's scheduler does, so
   requests arriving while this one decodes can share its prompt
   (``Engine(cache_prompt=False)`` leaves that to ``finish``).  With
   ``Engine(prefill_aware_swa=True)`` each chunk also sets ``swa_evict_floor``
   to its end (SGLang's scheduler, prefill-aware SWA).  A chunk cache
   frees what left the window before each later chunk
   (``cache.free_window_slots([req], [start])``, when the cache declares
   ``Capability.WINDOWED``).

3. **Decode** (``decode(reqs, tokens)``, one batched step).  First the window
   free of the whole batch in one call, ``cache.free_window_slots(reqs,
   pre_lens)`` with each record's allocated length (SGLang's ``seqlen - 1``),
   when the cache declares ``Capability.WINDOWED`` (``kvcore.capabilities``):
   it returns the slots that left the window.  Then one slot per request in one allocation
   (``alloc_decode``: a new page only where the last one is full), written at
   position ``kv_allocated_len`` of each row, the token appended to
   ``output_ids`` and ``kv_allocated_len = kv_committed_len`` one further.
   Schedulers that free the window on their own cadence pass
   ``free_window=False`` and call ``cache.free_window_slots(reqs)`` themselves.

4. **Finish** (``finish(req)``): ``kvcore.release_kv_cache``: the cache takes the
   committed KV (tree insert, duplicates freed, lock dropped), the
   over-allocation past the page-aligned committed length and the row go back,
   and the record is marked released.  A request admitted with nothing
   allocated is aborted instead (there is nothing to hand over).  On a
   StreamingSession a request with a ``session_id`` is saved into its session
   instead, which then counts as *idle* until its next turn is admitted.

Two more ways out:

* **Abort** (``abort(req)``): everything back, nothing inserted; a request that
  runs on a session's record takes the session with it (its KV was half
  rewritten by the aborted turn).
* **Retract** (``retract(req, mode="recompute")``): an abort, then
  ``req.reset_for_retract()`` (SGLang's): the released record is reset in place,
  keeping ``swa_evict_floor`` (the prefill-aware window floor) and its retraction
  backup; no prefix, node or lock; ``retraction_count`` one more.
  ``output_ids`` are kept: SGLang recomputes prompt and output, and so does
  re-admitting it here (``admit`` matches ``fill_ids``, ``extend`` prefills the
  rest of prompt + outputs, then it decodes on).  ``mode="offload"`` first copies the K/V of
  ``[0, seqlen - 1)`` and the cache's per-request state to the host
  (``kvcore.retraction.offload_kv_cache`` into ``kv.retraction_backup``); ``resume(req)`` later
  takes a row and slots again and loads it back (``kvcore.retraction.load_kv_cache``), so the
  request decodes on without recomputing its prefix.

**Disaggregated decode.**  A request that arrives with its KV computed by a
prefill server: ``pre_alloc(req)`` takes a row and slots for ``fill_len =
len(origin) + max(len(output) - 1, 0)`` positions and commits them (SGLang's
``_pre_alloc``), returns the slots the transfer writes to; ``process_prebuilt(req)``
once the transfer is done (the prefix goes to the cache), ``abort(req)`` if it
failed.  With ``pre_alloc_size=N`` the cache's row pool is a
``DecodeReqToTokenPool``: ``N`` rows for pre-allocated requests on top of
``max_num_reqs``.

**Release checks** (SGLang's): ``finish`` refuses a record with KV allocated past
the committed length unless ``Engine(speculative=True)``; the cache keeps
``req.effective_kv_committed_len()`` tokens (a hook: an engine that strips
reasoning tokens from the cache reports only the prompt, and the rest is freed
as over-allocation); ``ReqToTokenPool.alloc`` refuses a reused row that carries
no allocated KV.

**Allocation failure.**  Every allocation (``alloc_slots``, ``extend_slots``,
``extend``, ``alloc_decode``, ``decode``) that comes up short asks the cache to
``make_room(n)`` once (each pool's shortfall is evicted, the least recently
used first) and tries again; when it still does not fit it releases idle
sessions, least recently used first, while any are left (unless
``release_idle_sessions=False``), and otherwise reports failure (False, None or
0) with nothing changed: no slot taken, no record moved.  Only the evictions
and session releases it made stay (and, in ``decode``, the window free, which
any later step would do anyway).  What to do next (retract the newest request,
wait) is the scheduler's choice.

**Sessions.**  On a StreamingSession, ``finish`` of a turn with a ``session_id``
saves it into its session (first cut back to ``len(origin) + req.finished_len``
when speculative decoding overshot, SGLang's ``_trim_overshoot``) and
marks the session idle (``idle_sessions``, least recently used first);
admitting its next turn takes it off that list; ``end_session(sid)`` releases
it for good (the conversation is over); ``release_idle_session(keep=sid)``
releases the least recently used one (the engine does that itself when rows or
slots run short, unless ``release_idle_sessions=False``).

**For a scheduler with its own policy** (``kvcore bench``): ``match`` /
``admit(matched=)`` / ``cancel`` to check a budget between the match and the
row; ``fits(n)`` and ``make_room(n)`` to test and evict without allocating;
``alloc_decode(rows, seq_lens, seq_lens_cpu)`` for a decode step over tensors
the scheduler keeps itself (the records are then the scheduler's to move);
``kvcore.capabilities.windowed(cache).free_window_slots(reqs, pre_lens)`` on its own cadence with
``decode(..., free_window=False)``; ``release_idle_sessions=False`` to decide
itself when sessions go; ``on_evict`` and ``kv_writer`` for its counters and
K/V writes.

Nothing here knows a backend by name: windows, extra pools and their
shortfalls are the cache's business (its declared capabilities, ``make_room``,
``pools()``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcore.capabilities import windowed
from kvcore.keys import RadixKey, check_token_ids, checked_key
from kvcore.record import Req, ReqKvInfo, RetractionBackup, ceil_align
from kvcore.release import cache_unfinished_req, release_kv_cache
from kvcore.retraction import load_kv_cache, offload_kv_cache
from kvcore.session import StreamingSession

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache, EvictResult, LockResult, MatchResult
    from kvcore.invariants import PoolReport
    from kvcore.pools.req_to_token import ReqToTokenPool
    from kvcore.pools.views import TokenAllocator

__all__ = ["Engine", "Match"]

_EMPTY = torch.empty((0,), dtype=torch.int64)


@dataclass(slots=True, eq=False)
class Match:
    """A locked prefix match waiting to become an admission (``Engine.match``).

    Hand it to ``Engine.admit(req, matched=...)`` or give the lock back with
    ``Engine.cancel``.  ``restored`` is True when a streaming session handed its
    record back (the request then already holds a row).
    """

    req: Req
    result: MatchResult
    lock: LockResult
    restored: bool
    prefix_len: int

    @property
    def node(self) -> Any:
        return self.result.last_device_node


class Engine:
    """Drives ``cache`` through kvcore's engine protocol (see the module docstring).

    ``cache`` is a built backend or a :class:`~kvcore.StreamingSession` over one.
    ``kv_writer(slots)`` is called with every batch of slots the engine hands
    out (prefill chunks, decode steps) so a caller can write K/V there.
    ``cache_prompt``: put the prompt in the cache when its prefill completes
    (SGLang's scheduler does).  ``release_idle_sessions``: when rows or slots run
    short, release idle sessions (least recently used first) before failing.
    ``on_evict(result)`` sees every ``make_room`` the engine asks for.

    ``prefill_aware_swa``: every prefill chunk sets the record's
    ``swa_evict_floor`` to the chunk's end (SGLang's scheduler does this for
    each request of a prefill batch when the model runner is prefill-aware), so
    the prompt's window slots are never freed while it decodes.
    ``speculative``: speculative decoding may leave KV allocated past the
    committed length at finish; without it ``finish`` refuses such a record
    (SGLang's release assert).

    Counters: ``evict_calls`` (``make_room`` calls that had to evict),
    ``session_releases``, ``retractions``, ``offloaded_tokens`` /
    ``offloaded_bytes`` (host copies made by offload retractions) and
    ``loaded_bytes`` (copied back by ``resume``).
    """

    def __init__(
        self,
        cache: BasePrefixCache,
        *,
        kv_writer: Callable[[torch.Tensor], None] | None = None,
        cache_prompt: bool = True,
        release_idle_sessions: bool = True,
        on_evict: Callable[[EvictResult], None] | None = None,
        speculative: bool = False,
        prefill_aware_swa: bool = False,
    ) -> None:
        self._cache = cache
        # The window frees of a windowed cache (None without a window): declared once, asked once.
        self._window = windowed(cache)
        self._sessions = cache if isinstance(cache, StreamingSession) else None
        self._r2t = cache.req_to_token_pool
        # alloc_extend / alloc_decode (SGLang's batch allocation) are not in the TokenAllocator protocol yet.
        self._alloc: Any = cache.token_to_kv_pool_allocator
        self._page = int(cache.page_size)
        self._token_pools: list | None = None
        self.kv_writer = kv_writer
        self.cache_prompt = cache_prompt
        self.release_idle_sessions = release_idle_sessions
        self.on_evict = on_evict
        # Sessions whose last turn finished and whose next turn is not admitted yet, LRU first.
        self.idle_sessions: OrderedDict[str, None] = OrderedDict()
        self.evict_calls = 0
        self.session_releases = 0
        # Speculative decoding may leave allocated > committed at finish; without it that is a bug.
        self.speculative = speculative
        self.prefill_aware_swa = prefill_aware_swa
        self.retractions = 0
        self.offloaded_tokens = 0
        self.offloaded_bytes = 0
        self.loaded_bytes = 0

    # ------------------------------------------------------------------ what it runs on
    @property
    def cache(self) -> BasePrefixCache:
        return self._cache

    @property
    def page_size(self) -> int:
        return self._page

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        return self._r2t

    @property
    def allocator(self) -> TokenAllocator:
        return self._alloc

    @property
    def sessions(self) -> StreamingSession | None:
        """The StreamingSession the engine runs on, or None."""
        return self._sessions

    def check(self, owners: Iterable[Any] = ()) -> list[PoolReport]:
        """``kvcore.InvariantChecker(cache).check(owners)``: the requests alive now."""
        from kvcore.invariants import InvariantChecker

        return InvariantChecker(self._cache).check(owners=list(owners))

    # ------------------------------------------------------------------ room
    def _pools_for_tokens(self) -> list:
        if self._token_pools is None:
            # A new token takes a slot in every pool the row indexes (full, window, ...).
            self._token_pools = [v for v in self._cache.pools() if v.record_slots is None]
        return self._token_pools

    def fits(self, n: int) -> bool:
        """Whether ``n`` new token slots are free in every pool a token uses, without evicting."""
        return all(v.allocator.available_size() >= n for v in self._pools_for_tokens())

    def make_room(self, n: int) -> bool:
        """Evict (``cache.make_room``) so that ``n`` new token slots fit; True when they do."""
        if n <= 0 or self.fits(n):
            return True
        self._make_room(n)
        return self.fits(n)

    def _make_room(self, n: int) -> None:
        res = self._cache.make_room(n)
        self.evict_calls += 1
        if self.on_evict is not None:
            self.on_evict(res)

    # ------------------------------------------------------------------ sessions
    def session_is_live(self, session_id: str | None) -> bool:
        """Whether the engine's StreamingSession holds KV for ``session_id``."""
        s = self._sessions
        if s is None or session_id is None:
            return False
        slot = s.slots.get(session_id)
        return slot is not None and slot.kv.is_held

    def release_idle_session(self, keep: str | None = None) -> bool:
        """Release the least recently used idle session (not ``keep``); False when there is none."""
        for sid in self.idle_sessions:
            if sid != keep:
                self.end_session(sid)
                return True
        return False

    def end_session(self, session_id: str) -> int:
        """Release a session's KV (its last turn is over); returns the token slots freed."""
        self.idle_sessions.pop(session_id, None)
        s = self._sessions
        if s is None:
            return 0
        if session_id in s.slots:
            self.session_releases += 1
        return s.release_session(session_id)

    def _retry(
        self, attempt: Callable[[], torch.Tensor | None], need: int | Callable[[], int], keep: str | None
    ) -> torch.Tensor | None:
        """After ``attempt()`` failed once: make room for ``need``, then release idle sessions one by one.

        Only the short path comes here, so the common path pays no closure or call.
        """
        got: torch.Tensor | None = None
        n = need if isinstance(need, int) else need()
        if n > 0:
            self._make_room(n)
            got = attempt()
        while got is None and self.release_idle_sessions and self.release_idle_session(keep):
            if n > 0 and not self.fits(n):
                self._make_room(n)
            got = attempt()
        return got

    # ------------------------------------------------------------------ slots
    def alloc_slots(self, n: int, *, keep_session: str | None = None) -> torch.Tensor | None:
        """``n`` token slots (page-aligned ``n`` when paged), or None with nothing taken.

        Short: ``make_room(n)`` once, then idle sessions.  The caller owns the slots.
        """
        if n <= 0:
            return _EMPTY
        alloc = self._alloc
        slots = alloc.alloc(n)
        return slots if slots is not None else self._retry(lambda: alloc.alloc(n), n, keep_session)

    def extend_slots(self, req: Req, end: int) -> bool:
        """Slots for row positions ``[kv_allocated_len, end)`` of ``req``; False (nothing changed) if short.

        The rest of the last partial page first, then whole pages (SGLang's
        ``alloc_extend``).  Writes the row, hands the slots to ``kv_writer`` and
        moves ``kv_allocated_len``; committing is the caller's (``extend`` does it).
        """
        kv = req.kv
        if not kv.is_held:
            raise ValueError(f"request {req.rid!r} holds no req_to_token row; admit it first")
        start = kv.kv_allocated_len
        if end <= start:
            return True
        width = self._r2t.max_context_len
        if end > width:
            raise ValueError(f"request {req.rid!r}: {end} tokens exceed the row width {width}")
        row = kv.req_pool_idx
        n = end - start
        p = self._page
        alloc = self._alloc
        if p == 1:
            slots = alloc.alloc(n)
            if slots is None:
                slots = self._retry(lambda: alloc.alloc(n), n, req.session_id)
        else:
            last = int(self._r2t.req_to_token[row, start - 1]) if start else -1
            slots = alloc.alloc_extend([start], [start], [end], [end], [last], n)
            if slots is None:
                need = ceil_align(end, p) - ceil_align(start, p)
                slots = self._retry(
                    lambda: alloc.alloc_extend([start], [start], [end], [end], [last], n), need, req.session_id
                )
        if slots is None:
            return False
        self._r2t.write((row, slice(start, end)), slots)
        kv.kv_allocated_len = end
        if self.kv_writer is not None:
            self.kv_writer(slots)
        return True

    def alloc_decode(
        self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One slot for each row at position ``seq_lens[i]`` (the row's current length); None if short.

        ``rows`` and ``seq_lens`` are int64 tensors on the table's device,
        ``seq_lens_cpu`` the same lengths on the CPU (defaults to a copy).  A
        new page only where the last one is full.  Writes the table and hands the
        slots to ``kv_writer``; the records are the caller's to move.
        """
        n = int(rows.numel())
        if n == 0:
            return _EMPTY
        p = self._page
        alloc = self._alloc
        if p == 1:
            slots = alloc.alloc(n)
            if slots is None:
                slots = self._retry(lambda: alloc.alloc(n), n, None)
        else:
            lens_cpu = seq_lens.cpu() if seq_lens_cpu is None else seq_lens_cpu
            last = self._r2t.req_to_token[rows, seq_lens - 1].to(torch.int64)
            seq, seq_cpu = seq_lens + 1, lens_cpu + 1
            slots = alloc.alloc_decode(seq, seq_cpu, last)
            if slots is None:
                slots = self._retry(
                    lambda: alloc.alloc_decode(seq, seq_cpu, last), lambda: p * int((lens_cpu % p == 0).sum()), None
                )
        if slots is None:
            return None
        self._r2t.write((rows, seq_lens), slots.to(torch.int32))
        if self.kv_writer is not None:
            self.kv_writer(slots)
        return slots

    # ------------------------------------------------------------------ 1. admit
    def match(self, req: Req, max_prefix_len: int | None = None) -> Match:
        """Match ``req``'s prefix (session-aware) and lock it; nothing else is taken yet.

        ``max_prefix_len`` caps the key (default ``len(fill_ids) - 1``).
        """
        if req.kv.is_held:
            raise ValueError(
                f"request {req.rid!r} already holds KV (row {req.kv.req_pool_idx}); finish, abort or retract it first"
            )
        return self._match(req, self._admission_key(req, max_prefix_len))

    def _match(self, req: Req, key: RadixKey) -> Match:
        cache = self._cache
        result = cache.match_request(req, key)
        lock = cache.inc_lock_ref(result.last_device_node)
        return Match(req, result, lock, req.kv.is_held, int(result.device_indices.numel()))

    @staticmethod
    def _admission_key(req: Req, max_prefix_len: int | None) -> RadixKey:
        """The match key, every token id of the request checked once, before a row, a slot, a state or a
        session moves.  The key comes back marked checked, so the cache does not check it again."""
        if not req.origin_input_ids:
            raise ValueError(f"request {req.rid!r} has an empty prompt: nothing to compute (nothing was taken)")
        # A request that has generated nothing yet matches on its prompt: no fill_ids copy.
        fill = req.fill_ids if req.output_ids else req.origin_input_ids
        n = max(len(fill) - 1 if max_prefix_len is None else min(max_prefix_len, len(fill)), 0)
        key = checked_key(RadixKey(fill[:n], req.extra_key))
        check_token_ids(fill, n)  # the ids past the key (the last prompt token) too
        return key

    def cancel(self, m: Match) -> None:
        """Give back what ``match`` took: the lock (and a restored session record)."""
        self._cache.dec_lock_ref(m.node, m.lock)
        req = m.req
        if m.restored:
            # The record stays with its session; the request goes back to holding nothing.
            req.kv = ReqKvInfo(swa_evict_floor=req.kv.swa_evict_floor)
        req.prefix_indices = _EMPTY
        req.last_node = None
        req.lock = None

    def admit(self, req: Req, max_prefix_len: int | None = None, *, matched: Match | None = None) -> bool:
        """Match, lock, take a row, write the prefix.  False (nothing held, lock dropped) when rows run out."""
        if matched is None:
            if req.kv.is_held:
                raise ValueError(f"request {req.rid!r} already holds KV (row {req.kv.req_pool_idx}); "
                                 "finish, abort or retract it first")
            key = self._admission_key(req, max_prefix_len)
            if (
                not self.session_is_live(req.session_id)
                and self._r2t.available_size() == 0
                and not (self.release_idle_sessions and self._free_a_row(req.session_id))
            ):
                return False
            matched = self._match(req, key)
        elif matched.req is not req:
            raise ValueError(f"the match was made for {matched.req.rid!r}, not {req.rid!r}")
        m = matched
        kv = req.kv
        if not m.restored and not self._take_row(req):
            self.cancel(m)
            return False
        req.prefix_indices = m.result.device_indices
        req.last_node = m.node
        req.lock = m.lock
        plen = m.prefix_len
        if m.restored:
            self.idle_sessions.pop(req.session_id, None)  # type: ignore[arg-type]
        elif plen:
            self._r2t.write((kv.req_pool_idx, slice(0, plen)), m.result.device_indices)
        # SGLang: the match's protected length where it names one (a session's record: the tree's part of
        # it, not what the session reuses), else the matched length.
        protected = m.result.cache_protected_len
        kv.cache_protected_len = plen if protected is None else protected
        kv.kv_committed_len = kv.kv_allocated_len = plen
        return True

    def _free_a_row(self, keep: str | None) -> bool:
        while self._r2t.available_size() == 0:
            if not self.release_idle_session(keep):
                return False
        return True

    # ------------------------------------------------------------------ 2. extend
    def extend(self, req: Req, end: int | None = None, *, chunked: bool | None = None) -> bool:
        """Compute ``[kv_committed_len, end)`` of ``fill_ids`` (default: all of it) as one prefill chunk.

        ``chunked`` (default: ``end < len(fill_ids)``): more chunks follow, so
        ``cache_unfinished_req(chunked=True)``; otherwise the prefill is complete
        and, with ``cache_prompt``, ``cache_unfinished_req`` puts the prompt in
        the cache.  False, with nothing changed, when slots run short.
        """
        total = len(req.origin_input_ids) + len(req.output_ids)
        end = total if end is None else min(end, total)
        kv = req.kv
        start = kv.kv_allocated_len
        if end > start:
            if start > 0 and self._window is not None and self._cache.is_chunk_cache():
                # A chunk cache keeps only the window: free what left it before the next chunk (SGLang).
                self._window.free_window_slots([req], [start])
            if not self.extend_slots(req, end):
                return False
        if end > kv.kv_committed_len:
            kv.kv_committed_len = end
        if self.prefill_aware_swa:
            kv.swa_evict_floor = end
        if chunked is None:
            chunked = end < total
        if chunked:
            cache_unfinished_req(req, self._cache, chunked=True)
        elif self.cache_prompt:
            cache_unfinished_req(req, self._cache)
        return True

    # ------------------------------------------------------------------ 3. decode
    def decode(self, reqs: Sequence[Req], tokens: Sequence[int] | None = None, *, free_window: bool = True) -> int:
        """One batched decode step: a slot and a token for every request.

        ``tokens``: one sampled token per request (default ``0``).  Returns
        ``len(reqs)``, or 0 when the slots do not fit (no record moved).
        """
        reqs = list(reqs)
        if not reqs:
            return 0
        if tokens is None:
            tokens = [0] * len(reqs)
        elif len(tokens) != len(reqs):
            raise ValueError(f"{len(tokens)} tokens for {len(reqs)} requests")
        kvs = [req.kv for req in reqs]
        if len({id(kv) for kv in kvs}) != len(kvs):
            seen: set[int] = set()
            twice = next(r.rid for r in reqs if id(r.kv) in seen or seen.add(id(r.kv)))  # type: ignore[func-returns-value]
            raise ValueError(f"decode batch names request {twice!r} twice (one slot per request and step); "
                             "nothing was changed")
        lens = [kv.kv_allocated_len for kv in kvs]
        rows = [kv.req_pool_idx for kv in kvs]
        if None in rows or min(lens) == 0 or max(lens) >= self._r2t.max_context_len:
            for req, n in zip(reqs, lens):
                if not req.kv.is_held or n == 0:
                    raise ValueError(f"request {req.rid!r} has no prefilled KV to decode after")
                if n >= self._r2t.max_context_len:
                    raise ValueError(f"request {req.rid!r}: {n + 1} tokens exceed the row width")
        if free_window and self._window is not None:
            self._window.free_window_slots(reqs, lens)
        dev = self._r2t.req_to_token.device
        lens_cpu = torch.tensor(lens, dtype=torch.int64)
        seq = lens_cpu.to(dev)
        slots = self.alloc_decode(torch.tensor(rows, dtype=torch.int64, device=dev), seq, lens_cpu)
        if slots is None:
            return 0
        for req, kv, n, tok in zip(reqs, kvs, lens, tokens):
            req.output_ids.append(tok)
            kv.kv_allocated_len = kv.kv_committed_len = n + 1
        return len(reqs)

    # ------------------------------------------------------------------ 4. finish, abort, retract
    def finish(self, req: Req, is_insert: bool = True) -> None:
        """``kvcore.release_kv_cache``; a request holding nothing allocated is aborted instead."""
        kv = req.kv
        if not kv.is_held:
            return
        cache = self._cache
        if kv.kv_allocated_len == 0 and kv.swa_evicted_seqlen == 0:
            # release_kv_cache checks the record on the other path; this one frees through it here.
            kv.check_fields(f"request {req.rid!r}", self._page, self._r2t.max_context_len,
                            windowed=self._window is not None)
            self._drop(req)
            return
        release_kv_cache(req, cache, is_insert, speculative=self.speculative)
        sid = req.session_id
        if sid is not None and self.session_is_live(sid):
            self.idle_sessions[sid] = None
            self.idle_sessions.move_to_end(sid)

    def abort(self, req: Req) -> None:
        """Give back everything ``req`` holds without caching any of it."""
        s = self._sessions
        sid = req.session_id
        if s is not None and sid is not None and sid in s.slots and req.kv is s.slots[sid].kv:
            # The turn ran on the session's record and rewrote its tail: the session goes too.
            req.detach_kv()  # the turn stops running on the record, which the session then releases
            self.end_session(sid)
        elif req.kv.is_held:
            if req.kv.kv_allocated_len == 0 and req.kv.swa_evicted_seqlen == 0:
                self._drop(req)
            elif s is not None:
                # An aborted first turn must not become a session.
                s.abort_req(req)
            else:
                release_kv_cache(req, self._cache, is_insert=False)
        req.prefix_indices = _EMPTY
        req.last_node = None
        req.lock = None

    def retract(self, req: Req, mode: str = "recompute") -> RetractionBackup | None:
        """Take ``req`` out of the running batch: everything back, then ``req.reset_for_retract()``.

        ``mode="recompute"``: the request is admitted again later and recomputes
        its prefix (what the tree still holds is matched).  ``mode="offload"``
        (SGLang's decode-side retraction): first a host copy of the K/V of
        ``[0, seqlen - 1)`` and of the cache's per-request state
        (``kvcore.retraction.offload_kv_cache``) goes to ``req.kv.retraction_backup``, and
        ``resume`` later puts it back without recomputing.  A request that has
        not computed ``seqlen - 1`` positions yet (a chunked prefill) has nothing
        to resume from and is retracted for recompute.  The record keeps its
        ``swa_evict_floor`` (and the backup); returns the backup or None.
        """
        if mode not in ("recompute", "offload"):
            raise ValueError(f"retract mode {mode!r}: expected 'recompute' or 'offload'")
        kv = req.kv
        if not kv.is_held:
            raise ValueError(f"request {req.rid!r} is not running (it holds no KV): there is nothing to retract")
        backup = None
        if mode == "offload" and kv.is_held and 0 < req.seqlen - 1 <= kv.kv_allocated_len:
            backup = offload_kv_cache(req, self._r2t, self._cache)
            self.offloaded_tokens += backup.num_tokens
            self.offloaded_bytes += backup.nbytes
        floor = kv.swa_evict_floor
        self.abort(req)
        if req.kv is not kv:
            # The turn ran on a session's record, which went with the session: carry what the request keeps.
            req.kv.swa_evict_floor = floor
        req.kv.retraction_backup = backup
        req.reset_for_retract()
        self.retractions += 1
        return backup

    def resume(self, req: Req) -> bool:
        """Bring an offload-retracted request back: a row, slots for ``[0, seqlen - 1)``, the backup loaded.

        As SGLang's decode side resumes a retracted request (``_pre_alloc`` then
        ``load_kv_cache``): nothing is matched, the request then decodes on.  With
        ``cache_prompt`` its KV goes to the cache as a finished prefill would
        (``cache_unfinished_req``).  False, with nothing held and the backup kept,
        when rows or slots run short.
        """
        kv = req.kv
        backup = kv.retraction_backup
        if backup is None:
            raise ValueError(f"request {req.rid!r} has no retraction backup; admit it to recompute instead")
        if kv.is_held:
            raise ValueError(f"request {req.rid!r} already holds row {kv.req_pool_idx}")
        n = req.seqlen - 1
        if n != backup.num_tokens:
            raise ValueError(f"request {req.rid!r}: backup of {backup.num_tokens} positions, seqlen - 1 is {n}")
        if not self._take_row(req):
            return False
        kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = 0
        if not self.extend_slots(req, n):
            self._r2t.free(req)
            return False
        kv.kv_committed_len = n
        load_kv_cache(req, self._r2t, self._cache)
        self.loaded_bytes += backup.nbytes
        req.is_retracted = False
        if self.cache_prompt:
            cache_unfinished_req(req, self._cache)
        return True

    def _take_row(self, req: Req) -> bool:
        """A req_to_token row for ``req`` (releasing idle sessions when short, unless told not to)."""
        if self._r2t.alloc([req]) is not None:
            return True
        return (
            self.release_idle_sessions
            and self._free_a_row(req.session_id)
            and self._r2t.alloc([req]) is not None
        )

    # ------------------------------------------------------------------ disaggregated decode
    def pre_alloc(self, req: Req, *, match_prefix: bool = False) -> torch.Tensor | None:
        """Decode side of disaggregated serving: take a row and slots before the KV arrives.

        SGLang's ``DecodePreallocQueue._pre_alloc``: the request comes from a
        prefill server with its first output token, so ``fill_len =
        len(origin_input_ids) + max(len(output_ids) - 1, 0)`` positions are
        allocated and committed now (the transfer fills them).  ``match_prefix``
        (a decode-side radix cache) reuses the cached prefix and allocates only
        the rest.  Returns the slots the transfer writes to (row positions
        ``[prefix_len, fill_len)``), or None with nothing held when rows or slots
        run short.  Then ``process_prebuilt(req)`` once the transfer is done, or
        ``abort(req)`` when it failed.  On a ``DecodeReqToTokenPool`` the rows for
        pre-allocated requests come on top of the running ones.
        """
        fill_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        if fill_len <= 0:
            raise ValueError(f"request {req.rid!r} has no prompt to receive KV for")
        if not self.admit(req, max_prefix_len=fill_len if match_prefix else 0):
            return None
        kv = req.kv
        start = kv.kv_allocated_len
        if not self.extend_slots(req, fill_len):
            self.abort(req)
            return None
        kv.kv_committed_len = fill_len
        return self._r2t.req_to_token[kv.req_pool_idx, start:fill_len].to(torch.int64)

    def process_prebuilt(self, req: Req) -> None:
        """The KV of a pre-allocated request arrived: it joins the running batch (SGLang's ``process_prebuilt``).

        With ``cache_prompt`` the received prefix goes to the cache
        (``cache_unfinished_req``) so later requests can share it.
        """
        kv = req.kv
        if not kv.is_held or kv.kv_committed_len == 0:
            raise ValueError(f"request {req.rid!r} was not pre-allocated (pre_alloc it first)")
        if self.cache_prompt:
            cache_unfinished_req(req, self._cache)

    def _drop(self, req: Req) -> None:
        """Unlock and give the row back: for a record that allocated nothing."""
        if req.last_node is not None:
            self._cache.dec_lock_ref(req.last_node, req.lock)
        req.last_node = req.lock = None
        self._r2t.free(req)


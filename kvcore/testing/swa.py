"""Conformance scenarios for sliding-window-attention backends.

:class:`SWACacheConformance` extends :class:`kvcore.testing.PrefixCacheConformance`
(so the generic scenarios run too).  Subclass it in a test module, one line::

    class TestMySWA(SWACacheConformance):
        backend = "my-swa"

The kit builds the backend with the common options plus ``sliding_window_size``
and ``swa_size``; page sizes, prefix reuse and the hypothesis budget come from
the backend and the profile as in the generic kit.  A backend under this kit
runs on two pools, ``full`` and a ``windowed`` one (``cache.pools()``), and
implements SGLang's SWA names: ``sliding_window_size``, ``evict(num_tokens,
swa_num_tokens)``, ``full_/swa_`` evictable and protected sizes and
``dec_swa_lock_only(node, lock)``.  Override :meth:`SWACacheConformance.self_check`
to run a backend's own consistency check after every step.

Scenarios: out-of-window freeing during decode (both pools bounded and balanced),
a prompt kept by ``swa_evict_floor`` through a long decode (and returned on finish),
retraction, chunked prefill, streaming sessions, a seeded mixed workload, and for
tree caches (skipped when ``cache.is_chunk_cache()``) a match across a tombstone,
the fall back to the last valid point, healing (also under a full lock), inserts
with ``swa_evicted_seqlen``, a window lock that stops at the window (and survives
splits), early window unlock, eviction counts of both pools, and a hypothesis
state machine with window eviction and early unlocks.  Every scenario ends with
``kvcore.InvariantChecker``, which counts both pools.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from kvcore.capabilities import WindowedCache, WindowLockRelease, window_lock_release, windowed
from kvcore.engine import Engine
from kvcore.invariants import InvariantChecker
from kvcore.keys import RadixKey
from kvcore.record import Req, floor_align
from kvcore.testing.conformance import CacheStateMachine, PrefixCacheConformance
from kvcore.testing.profiles import state_machine_settings

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache, MatchResult
    from kvcore.invariants import PoolReport
    from kvcore.record import ReqKvInfo

__all__ = ["SWACacheConformance", "SWACacheStateMachine", "SWAEngine", "window_slots_held", "pool_available"]


def window_slots_held(kv: ReqKvInfo, page_size: int = 1) -> int:
    """Window slots a running record holds itself (DESIGN.md, "Window side").

    ``[cache_protected_len, kv_allocated_len)`` less ``[swa_dead_lo, swa_evicted_seqlen)``,
    which the window free already returned: a floor above the protected prefix keeps
    the window slots of ``[cache_protected_len, swa_dead_lo)`` with the request.
    """
    if not kv.is_held:
        return 0
    held = max(0, kv.kv_allocated_len - kv.cache_protected_len)
    dead_lo = kv.swa_dead_lo(page_size)
    dead_hi = min(kv.swa_evicted_seqlen, kv.kv_allocated_len)
    return held - max(0, dead_hi - dead_lo)


def pool_available(cache: BasePrefixCache) -> dict[str, int]:
    """Free slots per pool name (``cache.pools()``)."""
    return {v.name: v.available() for v in cache.pools()}


def declared_window(cache: BasePrefixCache) -> WindowedCache:
    """``cache`` as a windowed cache; AssertionError naming the backend when it does not declare
    ``Capability.WINDOWED`` (every backend this kit tests frees window slots as requests decode)."""
    window = windowed(cache)
    assert window is not None, f"{type(cache).__name__} does not declare Capability.WINDOWED: the SWA kit needs it"
    return window


def declared_lock_release(cache: BasePrefixCache) -> WindowLockRelease:
    """``cache`` as a :class:`~kvcore.capabilities.WindowLockRelease`; AssertionError naming the backend when it
    does not declare ``Capability.WINDOW_LOCK_RELEASE`` (SGLang's SWA trees and chunk caches all answer it)."""
    release = window_lock_release(cache)
    assert release is not None, (
        f"{type(cache).__name__} does not declare Capability.WINDOW_LOCK_RELEASE: the SWA kit releases window locks")
    return release


class SWAEngine:
    """A test engine over :class:`kvcore.engine.Engine` that keeps the requests alive now.

    admit (match the whole ``fill_ids``, lock, row), prefill in chunks
    (``cache_unfinished_req`` between chunks; a chunk cache frees its window after
    each), decode one token at a time (the window free after each), finish
    (``release_kv_cache``).  Running out of rows or slots raises.  With
    ``release_window_lock_after=N`` a request drops the window part of its tree lock
    (``dec_swa_lock_only``) after N decoded tokens, as SGLang does with
    ``SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW``.  ``sanity_check()``, when
    given, runs after every ``check``.
    """

    def __init__(
        self,
        cache: BasePrefixCache,
        *,
        release_window_lock_after: int | None = None,
        sanity_check: Callable[[], Any] | None = None,
    ) -> None:
        self.cache = cache
        self.window = declared_window(cache)
        self.engine = Engine(cache, cache_prompt=False, release_idle_sessions=False)
        self.checker = InvariantChecker(cache)
        self.live: list[Req] = []
        self.release_window_lock_after = release_window_lock_after
        self.sanity_check = sanity_check
        self._decoded: dict[int, int] = {}

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    def check(self, extra: Iterable[Any] = ()) -> list[PoolReport]:
        reports = self.checker.check(owners=list(self.live) + list(extra))
        if self.sanity_check is not None:
            self.sanity_check()
        return reports

    def admit(self, req: Req, match: MatchResult | None = None) -> Req:
        if not self.engine.admit(req, len(req.fill_ids)):
            raise RuntimeError("no req_to_token row left")
        self.live.append(req)
        self._decoded[id(req)] = 0
        return req

    def prefill(self, req: Req, chunk: int | None = None) -> None:
        """Compute the prompt (all of ``fill_ids``) in chunks of ``chunk`` tokens."""
        eng = self.engine
        total = req.seqlen
        chunk = chunk or total
        while req.kv.kv_allocated_len < total:
            end = min(total, req.kv.kv_allocated_len + chunk)
            if not eng.extend(req, end, chunked=end < total):
                raise MemoryError(f"cannot allocate slots up to {end} for {req.rid!r}")
            if self.cache.is_chunk_cache():
                self.window.free_window_slots([req])

    def decode(self, req: Req, token: int) -> None:
        eng = self.engine
        if not eng.decode([req], [token], free_window=False):
            raise MemoryError(f"cannot allocate a decode slot for {req.rid!r}")
        self.window.free_window_slots([req])
        n = self._decoded[id(req)] = self._decoded.get(id(req), 0) + 1
        after = self.release_window_lock_after
        if after is not None and n == after:
            lock = req.lock
            if req.last_node is not None and lock is not None and not lock.swa_released:
                declared_lock_release(self.cache).dec_swa_lock_only(req.last_node, lock)

    def finish(self, req: Req, is_insert: bool = True) -> None:
        self.live.remove(req)
        self.engine.finish(req, is_insert)

    def retract(self, req: Req) -> None:
        """Give everything back for recompute (``Engine.retract``)."""
        self.live.remove(req)
        self.engine.retract(req)

    def run(self, prompt: Sequence[int], decode: Sequence[int] = (), rid: str = "r", **kw: Any) -> Req:
        req = self.admit(Req(rid, list(prompt), **kw))
        self.prefill(req)
        for t in decode:
            self.decode(req, t)
        return req


class SWACacheStateMachine(CacheStateMachine):
    """The generic state machine plus window eviction and early window unlocks.

    After every step the invariant checker counts both pools, and a backend with
    ``sanity_check()`` recounts its sizes and LRU orders.
    """

    def __init__(self, build: Callable[..., BasePrefixCache], page_size: int, reuse: bool | None = None,
                 self_check: Callable[[Any], Any] | None = None) -> None:
        super().__init__(build, page_size, reuse)
        self.self_check = self_check

    @rule(n=st.integers(0, 120), m=st.integers(0, 120))
    def evict_both(self, n: int, m: int) -> None:
        cache: Any = self.cache  # evict(num_tokens, swa_num_tokens): the SWA backends' API, not BasePrefixCache's
        before = pool_available(cache)
        res = cache.evict(n, m)
        after = pool_available(cache)
        assert (after["full"] - before["full"], after["swa"] - before["swa"]) == (
            res.num_tokens_evicted,
            res.swa_num_tokens_evicted,
        )

    @precondition(lambda self: self.locks or self.live)
    @rule(i=st.integers(0, 100))
    def release_window_lock(self, i: int) -> None:
        holders = [(n, lk) for n, lk in self.locks] + [(r.last_node, r.lock) for r in self.live]
        node, lock = holders[i % len(holders)]
        if node is None or lock is None or lock.swa_released:
            return
        if self.cache.is_chunk_cache():
            return
        declared_lock_release(self.cache).dec_swa_lock_only(node, lock)

    @rule()
    def sanity(self) -> None:
        if self.self_check is not None:
            self.self_check(self.cache)



def _toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


class SWACacheConformance(PrefixCacheConformance):
    """SWA scenarios every sliding-window backend passes; subclass it with ``backend = "name"``."""

    #: the generic scenarios build caches with these (a window of 8 tokens; swa_size defaults to size)
    backend_options: dict = {"sliding_window_size": 8}
    #: options every SWA scenario cache gets, on top of the ones it sets itself
    swa_extra_options: dict = {}

    @pytest.fixture
    def swa_cache(self, make_cache: Callable[..., BasePrefixCache], page_size: int) -> Callable[..., Any]:
        """``swa_cache(window_pages=2, **options)``: a cache with W = window_pages pages."""

        def build(window_pages: float = 2, **options: Any) -> BasePrefixCache:
            p = page_size
            opts = dict(
                page_size=p,
                sliding_window_size=max(1, int(window_pages * p)),
                size=256 * p,
                swa_size=128 * p,
                max_num_reqs=16,
                max_context_len=64 * p,
            )
            opts.update(self.swa_extra_options)
            opts.update(options)
            return make_cache(**opts)

        return build

    # ------------------------------------------------------------------ helpers

    def self_check(self, cache: BasePrefixCache) -> None:
        """The backend's own consistency check, run after every engine check; override it (default: none)."""

    def swa_engine(self, cache: BasePrefixCache, **kw: Any) -> SWAEngine:
        """An :class:`SWAEngine` over ``cache`` whose ``check`` also runs :meth:`self_check`."""
        return SWAEngine(cache, sanity_check=lambda: self.self_check(cache), **kw)

    @staticmethod
    def _tree_only(cache: BasePrefixCache) -> None:
        if cache.is_chunk_cache():
            pytest.skip("tree scenario: chunk caches keep no prefix")

    @staticmethod
    def _pool_deltas(cache: BasePrefixCache, before: tuple[int, int]) -> tuple[int, int]:
        now = SWACacheConformance._avail(cache)
        return now[0] - before[0], now[1] - before[1]

    @staticmethod
    def _avail(cache: BasePrefixCache) -> tuple[int, int]:
        a = pool_available(cache)
        return a["full"], a["swa"]

    # ------------------------------------------------------------------ traits and sizes

    def test_swa_traits(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        views = cache.pools()
        assert [v.name for v in views][:2] == ["full", "swa"]
        assert not views[0].windowed and views[1].windowed
        assert set(cache.cached_sizes()) >= {"full", "swa"}
        assert cache.sliding_window_size == 2 * cache.page_size
        assert cache.full_evictable_size() == cache.swa_evictable_size() == 0
        assert cache.full_protected_size() == cache.swa_protected_size() == 0
        res = cache.evict(0, 0)
        assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 0)
        with pytest.raises(ValueError):
            cache.evict(-1)
        with pytest.raises(ValueError):
            cache.evict(0, -1)
        self.swa_engine(cache).check()

    # ------------------------------------------------------------------ decode frees the window

    def test_swa_evict_floor_keeps_the_prompt_window(self, swa_cache: Callable[..., Any]) -> None:
        """Prefill-aware SWA: ``swa_evict_floor`` keeps the prompt's window slots through a long decode.

        The window slots of ``[cache_protected_len, swa_dead_lo)`` stay mapped and the
        request's own (DESIGN.md "Window side"); the rest stays bounded by the window;
        on finish every window slot goes back (SGLang 0.5.19 leaks the floor's part).
        """
        cache = swa_cache()
        p, w = cache.page_size, cache.sliding_window_size
        eng = self.swa_engine(cache)
        prompt = _toks(3 * p + 1, 50)
        req = eng.admit(Req("r", prompt))
        req.kv.swa_evict_floor = len(prompt)
        eng.prefill(req)
        swa = next(v for v in cache.pools() if v.windowed)
        row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        lo = req.kv.cache_protected_len
        for step in range(8 * max(w, p)):
            eng.decode(req, step % 5)
            dead_lo = req.kv.swa_dead_lo(p)
            kept = row[lo : min(dead_lo, req.kv.kv_allocated_len)].to(torch.int64)
            if swa.translate is not None:
                kept = swa.translate(kept)
            assert bool((kept > 0).all()), f"step {step}: the floor's window slots were freed"
            assert not bool(torch.isin(kept, swa.allocator.free_slots()).any()), step
            assert window_slots_held(req.kv, p) <= (dead_lo - lo) + w + 2 * p, (step, req.kv)
            if step % p == 0:
                eng.check()
        assert req.kv.swa_evicted_seqlen > req.kv.swa_dead_lo(p)
        eng.finish(req)
        eng.check()
        cache.evict(10**9, 10**9)
        assert all(v.available() == v.capacity for v in cache.pools())
        eng.check()

    def test_swa_decode_frees_out_of_window_slots(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        p, w = cache.page_size, cache.sliding_window_size
        eng = self.swa_engine(cache)
        reqs = [eng.admit(Req(f"r{i}", _toks(3 * p + i, 1000 * i))) for i in range(3)]
        for r in reqs:
            eng.prefill(r)
        bound = w + 2 * p
        for step in range(6 * p):
            for r in reqs:
                eng.decode(r, 7 + step)
                assert window_slots_held(r.kv, p) <= bound, (r, bound)
            if step % p == 0:
                reports = {rep.pool: rep for rep in eng.check()}
                assert reports["swa"].uncached <= 3 * bound
        for r in reqs:
            assert r.kv.swa_evicted_seqlen > 0
            assert r.kv.swa_evicted_seqlen % p == 0
        for r in reqs:
            eng.finish(r)
            eng.check()
        if not cache.is_chunk_cache():
            # The decoded tails went into the tree, their out-of-window part as tombstones.
            assert cache.full_evictable_size() > cache.swa_evictable_size()
        cache.evict(10**9, 10**9)
        assert all(v.available() == v.capacity for v in cache.pools())
        eng.check()

    def test_swa_retract_mid_decode(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        p = cache.page_size
        eng = self.swa_engine(cache)
        base = eng.run(_toks(4 * p, 0), rid="base")
        eng.finish(base)
        r = eng.run(_toks(4 * p, 0) + _toks(p + 1, 500), _toks(5 * p, 900), rid="victim")
        assert r.kv.cache_protected_len > 0 or cache.is_chunk_cache()
        eng.check()
        eng.finish(r, is_insert=False)
        eng.check()
        # Retracted: nothing of it was inserted.
        if not cache.is_chunk_cache():
            m = cache.match_prefix(RadixKey(r.fill_ids))
            assert m.prefix_len == 4 * p
        eng.check()

    def test_swa_chunked_prefill(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        p = cache.page_size
        eng = self.swa_engine(cache)
        r = eng.admit(Req("chunky", _toks(10 * p + p // 2 + 1, 50)))
        eng.prefill(r, chunk=3 * p)
        eng.check()
        protected = r.kv.cache_protected_len
        if not cache.is_chunk_cache():
            assert protected == 9 * p  # the chunks before the last one are in the tree
        for t in range(3 * p):
            eng.decode(r, t)
        eng.check()
        eng.finish(r)
        eng.check()
        if not cache.is_chunk_cache():
            # Decode freed the window of [protected, cursor): inserted as a tombstone, so a
            # query ending inside it falls back to the chunked part...
            assert cache.match_prefix(RadixKey(_toks(10 * p, 50))).prefix_len == protected
            # ...while the whole request keeps W live tokens after it.
            full = floor_align(r.seqlen, p)
            assert cache.match_prefix(RadixKey(r.fill_ids[:full])).prefix_len == full
        eng.check()

    def test_swa_session_turns(self, swa_cache: Callable[..., Any]) -> None:
        from kvcore.session import StreamingSession

        inner = swa_cache()
        session = StreamingSession(inner)
        p = inner.page_size
        eng = self.swa_engine(session)
        t1 = eng.run(_toks(3 * p, 10), _toks(4 * p, 300), rid="t1", session_id="s")
        eng.finish(t1)
        eng.check()
        t2 = eng.admit(Req("t2", t1.fill_ids + _toks(p, 700), session_id="s"))
        assert t2.kv is session.slots["s"].kv
        eng.prefill(t2)
        for t in range(4 * p):
            eng.decode(t2, t)
            assert window_slots_held(t2.kv, p) <= inner.sliding_window_size + 2 * p
        eng.check()
        eng.finish(t2)
        eng.check()
        session.release_session("s")
        eng.check()
        inner.evict(10**9, 10**9)
        assert all(v.available() == v.capacity for v in inner.pools())
        eng.check()

    def test_swa_random_workload(self, swa_cache: Callable[..., Any]) -> None:
        """Mixed shared prefixes, chunked prefill, decode, early window unlock, evictions, retracts."""
        cache = swa_cache(window_pages=1.5, size=512 * 16, swa_size=96 * 16)
        p = cache.page_size
        eng = self.swa_engine(cache, release_window_lock_after=cache.sliding_window_size)
        rng = random.Random(1234 + p)
        bases = [_toks(5 * p, 0), _toks(3 * p, 0) + _toks(3 * p, 200), _toks(4 * p, 400)]
        for it in range(60):
            if eng.live and (rng.random() < 0.35 or len(eng.live) >= 5):
                r = eng.live[rng.randrange(len(eng.live))]
                eng.finish(r, is_insert=rng.random() < 0.85)
            else:
                tail = [rng.randrange(50) for _ in range(rng.randrange(1, 2 * p))]
                prompt = rng.choice(bases)[: rng.randrange(1, 6 * p)] + tail
                r = eng.admit(Req(f"r{it}", prompt, extra_key=rng.choice([None, None, "lora"])))
                eng.prefill(r, chunk=rng.choice([None, p, 2 * p]))
                for _ in range(rng.randrange(0, 4 * p)):
                    eng.decode(r, rng.randrange(50))
            eng.check()
            if rng.random() < 0.25:
                before = self._avail(cache)
                res = cache.evict(rng.randrange(3 * p), rng.randrange(3 * p))
                assert self._pool_deltas(cache, before) == (
                    res.num_tokens_evicted,
                    res.swa_num_tokens_evicted,
                )
                eng.check()
        for r in list(eng.live):
            eng.finish(r)
        eng.check()

    # ------------------------------------------------------------------ tombstones

    def _two_branches(self, cache: BasePrefixCache, eng: SWAEngine) -> tuple[list[int], list[int]]:
        """Tree: A=[0,4P) with children B=[4P,8P) and C=[4P,8P)' ; returns (key_b, key_c)."""
        p = cache.page_size
        key_b = _toks(8 * p, 0)
        key_c = _toks(4 * p, 0) + _toks(4 * p, 5000)
        eng.finish(eng.run(key_b, rid="b"))
        eng.finish(eng.run(key_c, rid="c"))
        eng.check()
        return key_b, key_c

    def _tombstone_shared_prefix(self, cache: Any, key_b: list[int], key_c: list[int]) -> None:
        """Window-lock both leaves (W <= 4P covers only them) and window-evict A = [0, 4P)."""
        p = cache.page_size
        locks = []
        for key in (key_b, key_c):
            m = cache.match_prefix(RadixKey(key))
            locks.append((m.last_device_node, cache.inc_lock_ref(m.last_device_node)))
        # A window lock holds one window: each leaf is cut at W = 2P below its end (SGLang's
        # UnifiedRadixCache), so the locks hold 2P window tokens each and the whole full path.
        assert cache.swa_protected_size() == 4 * p and cache.full_protected_size() == 12 * p
        before = self._avail(cache)
        res = cache.evict(0, 4 * p)
        assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 4 * p)
        assert self._pool_deltas(cache, before) == (0, 4 * p)
        for node, lock in locks:
            cache.dec_lock_ref(node, lock)
        assert cache.full_evictable_size() == 12 * p and cache.swa_evictable_size() == 8 * p

    def test_swa_match_across_tombstone(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size  # W = 2P
        eng = self.swa_engine(cache)
        key_b, key_c = self._two_branches(cache, eng)
        self._tombstone_shared_prefix(cache, key_b, key_c)
        eng.check()
        # Full match: 4P live tokens after the tombstone >= W.
        assert cache.match_prefix(RadixKey(key_b)).prefix_len == 8 * p
        # Exactly W live after the tombstone is still valid.
        assert cache.match_prefix(RadixKey(key_b[: 6 * p])).prefix_len == 6 * p
        # Fewer than W live after the tombstone: fall back to before the tombstone (the root).
        m = cache.match_prefix(RadixKey(key_b[: 5 * p]))
        assert m.prefix_len == 0
        assert cache.match_prefix(RadixKey(key_b[: 4 * p])).prefix_len == 0
        eng.check()

    def test_swa_match_falls_back_to_last_valid_point(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()  # W = 2P
        self._tree_only(cache)
        p = cache.page_size
        a = cache.token_to_kv_pool_allocator
        key = _toks(10 * p, 0)
        cache.insert(RadixKey(key[: 4 * p]), a.alloc(4 * p))
        x = cache.match_prefix(RadixKey(key[: 4 * p])).device_indices
        new = a.alloc(6 * p)
        a.free_swa(new[: 2 * p])  # [4P, 6P) left the window
        res = cache.insert(RadixKey(key), torch.cat([x, new]), prev_prefix_len=4 * p, swa_evicted_seqlen=6 * p)
        assert res.prefix_len == 4 * p
        # X = [0, 4P) live, Y = [4P, 6P) tombstone, Z = [6P, 10P) live.
        assert cache.full_evictable_size() == 10 * p and cache.swa_evictable_size() == 8 * p
        m = cache.match_prefix(RadixKey(key[: 7 * p]))  # only P live after Y: back to X's end
        assert m.prefix_len == 4 * p and torch.equal(m.device_indices, x)
        assert cache.match_prefix(RadixKey(key[: 8 * p])).prefix_len == 8 * p
        assert cache.match_prefix(RadixKey(key[: 5 * p])).prefix_len == 4 * p
        assert cache.match_prefix(RadixKey(key + [1, 2])).prefix_len == 10 * p
        self.swa_engine(cache).check()

    def test_swa_heal_tombstone(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        key_b, key_c = self._two_branches(cache, eng)
        self._tombstone_shared_prefix(cache, key_b, key_c)
        assert cache.match_prefix(RadixKey(key_b[: 4 * p] + _toks(p, 4242))).prefix_len == 0
        swa_before = cache.swa_evictable_size()
        r = eng.run(key_b[: 4 * p] + _toks(p, 4242), rid="healer")
        assert r.kv.cache_protected_len == 0
        eng.finish(r)
        # A got r's live window slots back; the new leaf was added too.
        assert cache.swa_evictable_size() == swa_before + 4 * p + p
        assert cache.match_prefix(RadixKey(key_b[: 4 * p])).prefix_len == 4 * p
        eng.check()

    def test_swa_heal_tombstone_under_a_full_lock(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        key_b, key_c = self._two_branches(cache, eng)
        self._tombstone_shared_prefix(cache, key_b, key_c)
        holder = eng.admit(Req("holder", key_b + [1]))  # locks B (window) and A (full only)
        assert holder.kv.cache_protected_len == 8 * p
        # The window lock holds one window (W = 2P) of B, the full lock the whole path.
        assert cache.full_protected_size() == 8 * p and cache.swa_protected_size() == 2 * p
        held = holder.prefix_indices[: 4 * p].clone()
        eng.prefill(holder)
        r = eng.run(key_b[: 4 * p] + _toks(p, 31337), rid="healer")
        eng.finish(r)
        # The locked full slots stay where the holder reads them.
        m = cache.match_prefix(RadixKey(key_b[: 4 * p]))
        assert m.prefix_len == 4 * p and torch.equal(m.device_indices, held)
        eng.check()
        eng.finish(holder)
        eng.check()

    def test_swa_insert_stores_evicted_part_as_tombstone(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p, w = cache.page_size, cache.sliding_window_size
        a = cache.token_to_kv_pool_allocator
        slots = a.alloc(8 * p)
        a.free_swa(slots[: 4 * p])  # the window left these
        res = cache.insert(RadixKey(_toks(8 * p, 0)), slots, swa_evicted_seqlen=4 * p)
        assert res.prefix_len == 0
        assert cache.full_evictable_size() == 8 * p and cache.swa_evictable_size() == 4 * p
        owners = list(cache.iter_owned_slots())
        assert sum(o.slots.numel() for o in owners if o.pool == "full") == 8 * p
        assert sum(o.slots.numel() for o in owners if o.pool == "swa") == 4 * p
        assert cache.match_prefix(RadixKey(_toks(8 * p, 0))).prefix_len == 8 * p  # 4P >= W live
        assert cache.match_prefix(RadixKey(_toks(5 * p, 0))).prefix_len == (5 * p if p >= w else 0)
        # A duplicate insert frees the caller's copy (both sides above the cursor).
        dup = a.alloc(8 * p)
        before = self._avail(cache)
        assert cache.insert(RadixKey(_toks(8 * p, 0)), dup, prev_prefix_len=0).prefix_len == 8 * p
        # The tombstone part [0, 4P) was healed with dup's live window slots.
        d_full, d_swa = self._pool_deltas(cache, before)
        assert d_full == 8 * p and d_swa == 4 * p
        assert cache.swa_evictable_size() == 8 * p
        self.swa_engine(cache).check()

    def test_swa_insert_all_dead_tail_keeps_its_full_slots(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        a = cache.token_to_kv_pool_allocator
        slots = a.alloc(4 * p)
        before = self._avail(cache)
        cache.insert(RadixKey(_toks(4 * p, 0)), slots, swa_evicted_seqlen=4 * p)
        # A leaf whose window is all gone keeps its full slots (a stateless leaf, SGLang's unified
        # tree): the window side goes back, no match can end there, full eviction takes it.
        assert cache.full_evictable_size() == 4 * p and cache.swa_evictable_size() == 0
        assert self._pool_deltas(cache, before) == (0, 4 * p)
        assert cache.match_prefix(RadixKey(_toks(4 * p, 0))).prefix_len == 0
        res = cache.evict(p, 0)
        assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (4 * p, 0)
        assert cache.total_size() == 0
        self.swa_engine(cache).check()

    # ------------------------------------------------------------------ locks

    def _chain(self, cache: BasePrefixCache, eng: SWAEngine, pages_per_node: int = 2, nodes: int = 3) -> list[int]:
        """A chain of ``nodes`` internal-ish nodes of ``pages_per_node`` pages, via siblings."""
        p = cache.page_size
        n = pages_per_node * p
        key = _toks(nodes * n, 0)
        eng.finish(eng.run(key, rid="chain"))
        for i in range(1, nodes):
            eng.finish(eng.run(key[: i * n] + _toks(p, 10000 * i), rid=f"sib{i}"))
        eng.check()
        return key

    def test_swa_window_lock_stops_at_the_window(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()  # W = 2P
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        key = self._chain(cache, eng)
        m = cache.match_prefix(RadixKey(key))
        assert m.prefix_len == 6 * p
        lock = cache.inc_lock_ref(m.last_device_node)
        assert lock.delta == 6 * p
        assert lock.stop is not None
        assert cache.full_protected_size() == 6 * p and cache.swa_protected_size() == 2 * p
        # Window eviction may take the window of the unlocked upper nodes, not the locked tail.
        res = cache.evict(0, 10**6)
        assert cache.swa_protected_size() == 2 * p
        assert res.num_tokens_evicted == 2 * p  # the two sibling leaves, both sides
        assert cache.match_prefix(RadixKey(key)).prefix_len == 6 * p  # W live after the tombstones
        cache.dec_lock_ref(m.last_device_node, lock)
        assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
        with pytest.raises(ValueError):
            cache.dec_lock_ref(m.last_device_node, lock)
        self.swa_engine(cache).check()

    def test_swa_window_lock_survives_a_split(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache(window_pages=3)  # W = 3P: the lock covers the leaf and half the middle node
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        key = self._chain(cache, eng)
        m = cache.match_prefix(RadixKey(key))
        lock = cache.inc_lock_ref(m.last_device_node)
        assert cache.swa_protected_size() == 3 * p  # one window
        # Split the middle node [2P, 4P) at 3P, and the leaf at 5P.
        cache.match_prefix(RadixKey(key[: 3 * p] + _toks(p, 99999)))
        cache.match_prefix(RadixKey(key[: 5 * p]))
        assert cache.swa_protected_size() == 3 * p
        cache.dec_lock_ref(m.last_device_node, lock)
        assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
        self.swa_engine(cache).check()

    def test_swa_early_window_unlock(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p, w = cache.page_size, cache.sliding_window_size
        eng = self.swa_engine(cache)
        prompt = _toks(4 * p, 0)
        eng.finish(eng.run(prompt, rid="warm"))
        r = eng.run(prompt + [1], rid="long")
        assert r.kv.cache_protected_len == 4 * p
        assert cache.swa_protected_size() > 0
        for t in range(w + 2 * p):
            eng.decode(r, t)
        eng.check()
        res = cache.dec_swa_lock_only(r.last_node, r.lock)
        assert res.extras["swa_delta"] < 0
        assert cache.swa_protected_size() == 0
        assert cache.full_protected_size() == 4 * p
        eng.check()
        with pytest.raises(ValueError):
            cache.dec_swa_lock_only(r.last_node, r.lock)
        cache.evict(0, 10**6)
        eng.check()
        eng.finish(r)
        assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
        eng.check()

    def test_swa_dec_lock_on_unlocked_node_is_rejected(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        eng.finish(eng.run(_toks(4 * p, 0), rid="x"))
        m = cache.match_prefix(RadixKey(_toks(4 * p, 0)))
        sizes = cache.cached_sizes()
        with pytest.raises(ValueError):
            cache.dec_lock_ref(m.last_device_node)
        assert cache.cached_sizes() == sizes
        eng.check()

    def test_swa_early_unlock_without_a_window_lock_is_refused(self, swa_cache: Callable[..., Any]) -> None:
        """``dec_swa_lock_only`` on a node no lock holds, or a second time, is a ValueError that changes nothing."""
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        eng.finish(eng.run(_toks(4 * p, 0), rid="x"))
        node = cache.match_prefix(RadixKey(_toks(4 * p, 0))).last_device_node
        state = (pool_available(cache), cache.cached_sizes(), cache.full_protected_size(), cache.swa_protected_size())

        def same() -> bool:
            return state == (pool_available(cache), cache.cached_sizes(), cache.full_protected_size(),
                             cache.swa_protected_size())

        with pytest.raises(ValueError, match="holds no window lock to give back"):
            cache.dec_swa_lock_only(node)
        assert same()
        lock = cache.inc_lock_ref(node)
        cache.dec_swa_lock_only(node, lock)
        state = (pool_available(cache), cache.cached_sizes(), cache.full_protected_size(), cache.swa_protected_size())
        with pytest.raises(ValueError):
            cache.dec_swa_lock_only(node, lock)
        with pytest.raises(ValueError, match="holds no window lock to give back"):
            cache.dec_swa_lock_only(node)
        assert same()
        cache.dec_lock_ref(node, lock)
        assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
        eng.check()

    # ------------------------------------------------------------------ evict

    def test_swa_evict_reports_both_counts(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        self._two_branches(cache, eng)
        before = self._avail(cache)
        res = cache.evict(p, 0)
        d = self._pool_deltas(cache, before)
        assert d == (res.num_tokens_evicted, res.swa_num_tokens_evicted)
        assert res.num_tokens_evicted >= p and res.swa_num_tokens_evicted == res.num_tokens_evicted
        eng.check()
        before = self._avail(cache)
        res = cache.evict(0, 4 * p)
        assert self._pool_deltas(cache, before) == (res.num_tokens_evicted, res.swa_num_tokens_evicted)
        assert res.swa_num_tokens_evicted >= 4 * p
        eng.check()
        before = self._avail(cache)
        res = cache.evict(10**6, 10**6)
        assert self._pool_deltas(cache, before) == (res.num_tokens_evicted, res.swa_num_tokens_evicted)
        assert cache.full_evictable_size() == 0 and cache.swa_evictable_size() == 0
        eng.check()

    def test_swa_full_eviction_keeps_an_uncovered_tombstone_until_asked(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        key_b, key_c = self._two_branches(cache, eng)
        self._tombstone_shared_prefix(cache, key_b, key_c)
        before = self._avail(cache)
        res = cache.evict(8 * p, 0)  # both leaves; the tombstone they uncover is a leaf now, and stays
        assert res.num_tokens_evicted == 8 * p and res.swa_num_tokens_evicted == 8 * p
        assert self._pool_deltas(cache, before) == (8 * p, 8 * p)
        assert cache.total_size() == 4 * p
        res = cache.evict(1, 0)  # the next full eviction takes it (no window slots left to give)
        assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (4 * p, 0)
        assert cache.total_size() == 0
        eng.check()

    # ------------------------------------------------------------------ errors

    def test_swa_bad_insert_leaves_tree_unchanged(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        eng.finish(eng.run(_toks(4 * p, 0), rid="x"))
        sizes = cache.cached_sizes()
        a = cache.token_to_kv_pool_allocator
        slots = a.alloc(4 * p)
        avail = self._avail(cache)
        bad = [
            dict(key=_toks(4 * p, 0), value=slots[:-1]),
            dict(key=_toks(4 * p, 0), value=slots.float()),
            dict(key=[-1] + _toks(4 * p - 1, 0), value=slots),
            dict(key=_toks(4 * p, 0), value=slots, prev_prefix_len=-p),
            dict(key=_toks(4 * p, 0), value=slots, prev_prefix_len=8 * p),
        ]
        if p > 1:
            bad.append(dict(key=_toks(4 * p, 0), value=slots, swa_evicted_seqlen=1))
        for kw in bad:
            with pytest.raises((ValueError, TypeError)):
                cache.insert(kw.pop("key"), **kw)
            assert cache.cached_sizes() == sizes and self._avail(cache) == avail
        a.free(slots)
        eng.check()

    def test_swa_extra_key_isolation(self, swa_cache: Callable[..., Any]) -> None:
        cache = swa_cache()
        self._tree_only(cache)
        p = cache.page_size
        eng = self.swa_engine(cache)
        eng.finish(eng.run(_toks(4 * p, 0), rid="a", extra_key="lora-a"))
        assert cache.match_prefix(RadixKey(_toks(4 * p, 0), "lora-b")).prefix_len == 0
        assert cache.match_prefix(RadixKey(_toks(4 * p, 0))).prefix_len == 0
        assert cache.match_prefix(RadixKey(_toks(4 * p, 0), "lora-a")).prefix_len == 4 * p
        eng.check()

    def test_swa_state_machine(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        """The generic rules plus window eviction and early window unlocks."""
        reuse = self.supports_prefix_reuse

        def factory() -> SWACacheStateMachine:
            return SWACacheStateMachine(build, page_size, reuse, self_check=self.self_check)

        run_state_machine_as_test(
            cast(Any, factory),
            settings=state_machine_settings(self.state_machine_examples, self.state_machine_steps),
        )

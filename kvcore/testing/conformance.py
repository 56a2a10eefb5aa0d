"""The conformance suite every prefix-cache backend runs (see ``kvcore.testing``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvcore.capabilities import check_declared, sparse, stateful, window_lock_release, windowed
from kvcore.keys import RadixKey
from kvcore.record import floor_align
from kvcore.testing.helpers import (
    admit,
    alloc_slots,
    check_invariants,
    decode,
    finish,
    make_req,
    pool_total,
    prefill,
    run_request,
)
from kvcore.testing.profiles import state_machine_settings

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache, InsertResult
    from kvcore.record import Req

__all__ = [
    "PrefixCacheConformance", "CacheStateMachine", "snapshot", "backend_page_sizes", "insert_owned", "random_tokens",
]


def snapshot(cache: BasePrefixCache) -> tuple:
    """What must not change when a call is refused: sizes, free slots, owned slots."""
    owned = sorted((o.pool, o.owner, tuple(o.slots.tolist())) for o in cache.iter_owned_slots())
    return (
        cache.evictable_size(),
        cache.protected_size(),
        cache.total_size(),
        cache.cached_sizes(),
        [(v.name, v.available()) for v in cache.pools()],
        owned,
    )


def backend_page_sizes(backend: str) -> tuple[int, ...]:
    """The page sizes the kit runs ``backend`` at: its config's default page size, plus 16 when that is 1.

    A backend whose pools come in one page size (npu: 128) declares it as the
    default of its config model's ``page_size`` field.
    """
    from kvcore.plugins import get_backend

    # BackendNotFound says which plugins did not load and why (a bare KeyError at collection did not).
    spec = get_backend(backend)
    default = spec.config.model_fields["page_size"].default
    default = int(default) if isinstance(default, int) and default > 0 else 1
    return (1, 16) if default == 1 else (default,)


def random_tokens(rng: random.Random, n: int, vocab: int = 50) -> list[int]:
    """``n`` token ids drawn from ``rng`` below ``vocab``."""
    return [rng.randrange(vocab) for _ in range(n)]


def insert_owned(cache: BasePrefixCache, key: RadixKey, reuse: bool | None) -> InsertResult | None:
    """Insert ``key`` with fresh slots and free what the cache did not keep; returns the InsertResult."""
    page = cache.page_size
    n = len(key)
    aligned = floor_align(n, page)
    slots = alloc_slots(cache, -(-n // page) * page)
    if slots is None:
        return None
    res = cache.insert(key, slots[:n])
    # The cache keeps [prefix_len, aligned); duplicates and the partial page are the caller's,
    # except where insert freed the duplicates itself (SGLang's SWARadixCache does).
    if res.duplicates_freed:
        keep_from = 0
    else:
        keep_from = res.prefix_len if reuse else aligned
    drop = [d for d in (slots[:keep_from], slots[aligned:]) if d.numel()]
    if drop:
        cache.token_to_kv_pool_allocator.free(torch.cat(drop))
    return res


class PrefixCacheConformance:
    """Behaviour every backend must show.  Subclass it in a test module, one line::

        from kvcore.testing import PrefixCacheConformance

        class TestMyCache(PrefixCacheConformance):
            backend = "mycache"

    The kit builds the backend with ``kvcore.create_cache(backend, size=...,
    page_size=..., max_num_reqs=..., max_context_len=..., **backend_options)``.
    Everything else has a default read from the backend, and a class attribute
    overrides it:

    * ``page_sizes``: the default of the backend config's ``page_size`` field,
      plus 16 when that is 1 (so ``(1, 16)``; a backend whose config defaults to
      128 runs at ``(128,)``);
    * ``supports_prefix_reuse``: ``not cache.is_chunk_cache()``;
    * ``backend_options``: extra ``create_cache`` options for every build;
    * ``state_machine_examples`` / ``state_machine_steps``: the hypothesis
      budget at the ``dev`` profile; ``KVCORE_HYPOTHESIS_PROFILE=ci|long``
      scales it (``kvcore.testing.profiles``);
    * ``fuzz_ops`` / ``fuzz_seeds`` / ``fuzz_bad_rate`` / ``fuzz_check_every``:
      ``test_fuzz``, a short ``kvcore fuzz`` run per seed and page size (3,000
      operations, seed 0, 5% bad inputs, the checker every 50 operations).

    A backend that is not registered (or needs a wrapper) overrides the
    ``make_cache`` fixture instead: a callable ``make_cache(**options) -> cache``.
    Every test ends with ``kvcore.InvariantChecker``.  Run with
    ``pytest --import-mode=importlib``.
    """

    #: the registered backend name the kit builds (or override ``make_cache``)
    backend: str | None = None
    #: None: ``not cache.is_chunk_cache()``
    supports_prefix_reuse: bool | None = None
    #: None: from the backend's config (see the class docstring)
    page_sizes: tuple[int, ...] | None = None
    backend_options: dict = {}
    # Hypothesis budget of the state machine at the dev profile.
    state_machine_examples: int = 40
    state_machine_steps: int = 30
    #: test_fuzz: operations per seed, the seeds, the share of bad inputs, checker period
    fuzz_ops: int = 3000
    fuzz_seeds: tuple[int, ...] = (0,)
    fuzz_bad_rate: float = 0.05
    fuzz_check_every: int = 50

    # -- parametrization and fixtures --------------------------------------------

    @classmethod
    def conformance_page_sizes(cls) -> tuple[int, ...]:
        """The page sizes this class runs at: ``page_sizes``, else the backend's."""
        if cls.page_sizes is not None:
            return tuple(cls.page_sizes)
        if cls.backend is not None:
            return backend_page_sizes(cls.backend)
        return (1, 16)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # pytest calls this for every test of the class: one run per page size.
        if "page_size" in metafunc.fixturenames:
            sizes = type(self).conformance_page_sizes()
            metafunc.parametrize("page_size", sizes, ids=[f"page{p}" for p in sizes])

    @pytest.fixture
    def make_cache(self) -> Callable[..., Any]:
        """``make_cache(**options) -> cache``: ``kvcore.create_cache(self.backend, **options)``."""
        name = self.backend
        if name is None:
            raise TypeError(
                f"{type(self).__name__}: set `backend = \"<registered name>\"` or override the make_cache fixture"
            )
        from kvcore.factory import create_cache

        def build(**options: Any) -> BasePrefixCache:
            return create_cache(name, **options)

        return build

    @pytest.fixture
    def build(self, make_cache: Callable[..., BasePrefixCache], page_size: int) -> Callable[..., Any]:
        """``build(pages=64, rows=8, width_pages=16, **extra)`` -> cache."""

        def _build(pages: int = 64, rows: int = 8, width_pages: int = 16, **extra: Any) -> BasePrefixCache:
            opts = dict(self.backend_options)
            opts.update(extra)
            cache = make_cache(
                size=pages * page_size,
                page_size=page_size,
                max_num_reqs=rows,
                max_context_len=max(width_pages * page_size, 64),
                **opts,
            )
            if self.supports_prefix_reuse is None:
                # This instance runs one test: settle the trait from the backend itself.
                self.supports_prefix_reuse = not cache.is_chunk_cache()
            return cache

        return _build

    # -- scenarios --------------------------------------------------------------

    def test_pools_exposed(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        assert cache.page_size == page_size
        assert cache.token_to_kv_pool_allocator.page_size == page_size
        assert cache.req_to_token_pool.size == 8
        assert cache.evictable_size() == cache.protected_size() == 0
        check_invariants(cache)

    def test_declared_capabilities_answer(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        """What the cache declares in ``capabilities`` (:mod:`kvcore.capabilities`) it defines and answers,
        through a request's life; what it does not declare no caller reaches (the accessors answer None)."""
        cache = build()
        check_declared(cache, type(cache).__name__)
        views = (windowed(cache), window_lock_release(cache), stateful(cache), sparse(cache))
        assert all(v is None or v is cache for v in views)
        req = make_req("declared", list(range(1, 3 * page_size + 2)))
        assert admit(cache, req) and prefill(cache, req)
        decode(cache, req, 2)
        win, state, sp = views[0], views[2], views[3]
        if win is not None:
            assert win.free_window_slots([req]) >= 0
        if state is not None:
            assert state.request_state_slots(req.kv) >= 0
        if sp is not None:
            assert sp.sparse_top_k() > 0
        finish(cache, req)
        check_invariants(cache)

    def test_empty_cache_matches_nothing(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        for key in ([], [1, 2, 3], RadixKey(list(range(3 * page_size)), "ns")):
            m = cache.match_prefix(key)
            assert m.device_indices.dtype == torch.int64
            assert m.device_indices.numel() == 0
        check_invariants(cache)

    def test_insert_returns_prefix_len(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        key = list(range(1, 3 * page_size + 1))
        first = insert_owned(cache, RadixKey(key), self.supports_prefix_reuse)
        assert first is not None and first.prefix_len == 0
        check_invariants(cache)
        second = insert_owned(cache, RadixKey(key + [99] * page_size), self.supports_prefix_reuse)
        assert second is not None
        check_invariants(cache)
        m = cache.match_prefix(key + [5])
        if self.supports_prefix_reuse:
            assert second.prefix_len == len(key)
            assert m.device_indices.numel() == len(key)
            assert cache.total_size() == len(key) + page_size
        else:
            assert second.prefix_len == 0
            assert m.device_indices.numel() == 0
        check_invariants(cache)

    def test_match_is_page_aligned(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        insert_owned(cache, RadixKey(key), self.supports_prefix_reuse)
        for probe_len in range(0, 2 * page_size + 2):
            probe = key[:probe_len] + [1000]
            got = cache.match_prefix(probe).device_indices.numel()
            if self.supports_prefix_reuse:
                assert got == floor_align(min(probe_len, len(key)), page_size)
            else:
                assert got == 0
            assert got % page_size == 0
        check_invariants(cache)

    def test_finished_request_returns_or_caches_every_slot(
        self, build: Callable[..., BasePrefixCache], page_size: int
    ) -> None:
        cache = build()
        total = pool_total(cache)
        rng = random.Random(1)
        req = make_req("a", random_tokens(rng, 3 * page_size + 3))
        assert run_request(cache, req, decode_tokens=2)
        check_invariants(cache)
        alloc = cache.token_to_kv_pool_allocator
        assert alloc.available_size() + cache.evictable_size() == total
        assert cache.protected_size() == 0
        if self.supports_prefix_reuse:
            assert cache.evictable_size() == floor_align(3 * page_size + 3 + 2, page_size)
            again = make_req("b", req.fill_ids + [1])
            assert admit(cache, again)
            assert again.kv.cache_protected_len == floor_align(len(req.fill_ids), page_size)
            check_invariants(cache, [again])
            finish(cache, again)
        else:
            assert alloc.available_size() == total
        check_invariants(cache)

    def test_lock_and_unlock(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        insert_owned(cache, RadixKey(key), self.supports_prefix_reuse)
        m = cache.match_prefix(key)
        before = (cache.evictable_size(), cache.protected_size())
        lock = cache.inc_lock_ref(m.last_device_node)
        if self.supports_prefix_reuse:
            assert cache.protected_size() == before[1] + len(key)
            assert cache.evictable_size() == before[0] - len(key)
            assert lock.delta == len(key)
        check_invariants(cache)
        # Locked entries survive eviction.
        cache.evict(10**6)
        assert cache.match_prefix(key).device_indices.numel() == (len(key) if self.supports_prefix_reuse else 0)
        cache.dec_lock_ref(m.last_device_node, lock)
        assert (cache.evictable_size(), cache.protected_size()) == before
        check_invariants(cache)

    def test_evict_frees_only_unlocked(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        total = pool_total(cache)
        a = [1] * page_size + list(range(2, 2 + 2 * page_size))
        b = [2] * page_size + list(range(100, 100 + 2 * page_size))
        insert_owned(cache, RadixKey(a), self.supports_prefix_reuse)
        insert_owned(cache, RadixKey(b), self.supports_prefix_reuse)
        ma = cache.match_prefix(a)
        lock = cache.inc_lock_ref(ma.last_device_node)
        protected = cache.protected_size()
        res = cache.evict(10**6)
        assert res.num_tokens_evicted >= 0
        assert cache.evictable_size() == 0
        assert cache.protected_size() == protected
        assert cache.token_to_kv_pool_allocator.available_size() == total - protected
        if self.supports_prefix_reuse:
            assert res.num_tokens_evicted == len(b)
            assert cache.match_prefix(a).device_indices.numel() == len(a)
            assert cache.match_prefix(b).device_indices.numel() == 0
        check_invariants(cache)
        cache.dec_lock_ref(ma.last_device_node, lock)
        cache.evict(10**6)
        assert cache.token_to_kv_pool_allocator.available_size() == total
        check_invariants(cache)

    def test_evicted_node_is_detached_and_refuses_locks(self, build: Callable[..., BasePrefixCache],
                                                        page_size: int) -> None:
        """An evicted node drops its ``parent`` link, and ``inc_lock_ref`` / ``dec_lock_ref`` on it are
        refused (TypeError or ValueError) with nothing changed: a lock on a node the tree no longer holds
        would protect slots that are free again."""
        cache = build()
        if not self.supports_prefix_reuse:
            pytest.skip("no tree: nothing is ever evicted")
        total = pool_total(cache)
        key = [3] * page_size + list(range(200, 200 + 2 * page_size))
        insert_owned(cache, RadixKey(key), self.supports_prefix_reuse)
        node = cache.match_prefix(key).last_device_node
        assert node is not None and node is not cache.root_node
        cache.evict(10**6)
        assert cache.token_to_kv_pool_allocator.available_size() == total
        assert getattr(node, "parent", None) is None, (
            f"an evicted node keeps its parent link ({node!r}): set node.parent = None when evicting it"
        )
        before = snapshot(cache)
        for call in (cache.inc_lock_ref, cache.dec_lock_ref):
            with pytest.raises((TypeError, ValueError)):
                call(node)
            assert snapshot(cache) == before, f"{call.__name__} of an evicted node changed the cache"
        check_invariants(cache)

    def test_evict_nothing(self, build: Callable[..., BasePrefixCache]) -> None:
        cache = build()
        assert cache.evict(0).num_tokens_evicted == 0
        assert cache.evict(5).num_tokens_evicted == 0
        check_invariants(cache)

    def test_extra_key_isolation(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        insert_owned(cache, RadixKey(key, "tenant-a"), self.supports_prefix_reuse)
        assert cache.match_prefix(RadixKey(key, "tenant-b")).device_indices.numel() == 0
        assert cache.match_prefix(key).device_indices.numel() == 0
        hit = cache.match_prefix(RadixKey(key, "tenant-a")).device_indices.numel()
        assert hit == (len(key) if self.supports_prefix_reuse else 0)
        # Same tokens under another namespace are a fresh insert.
        res = insert_owned(cache, RadixKey(key, "tenant-b"), self.supports_prefix_reuse)
        assert res is not None and res.prefix_len == 0
        check_invariants(cache)
        # Requests carry their namespace too.
        r = make_req("r", key + [3], extra_key="tenant-c")
        assert admit(cache, r)
        assert r.kv.cache_protected_len == 0
        assert prefill(cache, r)
        finish(cache, r)
        check_invariants(cache)

    def test_bad_input_leaves_state_unchanged(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        insert_owned(cache, RadixKey(key), self.supports_prefix_reuse)
        before = snapshot(cache)
        bad_keys_type: list[Any] = ["abc", 3, None, {1: 2}, [1, 2.5], key[:page_size] + ["x"]]
        for bad in bad_keys_type:
            with pytest.raises(TypeError):
                cache.match_prefix(bad)
            with pytest.raises(TypeError):
                cache.insert(bad)
        for bad in ([-1], key[:page_size] + [-5] * page_size, key + [-1]):
            with pytest.raises(ValueError):
                cache.match_prefix(bad)
            with pytest.raises(ValueError):
                cache.insert(bad, torch.arange(len(bad), dtype=torch.int64))
        with pytest.raises(ValueError):
            cache.insert(key + [7] * page_size, torch.arange(len(key) + page_size + 1, dtype=torch.int64))
        assert snapshot(cache) == before
        if self.supports_prefix_reuse:
            node = cache.match_prefix(key).last_device_node
            before = snapshot(cache)
            with pytest.raises(ValueError):
                cache.dec_lock_ref(node)
            assert snapshot(cache) == before
        check_invariants(cache)

    def run_chunked_prompt(self, cache: BasePrefixCache, page_size: int) -> tuple[list[int], list[int]]:
        """A prompt of five pages and three tokens through chunked prefill (chunks of two pages and one
        token), three decoded tokens, then finished.  Returns the prompt and the request's protected length
        after each chunk that left one, then where the finish kept its end (page-floored)."""
        rng = random.Random(7)
        prompt = random_tokens(rng, 5 * page_size + 3)
        req = make_req("chunked", prompt)
        assert admit(cache, req)
        check_invariants(cache, [req])
        chunk = 2 * page_size + 1
        boundaries = []
        while req.kv.kv_committed_len < len(prompt):
            assert prefill(cache, req, req.kv.kv_committed_len + chunk)
            kv = req.kv
            assert kv.cache_protected_len <= kv.kv_committed_len <= kv.kv_allocated_len
            if self.supports_prefix_reuse and kv.kv_committed_len < len(prompt):
                # Each chunk is cached: the next one resumes at its (page-floored) end.
                assert kv.cache_protected_len == floor_align(kv.kv_committed_len, page_size)
                assert req.prefix_indices.numel() == kv.kv_committed_len
                boundaries.append(kv.cache_protected_len)
            check_invariants(cache, [req])
        decode(cache, req, 3)
        check_invariants(cache, [req])
        boundaries.append(floor_align(req.kv.kv_committed_len, page_size))
        finish(cache, req)
        check_invariants(cache)
        return prompt, boundaries

    def test_chunked_prefill_then_finish(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        prompt, _ = self.run_chunked_prompt(cache, page_size)
        if self.supports_prefix_reuse:
            other = make_req("other", prompt + [1, 2])
            assert admit(cache, other)
            assert other.kv.cache_protected_len == floor_align(len(prompt), page_size)
            assert prefill(cache, other)
            finish(cache, other)
        check_invariants(cache)

    def test_two_requests_share_a_prefix(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        rng = random.Random(3)
        system = random_tokens(rng, 2 * page_size)
        a = make_req("a", system + random_tokens(rng, page_size + 1))
        assert run_request(cache, a)
        b = make_req("b", system + random_tokens(rng, page_size + 2))
        c = make_req("c", system + random_tokens(rng, 3))
        assert admit(cache, b) and admit(cache, c)
        if self.supports_prefix_reuse:
            assert b.kv.cache_protected_len >= len(system)
            assert c.kv.cache_protected_len >= len(system)
            assert cache.protected_size() >= len(system)
        self.run_two_sharers(cache, b, c)

    def run_two_sharers(self, cache: BasePrefixCache, b: Req, c: Req) -> None:
        """Two admitted requests on one cached prefix: prefill both, decode one, finish both; nothing stays locked."""
        check_invariants(cache, [b, c])
        assert prefill(cache, b) and prefill(cache, c)
        decode(cache, b, 2)
        check_invariants(cache, [b, c])
        finish(cache, c)
        check_invariants(cache, [b])
        finish(cache, b)
        assert cache.protected_size() == 0
        check_invariants(cache)

    def test_finish_without_insert(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        total = pool_total(cache)
        req = make_req("x", list(range(3 * page_size + 1)))
        assert admit(cache, req) and prefill(cache, req)
        finish(cache, req, is_insert=False)
        assert cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size() == total
        assert cache.evictable_size() == 0
        check_invariants(cache)

    def test_all_slots_back_after_reset(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        total = pool_total(cache)
        rows = cache.req_to_token_pool.num_rows
        rng = random.Random(11)
        base = random_tokens(rng, 2 * page_size)
        reqs = [make_req(f"r{i}", base + random_tokens(rng, rng.randrange(1, 3 * page_size))) for i in range(6)]
        for r in reqs:
            assert admit(cache, r)
        for r in reqs:
            assert prefill(cache, r, r.kv.kv_committed_len + page_size + 1)
        check_invariants(cache, reqs)
        for r in reqs:
            prefill(cache, r)
            decode(cache, r, 2)
        check_invariants(cache, reqs)
        for r in reqs:
            finish(cache, r)
        check_invariants(cache)
        cache.reset()
        assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
        assert cache.token_to_kv_pool_allocator.available_size() == total
        assert cache.req_to_token_pool.available_size() == rows
        check_invariants(cache)

    def test_streaming_session(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        from kvcore.session import StreamingSession

        cache = StreamingSession(build())
        total = pool_total(cache)
        rng = random.Random(5)
        turn1 = make_req("t1", random_tokens(rng, 2 * page_size + 3), session_id="s")
        assert admit(cache, turn1) and prefill(cache, turn1)
        decode(cache, turn1, 2)
        finish(cache, turn1)
        check_invariants(cache)
        assert len(cache.session_slots()) == 1
        turn2 = make_req("t2", turn1.fill_ids + random_tokens(rng, page_size), session_id="s")
        assert admit(cache, turn2)
        reused = len(turn1.fill_ids)
        if cache.inner.session_page_aligned:
            reused = floor_align(reused, page_size)  # pools that reuse whole pages only (SGLang's NPU rule)
        assert turn2.kv.kv_committed_len == reused
        check_invariants(cache, [turn2])
        assert prefill(cache, turn2)
        decode(cache, turn2, 1)
        finish(cache, turn2)
        check_invariants(cache)
        cache.release_session("s")
        check_invariants(cache)
        cache.reset()
        assert cache.token_to_kv_pool_allocator.available_size() == total
        check_invariants(cache)

    def test_state_machine(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        reuse = self.supports_prefix_reuse

        def factory() -> CacheStateMachine:
            return CacheStateMachine(build, page_size, reuse)

        run_state_machine_as_test(
            cast(Any, factory), settings=state_machine_settings(self.state_machine_examples, self.state_machine_steps)
        )

    def test_fuzz(self, page_size: int) -> None:
        """``kvcore fuzz`` in the author's own test run: seeded engine operations, bad inputs mixed in.

        The same engine as the command (:func:`kvcore.fuzz.run_fuzz`), so what it finds is found here
        too: an unclean error on a bad input (an AttributeError from ``dec_lock_ref`` of a foreign node),
        a bad input accepted (slots another node owns), a state changed by a refused call, a leak.
        """
        if self.backend is None:
            pytest.skip("the fuzz run builds the backend by its registered name: set `backend`")
        from kvcore.fuzz import FuzzFailure, run_fuzz

        for seed in self.fuzz_seeds:
            try:
                run_fuzz(self.backend, self.fuzz_ops, seed, check_every=self.fuzz_check_every,
                         bad_rate=self.fuzz_bad_rate, page_size=page_size)
            except FuzzFailure as exc:
                pytest.fail(str(exc), pytrace=False)


# --------------------------------------------------------------------------- state machine

class CacheStateMachine(RuleBasedStateMachine):
    """match / insert / lock / unlock / evict / admit / chunk / decode / finish on one cache.

    ``kvcore.InvariantChecker`` runs after every step with the live requests as owners;
    teardown finishes everything, resets, and proves every slot is back.
    """

    def __init__(self, build: Callable[..., BasePrefixCache], page_size: int, reuse: bool | None = None) -> None:
        super().__init__()
        self.page = page_size
        self.cache = build(pages=48, rows=6, width_pages=12)
        self.reuse = (not self.cache.is_chunk_cache()) if reuse is None else reuse
        self.total = pool_total(self.cache)
        self.rows = self.cache.req_to_token_pool.num_rows
        self.live: list = []
        self.locks: list = []
        self.counter = 0
        # A few shared stems so requests and inserts overlap.
        self.stems = [[s] * page_size + [s + 1] * page_size for s in (1, 3, 5)]

    def _key(self, stem: int, tail: list[int], extra: str | None) -> list[int]:
        return self.stems[stem] + tail

    tails = st.lists(st.integers(0, 4), max_size=40)

    @rule(stem=st.integers(0, 2), tail=tails, extra=st.sampled_from([None, None, "x"]))
    def match(self, stem: int, tail: list[int], extra: str | None) -> None:
        key = self._key(stem, tail, extra)
        m = self.cache.match_prefix(RadixKey(key, extra))
        n = m.device_indices.numel()
        assert n % self.page == 0 and n <= len(key)
        if not self.reuse:
            assert n == 0

    @rule(stem=st.integers(0, 2), tail=tails, extra=st.sampled_from([None, "x"]))
    def insert(self, stem: int, tail: list[int], extra: str | None) -> None:
        key = RadixKey(self._key(stem, tail, extra), extra)
        res = insert_owned(self.cache, key, self.reuse)
        if res is not None:
            assert res.prefix_len % self.page == 0
            assert res.prefix_len <= len(key)

    @rule(stem=st.integers(0, 2), tail=tails)
    def lock(self, stem: int, tail: list[int]) -> None:
        m = self.cache.match_prefix(self._key(stem, tail, None))
        self.locks.append((m.last_device_node, self.cache.inc_lock_ref(m.last_device_node)))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, lock = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node, lock)

    @rule(n=st.integers(0, 200))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size()
        res = self.cache.evict(n)
        assert res.num_tokens_evicted <= before
        if self.reuse and n and before:
            assert res.num_tokens_evicted >= min(n, before) or self.cache.evictable_size() == 0

    @rule(stem=st.integers(0, 2), tail=st.lists(st.integers(0, 4), min_size=1, max_size=60),
          extra=st.sampled_from([None, "x"]), chunk=st.sampled_from([None, 5, 17]))
    def start(self, stem: int, tail: list[int], extra: str | None, chunk: int | None) -> None:
        self.counter += 1
        req = make_req(f"q{self.counter}", self._key(stem, tail, extra), extra_key=extra)
        if len(req.fill_ids) + 16 > self.cache.req_to_token_pool.max_context_len:
            return
        if not admit(self.cache, req):
            return
        self.live.append(req)
        if chunk is None:
            prefill(self.cache, req)
        else:
            prefill(self.cache, req, req.kv.kv_committed_len + chunk)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), chunk=st.sampled_from([3, 16, 40]))
    def continue_prefill(self, i: int, chunk: int) -> None:
        req = self.live[i % len(self.live)]
        if req.kv.kv_committed_len < len(req.fill_ids):
            prefill(self.cache, req, req.kv.kv_committed_len + chunk)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6))
    def decode(self, i: int, n: int) -> None:
        req = self.live[i % len(self.live)]
        width = self.cache.req_to_token_pool.max_context_len
        if req.kv.kv_committed_len == len(req.fill_ids) and req.seqlen + n < width:
            decode(self.cache, req, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), is_insert=st.booleans())
    def finish(self, i: int, is_insert: bool) -> None:
        req = self.live.pop(i % len(self.live))
        finish(self.cache, req, is_insert=is_insert)
        assert not req.kv.is_held

    @invariant()
    def invariants_hold(self) -> None:
        check_invariants(self.cache, self.live)
        assert self.cache.evictable_size() >= 0 and self.cache.protected_size() >= 0
        if not self.locks and not self.live:
            assert self.cache.protected_size() == 0

    def teardown(self) -> None:
        for req in self.live:
            finish(self.cache, req)
        self.live.clear()
        for node, lock in reversed(self.locks):
            self.cache.dec_lock_ref(node, lock)
        self.locks.clear()
        check_invariants(self.cache)
        self.cache.reset()
        assert self.cache.token_to_kv_pool_allocator.available_size() == self.total
        assert self.cache.req_to_token_pool.available_size() == self.rows
        check_invariants(self.cache)

"""Reliability: a bad call is refused before it changes anything, on every backend.

The bad-input matrix below is a table: one row per (entry point, bad input), the
backends it applies to and the error it must raise.  Each row runs on a cache
with a cached prefix, a running request and free slots; a snapshot of every
pool, the row table, the cache sizes and the records proves that nothing
changed, and the invariant checker runs after it.  Below the table: the
release paths, sessions, the invariant checker on corrupt slots, fault
injection and tenant isolation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvcore
from kvcore import Engine, InvariantChecker, Req, StreamingSession, create_cache, release_kv_cache
from kvcore.errors import InvariantViolation
from kvcore.hookspecs import hookimpl
from kvcore.keys import RadixKey

TREES = ("radix", "swa")
CHUNKS = ("chunk", "swa-chunk")
ALL = TREES + CHUNKS


def _kwargs(backend: str, ps: int, **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"size": 64 * ps, "page_size": ps, "max_num_reqs": 4, "max_context_len": 16 * ps}
    if backend.startswith("swa"):
        kw["sliding_window_size"] = 2 * ps
    kw.update(over)
    return kw


@dataclass
class Ctx:
    backend: str
    ps: int
    cache: Any
    engine: Engine
    running: Req
    done: Req

    @property
    def alloc(self):
        return self.cache.token_to_kv_pool_allocator

    def full(self):
        return next(p for p in self.cache.pools() if p.name == "full").allocator

    def row(self, req: Req) -> torch.Tensor:
        kv = req.kv
        return self.cache.req_to_token_pool.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].to(torch.int64)

    def node_slots(self) -> torch.Tensor:
        owned = [so.slots for so in self.cache.iter_owned_slots() if so.pool == "full"]
        return torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)

    def free(self, n: int) -> torch.Tensor:
        return self.full().free_slots()[:n].clone()

    def key(self, n_pages: int = 1) -> RadixKey:
        return RadixKey([90 + i for i in range(n_pages * self.ps)])


def build(backend: str, ps: int) -> Ctx:
    cache = create_cache(backend, **_kwargs(backend, ps))
    engine = Engine(cache)
    done = Req("done", list(range(1, 4 * ps + 2)))
    assert engine.admit(done) and engine.extend(done)
    engine.decode([done], [7])
    engine.finish(done)
    running = Req("running", list(range(1, 2 * ps + 1)) + [60 + i for i in range(2 * ps + 1)])
    assert engine.admit(running) and engine.extend(running)
    engine.decode([running], [8])
    return Ctx(backend, ps, cache, engine, running, done)


def snapshot(ctx: Ctx) -> tuple:
    cache = ctx.cache
    pools = [(p.name, p.available(), p.allocator.free_slots().tolist()) for p in cache.pools()]
    kv = ctx.running.kv
    return (
        pools,
        sorted(cache.req_to_token_pool.free_rows()),
        cache.cached_sizes(),
        cache.total_size(),
        sorted((so.owner, tuple(so.slots.tolist())) for so in cache.iter_owned_slots()),
        ctx.full().claimed_slots().tolist() if hasattr(ctx.full(), "claimed_slots") else None,
        (kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len, kv.kv_allocated_len, kv.swa_evicted_seqlen),
        ctx.row(ctx.running).tolist(),
        len(ctx.running.output_ids),
    )


def _dup(ctx: Ctx) -> torch.Tensor:
    """A value naming one of the running request's pages twice."""
    kv = ctx.running.kv
    first = int(ctx.row(ctx.running)[kv.cache_protected_len])  # the request's own, not the tree's
    page = first // ctx.ps * ctx.ps + torch.arange(ctx.ps)
    return torch.cat([page, page])


def _other_cache(ctx: Ctx):
    return create_cache(ctx.backend, **_kwargs(ctx.backend, ctx.ps))


E = tuple[type[BaseException], str]
# (case, backends, call, (exception, message pattern))
MATRIX: list[tuple[str, tuple[str, ...], Callable[[Ctx], Any], E]] = [
    # -- insert: the value slots ------------------------------------------------------------
    ("insert: free slots", TREES, lambda c: c.cache.insert(c.key(), c.free(c.ps)), (ValueError, "is free")),
    ("insert: padding slot 0", TREES, lambda c: c.cache.insert(c.key(), torch.zeros(c.ps, dtype=torch.int64)),
     (ValueError, "padding")),
    ("insert: out-of-range slot", TREES,
     lambda c: c.cache.insert(c.key(), torch.full((c.ps,), 10**6, dtype=torch.int64)), (ValueError, "out of range")),
    ("insert: negative slot", TREES, lambda c: c.cache.insert(c.key(), torch.full((c.ps,), -2, dtype=torch.int64)),
     (ValueError, "out of range")),
    ("insert: duplicated slots", TREES, lambda c: c.cache.insert(c.key(2), _dup(c)), (ValueError, "twice")),
    ("insert: slots another node owns", TREES, lambda c: c.cache.insert(c.key(), c.node_slots()[: c.ps].clone()),
     (ValueError, "owned by another tree node")),
    ("insert: float value", TREES, lambda c: c.cache.insert(c.key(), torch.ones(c.ps)), (TypeError, "integer")),
    ("insert: bool token ids", ALL, lambda c: c.cache.insert([True, False] * c.ps), (TypeError, "bool")),
    # -- match ----------------------------------------------------------------------------
    ("match: bool token ids", ALL, lambda c: c.cache.match_prefix([True, False] * c.ps), (TypeError, "bool")),
    ("match: negative token id", ALL, lambda c: c.cache.match_prefix([1, -1] * c.ps), (ValueError, "non-negative")),
    ("match: float token id", ALL, lambda c: c.cache.match_prefix([1.5] * c.ps), (TypeError, "ints")),
    # -- evict ----------------------------------------------------------------------------
    ("evict(-1)", ALL, lambda c: c.cache.evict(-1), (ValueError, ">= 0")),
    ('evict("x")', ALL, lambda c: c.cache.evict("x"), (TypeError, "num_tokens must be an int, got str")),
    ("evict(1.5)", ALL, lambda c: c.cache.evict(1.5), (TypeError, "got float")),
    ("evict(True)", ALL, lambda c: c.cache.evict(True), (TypeError, "got bool")),
    # -- allocator ----------------------------------------------------------------------------
    ('alloc("4")', ALL, lambda c: c.alloc.alloc("4"), (TypeError, "need_size must be an int, got str")),
    ("alloc(True)", ALL, lambda c: c.alloc.alloc(True), (TypeError, "got bool")),
    ("alloc(-page)", ALL, lambda c: c.alloc.alloc(-c.ps), (ValueError, "need_size")),
    ("free: a free slot", ALL, lambda c: c.alloc.free(c.free(1)), (ValueError, "double free")),
    ("free: padding", ALL, lambda c: c.alloc.free(torch.zeros(1, dtype=torch.int64)), (ValueError, "padding")),
    # -- locks ----------------------------------------------------------------------------
    ("dec_lock_ref: not a node", TREES, lambda c: c.cache.dec_lock_ref(object()), (TypeError, "expected")),
    ("dec_lock_ref: a node of another cache", TREES,
     lambda c: c.cache.dec_lock_ref(_other_cache(c).insert(c.key(), None).last_device_node),
     (ValueError, "not in this cache's tree")),
    # -- release ----------------------------------------------------------------------------
    ("release_kv_cache on another cache", ALL, lambda c: release_kv_cache(c.running, _other_cache(c)),
     (ValueError, "release it on the cache that admitted it")),
    # -- engine ----------------------------------------------------------------------------
    ("decode: a request without KV", ALL, lambda c: c.engine.decode([Req("ghost", [1, 2])]),
     (ValueError, "no prefilled KV")),
    ("decode: tokens of the wrong count", ALL, lambda c: c.engine.decode([c.running], [1, 2]),
     (ValueError, "tokens for")),
]


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize(("case", "backends", "call", "expected"), MATRIX, ids=[m[0] for m in MATRIX])
def test_bad_input_matrix(case, backends, call, expected, backend, ps):
    if backend not in backends:
        pytest.skip(f"{case}: not an error on {backend}")
    ctx = build(backend, ps)
    before = snapshot(ctx)
    exc, pattern = expected
    with pytest.raises(exc, match=pattern):
        call(ctx)
    assert snapshot(ctx) == before, f"{case} changed the state"
    InvariantChecker(ctx.cache).check([ctx.running])
    # Still usable: the running request finishes and everything balances.
    ctx.engine.finish(ctx.running)
    InvariantChecker(ctx.cache).check([])


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("backend", TREES + ("unified", "unified-swa"))
def test_insert_after_its_match_checks_the_tokens_past_the_whole_pages(backend, ps):
    # An engine matches a key and then inserts it grown by a token: the tree reuses the match's walk, and
    # the new token must be checked as an insert without the match checks it (it was accepted unchecked).
    kw = _kwargs(backend, ps, **({"sliding_window_size": 2 * ps} if backend == "unified-swa" else {}))
    cache = create_cache(backend, **kw)
    key = [90 + i for i in range(2 * ps)]
    held = cache.token_to_kv_pool_allocator.alloc(3 * ps)
    value = held[: 2 * ps + 1]
    cache.match_prefix(RadixKey(list(key)))
    before = (cache.total_size(), sorted((so.owner, tuple(so.slots.tolist())) for so in cache.iter_owned_slots()))
    with pytest.raises(ValueError, match="non-negative"):
        cache.insert(RadixKey(key + [-3]), value)
    assert (cache.total_size(), sorted((so.owner, tuple(so.slots.tolist())) for so in cache.iter_owned_slots())) \
        == before
    cache.token_to_kv_pool_allocator.free(held)
    InvariantChecker(cache).check([])


# ------------------------------------------------------------------ strict=False


@pytest.mark.parametrize("backend", TREES)
def test_strict_false_skips_the_slot_checks(backend):
    cache = create_cache(backend, **_kwargs(backend, 1, strict=False))
    assert cache.strict is False
    slots = cache.token_to_kv_pool_allocator.alloc(2)
    cache.insert([5, 6], slots)
    assert int(cache.token_to_kv_pool_allocator.claimed_slots().numel()) == 0  # no bookkeeping kept
    InvariantChecker(cache).check([])


def test_strict_is_a_common_option_on_every_backend():
    for name, spec in kvcore.available_backends().items():
        field = spec.config.model_fields.get("strict")
        assert field is not None and field.default is True, name


# ------------------------------------------------------------------ release paths


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("backend", TREES)
def test_release_after_a_hand_done_dec_lock_ref_is_refused_before_any_change(backend, ps):
    ctx = build(backend, ps)
    req = Req("locked", list(range(1, 4 * ps + 2)))  # matches the cached prefix and locks it
    assert ctx.engine.admit(req) and req.kv.cache_protected_len > 0
    assert ctx.engine.extend(req)
    ctx.engine.decode([req], [5])  # tokens the tree does not hold yet: a release would insert them first
    ctx.engine.decode([req], [6])
    ctx.cache.dec_lock_ref(req.last_node)  # by hand, without the lock record
    before = snapshot(ctx)
    rows = sorted(ctx.cache.req_to_token_pool.free_rows())
    with pytest.raises(ValueError, match="not locked|given back|no lock"):
        release_kv_cache(req, ctx.cache)
    assert snapshot(ctx) == before and sorted(ctx.cache.req_to_token_pool.free_rows()) == rows
    assert req.kv.is_held


def test_radix_lock_given_back_twice_is_refused():
    ctx = build("radix", 1)
    req = ctx.running
    ctx.cache.dec_lock_ref(req.last_node, req.lock)  # by hand, with the record
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="already given back"):
        release_kv_cache(req, ctx.cache)
    assert snapshot(ctx) == before


@pytest.mark.parametrize("backend", ALL)
def test_release_on_another_cache_leaves_both_untouched(backend):
    ctx = build(backend, 1)
    other = _other_cache(ctx)
    other_before = (other.total_size(), other.token_to_kv_pool_allocator.available_size())
    before = snapshot(ctx)
    with pytest.raises(ValueError, match="cache that admitted it"):
        release_kv_cache(ctx.running, other)
    assert snapshot(ctx) == before
    assert (other.total_size(), other.token_to_kv_pool_allocator.available_size()) == other_before
    InvariantChecker(other).check([])


# ------------------------------------------------------------------ sessions


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("backend", ALL)
def test_a_turn_with_other_tokens_reuses_only_the_common_prefix(backend, ps):
    cache = StreamingSession(create_cache(backend, **_kwargs(backend, ps)))
    engine = Engine(cache)
    # The prompt (two pages) goes to the tree of a tree backend; three decoded pages stay the session's.
    t1 = Req("t1", [1] * (2 * ps), session_id="s")
    assert engine.admit(t1) and engine.extend(t1)
    for _ in range(3 * ps):
        engine.decode([t1], [1])
    engine.finish(t1)
    t2 = Req("t2", [1] * (2 * ps) + [2] * (3 * ps + 1), session_id="s")
    free_before = cache.token_to_kv_pool_allocator.available_size()
    assert engine.admit(t2)
    assert t2.kv.kv_allocated_len == 2 * ps  # not 5 * ps: the tokens differ from there
    assert cache.token_to_kv_pool_allocator.available_size() - free_before == 3 * ps  # the tail went back
    InvariantChecker(cache).check([t2])
    assert engine.extend(t2)
    engine.finish(t2)
    engine.end_session("s")
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("backend", TREES)
def test_a_turn_that_differs_inside_the_trees_part_is_refused_unchanged(backend):
    cache = StreamingSession(create_cache(backend, **_kwargs(backend, 1)))
    engine = Engine(cache)
    t1 = Req("t1", list(range(1, 9)), session_id="s")
    assert engine.admit(t1) and engine.extend(t1)
    engine.finish(t1)
    assert cache.slots["s"].kv.cache_protected_len > 2  # the tree holds the first turn's prompt
    t2 = Req("t2", [1, 2, 50, 51], session_id="s")
    free = cache.token_to_kv_pool_allocator.available_size()
    with pytest.raises(ValueError, match="end the session"):
        engine.admit(t2)
    assert not t2.kv.is_held and cache.token_to_kv_pool_allocator.available_size() == free
    engine.end_session("s")  # what the message says; the tree still serves the common prefix
    assert engine.admit(t2) and t2.kv.cache_protected_len == 2
    engine.abort(t2)
    InvariantChecker(cache).check([])


def test_a_turn_with_all_other_tokens_reuses_nothing():
    cache = StreamingSession(create_cache("chunk", size=64, max_num_reqs=2, max_context_len=32))
    engine = Engine(cache)
    t1 = Req("t1", list(range(10)), session_id="s")
    assert engine.admit(t1) and engine.extend(t1)
    engine.finish(t1)
    t2 = Req("t2", list(range(100, 110)), session_id="s")
    assert engine.admit(t2) and t2.kv.kv_allocated_len == 0
    engine.abort(t2)
    InvariantChecker(cache).check([])


def test_a_turn_in_another_namespace_reuses_nothing():
    cache = StreamingSession(create_cache("chunk", size=64, max_num_reqs=2, max_context_len=32))
    engine = Engine(cache)
    t1 = Req("t1", list(range(10)), session_id="s", extra_key="a")
    assert engine.admit(t1) and engine.extend(t1)
    engine.finish(t1)
    t2 = Req("t2", list(range(12)), session_id="s", extra_key="b")
    assert engine.admit(t2) and t2.kv.kv_allocated_len == 0
    engine.abort(t2)


@pytest.mark.parametrize("backend", ALL)
def test_release_session_under_a_running_turn_is_refused(backend):
    cache = StreamingSession(create_cache(backend, **_kwargs(backend, 1)))
    engine = Engine(cache)
    t1 = Req("t1", list(range(1, 9)), session_id="s")
    assert engine.admit(t1) and engine.extend(t1)
    engine.finish(t1)
    t2 = Req("t2", list(range(1, 9)) + [9, 9], session_id="s")
    assert engine.admit(t2) and engine.extend(t2)
    before = (cache.token_to_kv_pool_allocator.available_size(), sorted(cache.req_to_token_pool.free_rows()))
    with pytest.raises(RuntimeError, match="running on the session"):
        cache.release_session("s")
    assert (cache.token_to_kv_pool_allocator.available_size(), sorted(cache.req_to_token_pool.free_rows())) == before
    assert "s" in cache.slots
    InvariantChecker(cache).check([t2])
    engine.abort(t2)  # the abort takes the session with it, as documented
    assert "s" not in cache.slots
    InvariantChecker(cache).check([])


# ------------------------------------------------------------------ the invariant checker on corrupt slots


@pytest.mark.parametrize("bad", [-5, 10**6])
@pytest.mark.parametrize("backend", TREES)
def test_checker_reports_slots_outside_the_pool(backend, bad):
    ctx = build(backend, 1)
    node = ctx.running.last_node
    old = int(node.value[0])
    node.value[0] = bad
    with pytest.raises(InvariantViolation, match="outside the pool"):
        InvariantChecker(ctx.cache).check([ctx.running])
    node.value[0] = old
    InvariantChecker(ctx.cache).check([ctx.running])


# ------------------------------------------------------------------ fault injection


@pytest.mark.parametrize("backend", ALL)
def test_allocation_failing_mid_prefill_leaks_nothing(backend):
    cache = create_cache(backend, **_kwargs(backend, 1, size=24, max_num_reqs=4, max_context_len=32))
    engine = Engine(cache)
    hog = Req("hog", list(range(100, 116)))
    assert engine.admit(hog) and engine.extend(hog)
    req = Req("big", list(range(1, 30)))
    assert engine.admit(req)
    assert engine.extend(req, 4)
    before = cache.token_to_kv_pool_allocator.available_size()
    assert not engine.extend(req, 29)  # does not fit: nothing taken
    assert cache.token_to_kv_pool_allocator.available_size() >= before
    InvariantChecker(cache).check([hog, req])
    engine.retract(req)
    engine.finish(hog)
    InvariantChecker(cache).check([])
    again = Req("again", list(range(1, 12)))
    assert engine.admit(again) and engine.extend(again)
    engine.finish(again)
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("hook", ["cache_finished_req", "cache_unfinished_req"])
@pytest.mark.parametrize("backend", ALL)
def test_a_raising_lifecycle_wrapper_changes_nothing(backend, hook):
    cache = create_cache(backend, **_kwargs(backend, 1))
    engine = Engine(cache)

    class Boom:
        if hook == "cache_finished_req":
            @hookimpl(wrapper=True)
            def cache_finished_req(self, req, is_insert):
                raise RuntimeError("boom")
                yield  # pragma: no cover
        else:
            @hookimpl(wrapper=True)
            def cache_unfinished_req(self, req, chunked):
                raise RuntimeError("boom")
                yield  # pragma: no cover

    req = Req("r", list(range(1, 12)))
    assert engine.admit(req)
    boom = Boom()
    cache.plugin_manager.register(boom)
    if hook == "cache_unfinished_req":
        with pytest.raises(RuntimeError, match="boom"):
            engine.extend(req, 6)
        cache.plugin_manager.unregister(boom)
        assert engine.extend(req)
    else:
        assert engine.extend(req)
        with pytest.raises(RuntimeError, match="boom"):
            engine.finish(req)
        assert req.kv.is_held
        cache.plugin_manager.unregister(boom)
    InvariantChecker(cache).check([req])
    engine.finish(req)
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("backend", ALL)
def test_retraction_storm(backend):
    cache = create_cache(backend, **_kwargs(backend, 1, size=64, max_num_reqs=6, max_context_len=48))
    engine = Engine(cache)
    reqs = [Req(f"r{i}", [1, 2, 3, 4] + [10 + i] * (6 + i)) for i in range(6)]
    for _ in range(25):
        for r in reqs:
            if not r.kv.is_held and engine.admit(r):
                engine.extend(r)
        live = [r for r in reqs if r.kv.is_held and r.kv.kv_allocated_len]
        if live:
            engine.decode(live, [5] * len(live))
        InvariantChecker(cache).check(reqs)
        for r in reqs:
            if r.kv.is_held:
                engine.retract(r)
                r.output_ids.clear()
        InvariantChecker(cache).check(reqs)
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("backend", ALL)
def test_session_turn_aborted_at_every_step(backend):
    steps = ["admit", "extend1", "extend2", "decode1", "decode2"]
    for stop in range(len(steps) + 1):
        cache = StreamingSession(create_cache(backend, **_kwargs(backend, 1)))
        engine = Engine(cache)
        t1 = Req("t1", list(range(1, 9)), session_id="s")
        assert engine.admit(t1) and engine.extend(t1)
        engine.finish(t1)
        t2 = Req("t2", list(range(1, 9)) + [20, 21, 22, 23], session_id="s")
        done = []
        for step in steps[:stop]:
            if step == "admit":
                assert engine.admit(t2)
            elif step == "extend1":
                assert engine.extend(t2, 10)
            elif step == "extend2":
                assert engine.extend(t2)
            else:
                assert engine.decode([t2], [3])
            done.append(step)
        engine.abort(t2)
        InvariantChecker(cache).check([t2])
        engine.end_session("s")
        InvariantChecker(cache).check([])
        # Still usable.
        t3 = Req("t3", list(range(1, 9)), session_id="s")
        assert engine.admit(t3) and engine.extend(t3)
        engine.finish(t3)
        engine.end_session("s")
        InvariantChecker(cache).check([])


# ------------------------------------------------------------------ tenant isolation


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("backend", TREES)
def test_namespaces_never_share_prefixes_or_slots(backend, ps):
    cache = create_cache(backend, **_kwargs(backend, ps, enable_kv_events=True))
    engine = Engine(cache)
    ids = list(range(1, 6 * ps + 2))
    ra, rb = Req("a", ids, extra_key="tenant-a"), Req("b", ids, extra_key="tenant-b")
    for r in (ra, rb):
        assert engine.admit(r)
        assert r.kv.cache_protected_len == 0  # nothing shared across namespaces
        assert engine.extend(r)
    slots_a = set(cache.req_to_token_pool.req_to_token[ra.kv.req_pool_idx, : len(ids)].tolist())
    slots_b = set(cache.req_to_token_pool.req_to_token[rb.kv.req_pool_idx, : len(ids)].tolist())
    engine.finish(ra)
    engine.finish(rb)
    # A match in one namespace returns only that namespace's slots, also after a split.
    for key_ids in (ids, ids[: 3 * ps] + [99] * ps):
        ma = cache.match_prefix(RadixKey(key_ids, "tenant-a")).device_indices.tolist()
        mb = cache.match_prefix(RadixKey(key_ids, "tenant-b")).device_indices.tolist()
        assert ma and mb and set(ma) <= slots_a and set(mb) <= slots_b
        assert cache.match_prefix(RadixKey(key_ids, None)).device_indices.numel() == 0
    # A lock in one namespace survives eviction pressure from the other.
    m = cache.match_prefix(RadixKey(ids, "tenant-a"))
    lock = cache.inc_lock_ref(m.last_device_node)
    cache.evict(10**6)
    assert cache.match_prefix(RadixKey(ids, "tenant-a")).device_indices.tolist() == m.device_indices.tolist()
    assert cache.match_prefix(RadixKey(ids, "tenant-b")).device_indices.numel() == 0
    cache.dec_lock_ref(m.last_device_node, lock)
    # Stored events of the two namespaces never hash alike.
    events = cache.take_events()
    stored = [e for e in events if type(e).__name__ == "PageStored"]
    assert stored
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("backend", TREES)
def test_a_namespace_cannot_insert_slots_another_namespace_owns(backend):
    cache = create_cache(backend, **_kwargs(backend, 1))
    slots = cache.token_to_kv_pool_allocator.alloc(4)
    cache.insert(RadixKey([1, 2, 3, 4], "a"), slots)
    with pytest.raises(ValueError, match="owned by another tree node"):
        cache.insert(RadixKey([1, 2, 3, 4], "b"), slots.clone())
    assert cache.match_prefix(RadixKey([1, 2, 3, 4], "b")).device_indices.numel() == 0
    InvariantChecker(cache).check([])


# ------------------------------------------------------------------ the CLI: one line on stderr, non-zero exit


def _trace(tmp_path, line: str) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    return str(path)


# (case, argv (TRACE: a one-line trace file), the message's pattern)
CLI_MATRIX: list[tuple[str, list[str], str]] = [
    ("--size 1e13", ["bench", "--backend", "radix", "--size", "10000000000000"], "slot ids are int32"),
    ("--size beyond memory", ["bench", "--backend", "radix", "--size", "2000000000"], "GiB"),
    ("--max-num-reqs 1e8", ["bench", "--backend", "radix", "--max-num-reqs", "100000000"], "req_to_token rows"),
    ("-n 1e8", ["bench", "--backend", "radix", "-n", "100000000"], "more than 10,000,000"),
    ("--plot to a missing folder", ["bench", "--backend", "chunk", "-n", "4", "--plot", "/no/such/dir/x.png"],
     "does not exist"),
    ("--compare radix,radix", ["bench", "--compare", "radix,radix"], "named twice"),
    ("--backend radix --compare radix", ["bench", "--backend", "radix", "--compare", "radix"], "named twice"),
    ("trace input_length 1e12",
     ["bench", "--backend", "chunk", "--trace",
      'TRACE{"timestamp": 0, "input_length": 1000000000000, "output_length": 4, "hash_ids": []}'],
     "more than 1,048,576"),
    ("trace output_length 1e12",
     ["bench", "--backend", "chunk", "--trace",
      'TRACE{"timestamp": 0, "input_length": 8, "output_length": 1000000000000, "hash_ids": []}'],
     "more than 1,048,576"),
    ("trace negative timestamp",
     ["bench", "--backend", "chunk", "--trace",
      'TRACE{"timestamp": -5, "input_length": 8, "output_length": 4, "hash_ids": []}'], "finite number >= 0"),
    ("trace NaN timestamp",
     ["bench", "--backend", "chunk", "--trace",
      'TRACE{"timestamp": NaN, "input_length": 8, "output_length": 4, "hash_ids": []}'], "finite number >= 0"),
    ("trace infinite timestamp",
     ["bench", "--backend", "chunk", "--trace",
      'TRACE{"timestamp": Infinity, "input_length": 8, "output_length": 4, "hash_ids": []}'], "finite number >= 0"),
    ("fuzz --ops -1", ["fuzz", "--backend", "radix", "--ops", "-1"], ""),
    ("fuzz unknown backend", ["fuzz", "--backend", "nope"], "unknown backend"),
]


@pytest.mark.parametrize(("case", "argv", "pattern"), CLI_MATRIX, ids=[c[0] for c in CLI_MATRIX])
def test_cli_bad_input_matrix(case, argv, pattern, tmp_path, capsys):
    from kvcore.cli import main

    argv = [_trace(tmp_path, a[len("TRACE"):]) if a.startswith("TRACE") else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code not in (0, None)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcore: error:"), captured.err
    assert pattern in lines[0]
    assert captured.out == ""


# ------------------------------------------------------------------ plugins: say what the user can do


def _kvcore(args, path, env_extra=None):
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kvcore", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def _backends_json(path):
    import json

    out = _kvcore(["backends", "--json"], path)
    data = json.loads(out.stdout)
    assert out.returncode == (1 if data["failed"] else 0), out.stderr  # a plugin that failed to load: status 1
    return {b["name"]: b for b in data["backends"]}, {f["plugin"]: f["error"] for f in data["failed"]}


SQUATTER = '''
import kvcore

class Squat(kvcore.ChunkCache):
    """Not the real radix."""

@kvcore.hookimpl
def kvcore_register_backends(register):
    register("radix", Squat)
'''


def test_a_third_party_cannot_take_a_kvcore_backend_name(tmp_path):
    from kvcore.testing.distributions import make_dist

    make_dist(tmp_path, "squat-kv", "squat_kv", SQUATTER)
    backends, failed = _backends_json(tmp_path)
    assert backends["radix"]["distribution"] == "kvcore-radix"  # the real one stays, for everyone
    assert "already provided by kvcore-radix" in failed["squat_kv"] and "another name" in failed["squat_kv"]
    # ... so the swa comparison keeps its reference column.
    out = _kvcore(["bench", "--backend", "swa", "-n", "4", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"reference"' in out.stdout


def test_a_register_function_without_hookimpl_is_reported(tmp_path):
    from kvcore.testing.distributions import make_dist

    make_dist(tmp_path, "bare-kv", "bare_kv", '''
import kvcore

def kvcore_register_backends(register):  # no @kvcore.hookimpl
    register("bare", kvcore.ChunkCache)
''')
    backends, failed = _backends_json(tmp_path)
    assert "bare" not in backends
    assert "lacks the @kvcore.hookimpl decorator" in failed["bare_kv"]


def test_an_abstract_backend_class_is_not_listed_as_healthy(tmp_path):
    from kvcore.testing.distributions import make_dist

    make_dist(tmp_path, "half-kv", "half_kv", '''
import kvcore

class Half(kvcore.BasePrefixCache):
    def match_prefix(self, key): ...

@kvcore.hookimpl
def kvcore_register_backends(register):
    register("half", Half)
''')
    backends, failed = _backends_json(tmp_path)
    assert "half" not in backends
    assert "is abstract" in failed["half_kv"] and "insert" in failed["half_kv"]


def test_a_missing_reference_is_said_on_stderr(tmp_path):
    out = _kvcore(["bench", "--backend", "swa", "-n", "4", "--json"], tmp_path, {"KVCORE_BLOCK_PLUGINS": "radix"})
    assert out.returncode == 0, out.stderr
    assert "reference backend 'radix' is not available" in out.stderr


@pytest.mark.parametrize("option", ["size", "page_size", "max_num_reqs", "max_context_len"])
@pytest.mark.parametrize("bad", [True, "64", 64.0])
def test_pool_options_must_be_ints(option, bad):
    with pytest.raises(kvcore.ConfigError, match=rf"option '{option}': Input should be a valid integer"):
        create_cache("chunk", **{option: bad})

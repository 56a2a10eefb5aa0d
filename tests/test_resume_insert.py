"""The resumed insert of chunked prefill (kvcore.tree.resume) against the whole-prefix path it replaces.

Two caches of one backend run the same random operations in lockstep: on one,
every ``cache_unfinished_req`` and ``cache_finished_req`` resumes from the
request's locked node where it can; on the other the record's resume point is
dropped before each call, so it re-inserts the whole prefix from the root
(SGLang's path, as before).  Between a
request's chunks other requests match, split, insert, lock, evict and finish.
After every operation both must agree on everything observable: the whole tree
(keys, slots, locks, hit counts, priorities, access and creation times, creation
order), sizes, the free list and the claimed slots, the KV events, and each
request's protected length, ``prefix_indices``, lock and node.  Component sets
(swa, mamba, both, the example's stamp) add each component's values, locks and
LRU order, every pool's free list, and the window frees and window-lock releases
of a sliding-window model between chunks.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey
from kvcore.record import Req

BACKENDS = ["radix", "unified", "example"]
# Component sets of the one tree (kvcore.tree.unified): the resumed insert runs every component's part.
COMPONENT_SETS = ["swa", "mamba", "unified-swa", "unified-mamba", "full-swa-mamba", "example-component"]


def _make(backend: str, ps: int, policy: str) -> kvcore.BasePrefixCache:
    opts: dict = {"eviction_policy": policy} if backend == "radix" else {}
    size = 96 * ps if ps > 1 else 320
    if backend == "full-swa-mamba":
        backend = "unified"
        opts["components"] = ("full", "swa", "mamba")
    if backend in ("swa", "unified-swa") or "components" in opts:
        opts.update(sliding_window_size=2 * ps + 5, swa_size=size)
    if backend in ("mamba", "unified-mamba") or "components" in opts:
        opts.update(mamba_size=30)
    cache = kvcore.create_cache(backend, size=size, page_size=ps, max_num_reqs=6,
                                max_context_len=200, enable_kv_events=True, **opts)
    if backend == "radix":
        cache.clock = itertools.count(1000).__next__  # the same readings on both sides, or a difference
    return cache


def _nodes(cache: kvcore.BasePrefixCache) -> list:
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


def _path_key(node) -> tuple:
    """A node named by its tokens from the root (and namespace): the same node on both sides."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(tuple(node.key))
        node = node.parent
    return tuple(reversed(parts))


def _components(cache) -> tuple:
    """The aux components of a one-tree cache (none for other trees)."""
    return tuple(getattr(cache, "aux", ()))


def _dump(cache) -> list:
    nodes = _nodes(cache)
    order = {x.id: i for i, x in enumerate(sorted(nodes, key=lambda x: x.id))}
    comps = _components(cache)
    rows = []
    for x in nodes:
        parts = tuple((c.value_len(x), c.lock_ref(x), repr(getattr(x, f"{c.name}_value", None))) for c in comps)
        rows.append((_path_key(x), str(x.extra_key), tuple(x.value.tolist()), x.lock_ref, x.hit_count,
                     x.priority, x.last_access_time, x.creation_time, order[x.id], parts))
    root = cache.root_node
    rows.sort(key=repr)
    lrus = [[_path_key(x) for x in c.lru] for c in comps if hasattr(c, "lru")]
    pools = [(v.name, v.allocator.free_slots().tolist()) for v in cache.pools()]
    return [(root.last_access_time, root.priority), lrus, pools, cache.cached_sizes(), cache.stats()] + rows


class Side:
    def __init__(self, backend: str, ps: int, policy: str, resume: bool):
        self.cache = _make(backend, ps, policy)
        self.engine = kvcore.Engine(self.cache)
        self.resume = resume
        self.alloc = self.cache.token_to_kv_pool_allocator
        self.reqs: dict[str, Req] = {}
        self.locks: list = []

    def lifecycle(self, req: Req, call) -> object:
        """``call`` (a cache_unfinished_req or cache_finished_req of ``req``), on this side's path."""
        if not self.resume:
            self.cache.forget_resume_point(req.kv)  # the whole-prefix path, as before the resumed insert
        return call()

    def state(self) -> tuple:
        c = self.cache
        reqs = []
        for rid, r in sorted(self.reqs.items()):
            lock = r.lock
            reqs.append((rid, r.kv.cache_protected_len, r.kv.kv_committed_len, r.kv.swa_evicted_seqlen,
                         r.prefix_indices.tolist(), repr(r.kv.components),
                         str(r.prefix_indices.dtype), _path_key(r.last_node) if r.last_node is not None else None,
                         None if lock is None else (lock.delta, lock.released)))
        claimed = [v.allocator.claimed_slots().tolist() for v in c.pools() if hasattr(v.allocator, "claimed_slots")]
        return (_dump(c), c.evictable_size(), c.protected_size(), self.alloc.available_size(), claimed,
                [repr(e) for e in c.take_events()], reqs)


class Pair:
    def __init__(self, backend: str, ps: int, policy: str, seed: int):
        self.rng = random.Random(seed)
        self.ps = ps
        self.sides = (Side(backend, ps, policy, True), Side(backend, ps, policy, False))
        rng = self.rng
        self.bases = [[rng.randrange(2, 7) for _ in range(40 + 6 * ps)] for _ in range(3)]
        self.n = 0
        self.log: list[str] = []

    def both(self, what: str, fn) -> list:
        self.log.append(what)
        out = [fn(s) for s in self.sides]
        a, b = (s.state() for s in self.sides)
        assert a == b, f"after {self.log[-12:]}: resumed and whole-prefix paths differ"
        assert out[0] == out[1], f"{what}: answers differ: {out}"
        return out

    def prompt(self) -> list[int]:
        rng = self.rng
        base = rng.choice(self.bases)
        return base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(2, 9) for _ in range(rng.randrange(1, 30))]

    def step(self) -> None:
        rng, ps = self.rng, self.ps
        live = sorted(self.sides[0].reqs)
        op = rng.random()
        if op < 0.18 and len(live) < 4:
            self.n += 1
            rid, ids, extra, prio = f"r{self.n}", self.prompt(), rng.choice([None, None, "t"]), rng.randrange(3)

            def admit(s: Side) -> bool:
                req = Req(rid, list(ids), extra_key=extra, priority=prio)
                ok = s.engine.admit(req)
                if ok:
                    s.reqs[rid] = req
                return ok
            self.both(f"admit {rid}", admit)
        elif op < 0.50 and live:
            rid = rng.choice(live)
            step = rng.choice([0, 1, ps, 2 * ps + 1, 3 * ps, rng.randrange(1, 25)])

            def extend(s: Side) -> tuple:
                req = s.reqs[rid]
                end = req.kv.kv_committed_len + step
                return s.lifecycle(req, lambda: s.engine.extend(req, end)), req.kv.kv_committed_len
            self.both(f"extend {rid} +{step}", extend)
        elif op < 0.58 and live:
            rid = rng.choice(live)
            # Several decode steps before the next insert: a window model frees what left the window
            # meanwhile, so the insert may end on a node without window slots (a shorter re-match).
            toks = [rng.randrange(2, 9) for _ in range(rng.choice([1, 1, 2, rng.randrange(3, 6 * ps + 12)]))]

            def decode(s: Side) -> int:
                req = s.reqs[rid]
                if req.kv.kv_committed_len < req.seqlen:
                    return -1
                n = 0
                for tok in toks:
                    if req.kv.kv_committed_len + 1 >= 200 or not s.engine.decode([req], [tok]):
                        break
                    n += 1
                if n:
                    s.lifecycle(req, lambda: kvcore.cache_unfinished_req(req, s.cache))
                return n
            self.both(f"decode {rid} x{len(toks)}", decode)
        elif op < 0.66 and live:
            rid = live[rng.randrange(len(live))]

            def finish(s: Side) -> None:
                req = s.reqs.pop(rid)
                s.lifecycle(req, lambda: s.engine.finish(req))
            self.both(f"finish {rid}", finish)
        elif op < 0.76:
            key, extra = self.prompt(), rng.choice([None, "t"])

            def match(s: Side) -> list:
                return s.cache.match_prefix(RadixKey(list(key), extra)).device_indices.tolist()
            self.both("match", match)
        elif op < 0.84:
            key = self.prompt()
            n = len(key) - len(key) % ps

            def insert(s: Side) -> int | str:
                if n == 0 or s.alloc.available_size() < n:
                    return -1
                v = s.alloc.alloc(n)
                try:
                    r = s.cache.insert(RadixKey(key[:n]), v)
                except ValueError as exc:  # (mamba: no state slot for the key)
                    s.alloc.free(v)
                    return str(exc)
                if not r.duplicates_freed:
                    s.alloc.free(v[: r.prefix_len])
                return r.prefix_len
            self.both("insert", insert)
        elif op < 0.92:
            k = rng.randrange(0, 6 * ps)
            self.both(f"evict {k}", lambda s: s.cache.evict(k).num_tokens_evicted)
        else:
            key = self.prompt()
            drop = rng.random() < 0.5

            def lock(s: Side) -> int:
                if drop and s.locks:
                    node, lk = s.locks.pop(0)
                    return s.cache.dec_lock_ref(node, lk).delta
                node = s.cache.match_prefix(RadixKey(list(key))).last_device_node
                lk = s.cache.inc_lock_ref(node)
                s.locks.append((node, lk))
                return lk.delta
            self.both("lock", lock)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        for s in self.sides:
            InvariantChecker(s.cache).check(list(s.reqs.values()))
        self.both("finish all", lambda s: [s.lifecycle(req, lambda req=req: s.engine.finish(req))
                                           for req in [s.reqs.pop(r) for r in sorted(s.reqs)]])
        self.both("unlock all", lambda s: [s.cache.dec_lock_ref(n, lk).delta for n, lk in s.locks])
        for s in self.sides:
            s.locks.clear()
        # The victims and their order (KV events) show the evictable leaves agree too.
        self.both("evict all", lambda s: s.cache.evict(10**6).num_tokens_evicted)
        for s in self.sides:
            InvariantChecker(s.cache).check([])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_resumed_insert_same_as_whole_prefix(backend: str, ps: int, seed: int) -> None:
    Pair(backend, ps, "lru", seed).run(160)


@pytest.mark.parametrize("backend", COMPONENT_SETS)
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_component_sets_resumed_insert_same_as_whole_prefix(backend: str, ps: int, seed: int) -> None:
    Pair(backend, ps, "lru", seed).run(160)


@pytest.mark.parametrize("policy", ["lfu", "priority", "fifo"])
def test_resumed_insert_same_as_whole_prefix_policies(policy: str) -> None:
    Pair("radix", 4, policy, 7).run(160)


def _chunked(backend: str, resume: bool, interleave) -> tuple:
    """A 10-chunk prompt, ``interleave(side, chunk_no)`` between chunks; the state after every chunk."""
    s = Side(backend, 4, "lru", resume)
    ids = [2 + (i * 7) % 11 for i in range(160)]
    req = Req("long", ids)
    s.reqs["long"] = req
    assert s.engine.admit(req)
    states = []
    for k in range(10):
        interleave(s, k)
        s.lifecycle(req, lambda: s.engine.extend(req, req.kv.kv_committed_len + 16))
        states.append(s.state())
    s.lifecycle(req, lambda: s.engine.finish(s.reqs.pop("long")))
    states.append(s.state())
    InvariantChecker(s.cache).check([])
    return tuple(states)


def _split_and_share(s: Side, k: int) -> None:
    """Another request's work on and below the running request's path: splits, a shared tail, an eviction."""
    req = s.reqs["long"]
    done = req.kv.kv_committed_len
    if k == 3:
        s.cache.match_prefix(RadixKey(req.origin_input_ids[: done - 8]))  # splits the locked path
    if k == 5:
        n = done + 24
        v = s.alloc.alloc(n)
        r = s.cache.insert(RadixKey(req.origin_input_ids[:n]), v)  # inserts the request's next tokens first
        if not r.duplicates_freed:
            s.alloc.free(v[: r.prefix_len])
    if k == 7:
        s.cache.evict(10**6)


@pytest.mark.parametrize("backend", BACKENDS + COMPONENT_SETS)
def test_chunked_prefill_under_interleavings(backend: str) -> None:
    assert _chunked(backend, True, _split_and_share) == _chunked(backend, False, _split_and_share)


@pytest.mark.parametrize("backend", BACKENDS + COMPONENT_SETS)
def test_resumed_prefix_indices_are_a_view_with_stable_content(backend: str) -> None:
    s = Side(backend, 4, "lru", True)
    req = Req("long", list(range(2, 130)))
    s.reqs["long"] = req
    assert s.engine.admit(req)
    seen = []
    for _ in range(6):
        assert s.engine.extend(req, req.kv.kv_committed_len + 16)
        seen.append((req.prefix_indices, req.prefix_indices.tolist()))
        if req.kv.cache_protected_len:  # (mamba at pages > 1 caches only its tracked snapshots)
            rp = s.cache.resume_point(req.kv)
            assert rp is not None and rp.length == req.kv.cache_protected_len
    row = s.cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    assert req.prefix_indices.tolist() == row[: req.kv.kv_committed_len].tolist()
    for t, content in seen:  # a later chunk never rewrites what an earlier answer showed
        assert t.tolist() == content and t.dtype == torch.int64
    s.engine.finish(s.reqs.pop("long"))
    assert s.cache.resume_point(req.kv) is None and not s.cache.resume_points


@pytest.mark.parametrize("backend", BACKENDS + COMPONENT_SETS)
def test_a_garbage_row_prefix_is_not_read(backend: str) -> None:
    """The tree owns ``[0, cache_protected_len)`` of the row: writing there changes neither path's answer."""
    def garbage(s: Side, k: int) -> None:
        req = s.reqs["long"]
        p = req.kv.cache_protected_len
        if k == 4 and p:
            s.cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :p] = 7

    a, b = _chunked(backend, True, garbage), _chunked(backend, False, garbage)
    assert a == b


def _moved(resume: bool, move) -> tuple:
    s = Side("radix", 4, "lru", resume)
    req = Req("r", list(range(2, 60)))
    s.reqs["r"] = req
    assert s.engine.admit(req)
    for end in (16, 32):
        s.lifecycle(req, lambda end=end: s.engine.extend(req, end))
    if resume:
        rp = s.cache.resume_point(req.kv)
        assert rp is not None and rp.node is req.last_node and rp.length == 32
    move(req)
    try:
        s.lifecycle(req, lambda: s.engine.extend(req, 48))
        err = None
    except (ValueError, TypeError, AssertionError) as exc:
        err = (type(exc), str(exc))
    return err, s.state()


def _other_namespace(req: Req) -> None:
    req.extra_key = "other"


def _shorter_protected(req: Req) -> None:
    req.kv.cache_protected_len = 16


@pytest.mark.parametrize("move", [_other_namespace, _shorter_protected])
def test_fallback_when_the_request_moved(move) -> None:
    """A resume point that no longer fits the record is not used: the whole-prefix path answers, as before."""
    assert _moved(True, move) == _moved(False, move)


def _garbage_row_setup(backend: str) -> tuple[Side, Req, Req]:
    """``a`` cached 16 tokens, ``b`` (the same prompt) 24: ``a``'s next 32 hold duplicates [16, 24), new [24, 32)."""
    s = Side(backend, 4, "lru", True)
    ids = list(range(2, 60))
    a, b = Req("a", ids), Req("b", list(ids))
    s.reqs.update(a=a, b=b)
    assert s.engine.admit(a) and s.engine.extend(a, 16)
    assert s.engine.admit(b) and s.engine.extend(b, 24)
    assert s.engine.extend_slots(a, 32)
    a.kv.kv_committed_len = 32
    return s, a, b


GARBAGE = {
    "a tree node's slot among the duplicates": lambda row, brow, free: (20, int(brow[20])),
    "a free slot in the new part": lambda row, brow, free: (28, int(free[0])),
    "a slot named twice (duplicate and new part)": lambda row, brow, free: (28, int(row[17])),
    "the padding slot": lambda row, brow, free: (25, 0),
}


@pytest.mark.parametrize("backend", BACKENDS + COMPONENT_SETS)
@pytest.mark.parametrize("resumed", [True, False])
@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_garbage_row_is_refused_before_anything_changes(backend: str, resumed: bool, kind: str) -> None:
    """The row's claim: the request's part of its row is checked as a whole before the insert (both paths)."""
    s, a, b = _garbage_row_setup(backend)
    r2t = s.cache.req_to_token_pool.req_to_token
    row, brow = r2t[a.kv.req_pool_idx], r2t[b.kv.req_pool_idx]
    pos, slot = GARBAGE[kind](row, brow, s.cache.pools()[0].allocator.free_slots())  # the full pool
    saved = int(row[pos])
    row[pos] = slot
    if not resumed:
        s.cache.forget_resume_point(a.kv)
    s.state()  # (takes the setup's KV events)
    before = s.state()
    with pytest.raises(ValueError, match="request 'a'"):
        kvcore.cache_unfinished_req(a, s.cache, chunked=True)
    assert s.state() == before
    row[pos] = saved
    kvcore.cache_unfinished_req(a, s.cache, chunked=True)  # the same call with the row put right goes through
    for rid in ("a", "b"):
        s.engine.finish(s.reqs.pop(rid))
    InvariantChecker(s.cache).check([])


def _decoded_past_the_window(backend: str, resume: bool, decoded: int) -> tuple:
    """A prefill in chunks, then ``decoded`` decode steps (each freeing what left the window), then an insert:
    the inserted node may hold too few window tokens, so the re-match ends above it."""
    s = Side(backend, 4, "lru", resume)
    req = Req("a", list(range(2, 42)))
    s.reqs["a"] = req
    assert s.engine.admit(req)
    states = []
    for end in (16, 40):
        s.lifecycle(req, lambda end=end: s.engine.extend(req, end))
        states.append(s.state())
    for _ in range(decoded):
        assert s.engine.decode([req], [5])
    s.lifecycle(req, lambda: kvcore.cache_unfinished_req(req, s.cache))
    states.append(s.state())
    rematch = s.cache.match_prefix(RadixKey(req.fill_ids[: req.kv.cache_protected_len])).device_indices.numel()
    states.append(s.state())
    s.lifecycle(req, lambda: s.engine.finish(s.reqs.pop("a")))
    states.append(s.state())
    InvariantChecker(s.cache).check([])
    return tuple(states), rematch < req.kv.cache_protected_len


@pytest.mark.parametrize("backend", ["swa", "unified-swa"])
def test_window_limited_rematch_same_as_whole_prefix(backend: str) -> None:
    limited = 0
    for decoded in range(1, 30):
        a, short = _decoded_past_the_window(backend, True, decoded)
        b, _ = _decoded_past_the_window(backend, False, decoded)
        assert a == b, f"{decoded} decode steps: resumed and whole-prefix paths differ"
        limited += short
    assert limited, "no run ended on a node with too few window tokens: the case this test is for"


@pytest.mark.parametrize("backend", BACKENDS + COMPONENT_SETS)
@pytest.mark.parametrize("resumed", [True, False])
@pytest.mark.parametrize("call", ["cache_unfinished_req", "cache_finished_req"])
def test_fewer_ids_than_committed_is_refused_before_any_component_acts(backend: str, resumed: bool,
                                                                       call: str) -> None:
    """A record committing past its ids is refused with nothing changed, on either path: no component has
    freed a window slot or taken a state slot for an insert that cannot happen."""
    s = Side(backend, 1, "lru", resumed)
    req = Req("r", list(range(2, 60)))
    s.reqs["r"] = req
    assert s.engine.admit(req) and s.engine.extend(req, 16) and s.engine.extend(req, 32)
    assert s.engine.extend_slots(req, 40)
    if not resumed:
        s.cache.forget_resume_point(req.kv)
    req.kv.kv_committed_len = 40
    ids = req.origin_input_ids
    req.origin_input_ids = ids[:36]
    s.state()  # (takes the setup's KV events)
    before = s.state()
    with pytest.raises(ValueError, match="36 tokens"):  # each backend words it its own way
        getattr(s.cache, call)(req)
    assert s.state() == before
    req.origin_input_ids = ids
    s.engine.finish(s.reqs.pop("r"))
    InvariantChecker(s.cache).check([])


@pytest.mark.parametrize("backend", BACKENDS + COMPONENT_SETS)
@pytest.mark.parametrize("end", ["finish", "abort", "retract", "offload"])
def test_the_tree_keeps_no_resume_point_past_the_request(backend: str, end: str) -> None:
    """The resume points are the tree's (by row), not the record's: every way a request ends drops its point,
    and the row's next request, on the same prefix, makes its own."""
    s = Side(backend, 4, "lru", True)
    prompt = list(range(2, 60))
    req = Req("r", prompt)
    s.reqs["r"] = req
    assert s.engine.admit(req) and s.engine.extend(req, 16) and s.engine.extend(req, 32)
    row = req.kv.req_pool_idx
    assert s.cache.resume_point(req.kv) is s.cache.resume_points.get(row)
    had_point = s.cache.resume_point(req.kv) is not None
    if end == "finish":
        s.engine.finish(req)
    elif end == "abort":
        s.engine.abort(req)
    else:
        s.engine.retract(req, mode="recompute" if end == "retract" else "offload")
    s.reqs.pop("r")
    assert not s.cache.resume_points, f"{backend}: a resume point outlived its request ({end})"
    nxt = Req("n", list(prompt))
    s.reqs["n"] = nxt
    assert s.engine.admit(nxt) and s.engine.extend(nxt, 48)
    assert nxt.kv.req_pool_idx == row or not had_point
    rp = s.cache.resume_point(nxt.kv)
    assert rp is None or (rp.node is nxt.last_node and rp.length == nxt.kv.cache_protected_len)
    s.engine.finish(s.reqs.pop("n"))
    assert not s.cache.resume_points
    InvariantChecker(s.cache).check(owners=[])


def _row_freed_behind_the_cache(resume: bool, same_prompt: bool) -> tuple:
    s = Side("radix", 4, "lru", resume)
    a = Req("a", list(range(2, 60)))
    assert s.engine.admit(a) and s.engine.extend(a, 16) and s.engine.extend(a, 32)
    row = a.kv.req_pool_idx
    # An engine that frees a request's lock and row itself, without the cache: the row's point stays behind.
    s.cache.dec_lock_ref(a.last_node, a.lock)
    s.cache.free_kv_row(a.kv, [(a.kv.cache_protected_len, a.kv.kv_allocated_len)])
    s.cache.req_to_token_pool.free(a)
    b = Req("b", list(range(2, 60)) if same_prompt else list(range(200, 260)))
    s.reqs["b"] = b
    assert s.engine.admit(b) and b.kv.req_pool_idx == row
    out = []
    for end in (40, 48, 56):
        s.lifecycle(b, lambda end=end: s.engine.extend(b, end))
        out.append(s.state())
    s.lifecycle(b, lambda: s.engine.finish(s.reqs.pop("b")))
    out.append(s.state())
    InvariantChecker(s.cache).check(owners=[])
    return tuple(out)


@pytest.mark.parametrize("same_prompt", [True, False])
def test_a_point_left_on_a_row_answers_as_the_whole_prefix_path(same_prompt: bool) -> None:
    """A point is used only where the request's own lock holds its node at its depth: the row's next request
    (on the same prefix, or another) gets the whole-prefix path's answers either way."""
    assert _row_freed_behind_the_cache(True, same_prompt) == _row_freed_behind_the_cache(False, same_prompt)


def test_the_mixin_goes_before_the_base_class() -> None:
    """Its table of resume points is set up by its own ``__init__``, which runs only before BasePrefixCache's."""
    from kvcore import BasePrefixCache
    from kvcore.tree import ResumableInsert

    with pytest.raises(TypeError, match=r"Wrong: mix ResumableInsert in before BasePrefixCache"):
        type("Wrong", (BasePrefixCache, ResumableInsert), {})

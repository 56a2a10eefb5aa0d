"""Full-only unified: insert reuses the last match walk; answers and checks as without it."""

import random

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey


def _cache(ps=1):
    return kvcore.create_cache("unified", size=256, page_size=ps)


def _state(c):
    return (c.total_size(), c.evictable_size(), c.token_to_kv_pool_allocator.available_size(),
            sorted((tuple(x.key), x.value.tolist()) for x in c._nodes()))


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_after_match_same_as_without(ps):
    a, b = _cache(ps), _cache(ps)
    keys = [list(range(2, 2 + 4 * ps)), list(range(2, 2 + 2 * ps)) + [99] * (2 * ps),
            list(range(2, 2 + 3 * ps)) + [7] * ps, list(range(2, 2 + 4 * ps))]
    for k in keys:
        for c, do_match in ((a, True), (b, False)):
            v = c.token_to_kv_pool_allocator.alloc(len(k))
            if do_match:
                c.match_prefix(RadixKey(list(k)))
            r = c.insert(RadixKey(list(k)), v)
            assert r.prefix_len >= 0
    assert _state(a) == _state(b)
    for c in (a, b):
        c.sanity_check()
        InvariantChecker(c).check([])


def test_reuse_still_refuses_bad_tail():
    c = _cache()
    v = c.token_to_kv_pool_allocator.alloc(4)
    c.insert(RadixKey([5, 6, 7, 8]), v)
    bad = [5, 6, True, 9]
    c.match_prefix(RadixKey([5, 6, 1, 9]))  # splits [5 6 | 7 8]
    before = _state(c)
    w = c.token_to_kv_pool_allocator.alloc(4)
    with pytest.raises(TypeError, match="bool"):
        c.insert(RadixKey(bad), w)
    c.token_to_kv_pool_allocator.free(w)
    assert _state(c) == before
    c.sanity_check()
    InvariantChecker(c).check([])


def test_reuse_checks_unaligned_tail():
    c = _cache(4)
    c.match_prefix(RadixKey([5, 6, 7, 8, 9, 10, 11, 12]))
    w = c.token_to_kv_pool_allocator.alloc(12)
    with pytest.raises(TypeError):
        c.insert(RadixKey([5, 6, 7, 8, 9, 10, 11, 12, 1.5]), w[:9])
    assert c.total_size() == 0
    c.token_to_kv_pool_allocator.free(w)
    InvariantChecker(c).check([])


def test_shape_change_between_match_and_insert():
    c = _cache()
    alloc = c.token_to_kv_pool_allocator.alloc
    c.insert(RadixKey([2, 3, 4, 5]), alloc(4))
    c.match_prefix(RadixKey([2, 3, 4, 5, 6, 7]))
    c.insert(RadixKey([2, 3, 9]), alloc(3))  # splits the matched node
    c.evict(100)
    r = c.insert(RadixKey([2, 3, 4, 5, 6, 7]), alloc(6))
    assert r.prefix_len == 0 and c.total_size() == 6
    c.sanity_check()
    InvariantChecker(c).check([])



def _pool_state(c):
    alloc = c.token_to_kv_pool_allocator
    return (alloc.free_slots().tolist(), alloc.claimed_slots().tolist(), _state(c))


def _insert_value(c, key, n, kind):
    """A value for ``key``: fresh slots (one run), the same out of order, or the tree's own prefix."""
    alloc = c.token_to_kv_pool_allocator
    if kind == "own":  # the tree's own slots as duplicates: a use after free, refused
        m = c.match_prefix(RadixKey(list(key)))
        v = alloc.alloc(n - m.device_indices.numel())
        return None if v is None else (torch.cat([m.device_indices, v]), v)
    v = alloc.alloc(n)
    if v is None:
        return None
    if kind == "shuffled":  # not one run: the general path on both caches
        v = v.view(-1, c.page_size).flip(0).reshape(-1)
    return v, v


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_one_call_free_and_claim_same_as_general_path(ps, seed, monkeypatch):
    """The insert's one pool call (``free_and_claim``: duplicates freed, new leaf claimed) leaves
    every slot, the free-list order and every refusal as the general path (claim, then free)."""
    fast, slow = _cache(ps), _cache(ps)
    monkeypatch.setattr(slow.token_to_kv_pool_allocator, "free_and_claim", lambda *a, **k: None)
    rng = random.Random(seed)
    bases = [[rng.randrange(2, 6) for _ in range(8 * ps)] for _ in range(3)]
    for step in range(150):
        base = rng.choice(bases)
        n = rng.randrange(1, 9) * ps
        key = base[:n] if rng.random() < 0.7 else base[: n - ps] + [rng.randrange(2, 6) for _ in range(ps)]
        op = rng.random()
        if op < 0.1:
            k = rng.choice([1, ps, 5 * ps])
            assert fast.evict(k).num_tokens_evicted == slow.evict(k).num_tokens_evicted
            continue
        kind = "own" if op < 0.2 else "shuffled" if op < 0.3 else "fresh"
        prev = rng.randrange(0, n // ps + 1) * ps if kind != "own" and rng.random() < 0.3 else 0
        matched = kind != "own" and rng.random() < 0.5
        results = []
        for c in (fast, slow):
            got = _insert_value(c, key, n, kind)
            if got is None:
                results.append("pool full")
                continue
            value, mine = got
            if matched:
                c.match_prefix(RadixKey(list(key)))
            try:
                got_len = c.insert(RadixKey(list(key)), value, prev_prefix_len=prev).prefix_len
                results.append(("ok", got_len))
                # value[:prev] is taken for the tree's own (left alone): fresh slots there are still ours.
                c.token_to_kv_pool_allocator.free(mine[: min(prev, got_len)])
            except ValueError as exc:
                results.append(("refused", str(exc)))
                c.token_to_kv_pool_allocator.free(mine)  # refused, nothing changed: the slots are still ours
        assert results[0] == results[1], (step, results)
        assert _pool_state(fast) == _pool_state(slow), step
    for c in (fast, slow):
        c.sanity_check()
        InvariantChecker(c).check([])


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("run", [True, False])
def test_insert_of_the_trees_own_slots_changes_nothing(ps, run):
    """Duplicates that are the tree's own slots (a use after free) are refused before anything
    changes: a value that is one run of slots (the tree's, then fresh ones right after them) and
    one that is not (two nodes' slots, fresh ones out of order)."""
    c = _cache(ps)
    alloc = c.token_to_kv_pool_allocator
    c.insert(RadixKey(list(range(10, 10 + 2 * ps))), alloc.alloc(2 * ps))
    if not run:
        c.insert(RadixKey(list(range(10, 10 + ps)) + [99] * ps), alloc.alloc(2 * ps))  # two nodes on the path
    key = RadixKey(list(range(10, 10 + 4 * ps)))
    own = c.match_prefix(key).device_indices
    new = alloc.alloc(2 * ps)
    if run:
        assert int(new[0]) == int(own[-1]) + 1  # one run with the tree's slots
    else:
        new = new.view(-1, ps).flip(0).reshape(-1)
    before = _pool_state(c)
    with pytest.raises(ValueError, match=r"slot \d+ is owned by a tree node of the cache"):
        c.insert(key, torch.cat([own, new]))
    assert _pool_state(c) == before
    alloc.free(new)
    c.sanity_check()
    InvariantChecker(c).check([])


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("prev", [0, 1, 3])
def test_duplicates_over_several_nodes_go_back_node_by_node(ps, prev, monkeypatch):
    """Duplicates spanning three path nodes and a split: the one-call path gives the pages back
    in SGLang's per-node order (paged: each node's pages in front of the ones before)."""
    caches = [_cache(ps), _cache(ps)]
    monkeypatch.setattr(caches[1].token_to_kv_pool_allocator, "free_and_claim", lambda *a, **k: None)
    for c in caches:
        alloc = c.token_to_kv_pool_allocator
        values = [alloc.alloc(n * ps) for n in (2, 3, 5, 4, 6)]  # each one run (taken before any free)
        for n, v in zip((2, 3, 5), values):  # nodes [0, 2), [2, 3), [3, 5) pages
            c.insert(RadixKey(list(range(10, 10 + n * ps))), v)
        c.insert(RadixKey(list(range(10, 10 + 3 * ps)) + [1] * ps), values[3])
        key = RadixKey(list(range(10, 10 + 4 * ps)) + [7] * 2 * ps)  # splits [3, 5) at 4
        r = c.insert(key, values[4], prev_prefix_len=prev * ps)
        assert r.prefix_len == 4 * ps
    assert _pool_state(caches[0]) == _pool_state(caches[1])
    for c in caches:
        c.sanity_check()


@pytest.mark.parametrize("ps", [1, 4])
def test_new_leaf_keeps_its_own_copy(ps):
    """The one-call path's leaf value is the tree's own copy: the caller may reuse its tensor."""
    c = _cache(ps)
    alloc = c.token_to_kv_pool_allocator
    c.insert(RadixKey(list(range(10, 10 + 2 * ps))), alloc.alloc(2 * ps))
    v = alloc.alloc(4 * ps)
    kept = v[2 * ps :].tolist()
    key = RadixKey(list(range(10, 10 + 4 * ps)))
    assert c.insert(key, v).prefix_len == 2 * ps
    v.fill_(-1)
    assert c.match_prefix(key).device_indices[2 * ps :].tolist() == kept
    c.sanity_check()
    InvariantChecker(c).check([])

"""The checker must fail, naming slot and owner, on each kind of broken accounting."""

import pytest
import torch

from kvcore import InvariantChecker, InvariantViolation, PoolView, Req, create_cache


def cache_with_request(page_size=1, n=6):
    cache = create_cache("chunk", size=32, page_size=page_size, max_num_reqs=4, max_context_len=32)
    req = Req("victim", list(range(n)))
    cache.req_to_token_pool.alloc([req])
    slots = cache.token_to_kv_pool_allocator.alloc(n if page_size == 1 else page_size * 2)
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : slots.numel()] = slots.to(torch.int32)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = n
    return cache, req, slots


def test_clean_state_passes_and_reports_balance():
    cache, req, _ = cache_with_request()
    (report,) = InvariantChecker(cache).check([req])
    assert report.balanced and report.uncached == 6 and report.available == 26


def test_leaked_slot_is_named():
    cache, req, slots = cache_with_request()
    lost = cache.token_to_kv_pool_allocator.alloc(2)  # nobody records these
    with pytest.raises(InvariantViolation, match=rf"slot {int(lost[0])} leaked"):
        InvariantChecker(cache).check([req])


def test_forgotten_owner_shows_as_leak():
    cache, req, slots = cache_with_request()
    with pytest.raises(InvariantViolation, match="rows leaked"):
        InvariantChecker(cache).check([])  # the request is alive but not passed


def test_owned_and_free_slot_names_slot_and_owner():
    cache, req, slots = cache_with_request()
    cache.token_to_kv_pool_allocator.free(slots[2:3])  # freed behind the owner's back
    with pytest.raises(
        InvariantViolation, match=rf"slot {int(slots[2])} is in the free list but owned by request 'victim'"
    ):
        InvariantChecker(cache).check([req])


def test_paged_use_after_free_names_the_page():
    cache, req, slots = cache_with_request(page_size=4, n=6)
    cache.token_to_kv_pool_allocator.free(slots[4:5])  # the whole second page goes back
    page = int(slots[4]) // 4
    with pytest.raises(InvariantViolation, match=rf"page {page} .* owned by request 'victim'"):
        InvariantChecker(cache).check([req])


class _DoubleFreeView:
    """An allocator whose free list lists a slot twice, as a buggy one would."""

    def __init__(self, inner, dup):
        self._inner, self._dup = inner, dup

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def free_slots(self):
        return torch.cat([self._inner.free_slots(), torch.tensor([self._dup])])

    def available_size(self):
        return self._inner.available_size() + 1

    def pool_views(self):
        return [PoolView("full", self)]


def test_double_free_is_named():
    cache, req, slots = cache_with_request()
    free_slot = int(cache.token_to_kv_pool_allocator.free_slots()[0])
    cache.token_to_kv_pool_allocator = _DoubleFreeView(cache.token_to_kv_pool_allocator, free_slot)
    with pytest.raises(InvariantViolation, match=rf"slot {free_slot} is in the free list twice"):
        InvariantChecker(cache).check([req])


def test_allocator_itself_refuses_a_double_free():
    cache, req, slots = cache_with_request()
    alloc = cache.token_to_kv_pool_allocator
    alloc.free(slots[:1])
    before = alloc.available_size()
    with pytest.raises(ValueError):
        alloc.free(slots[:1])
    assert alloc.available_size() == before


def test_record_out_of_bounds():
    cache, req, slots = cache_with_request()
    req.kv.kv_committed_len = 7
    with pytest.raises(InvariantViolation, match="request 'victim': record out of bounds: committed=7 allocated=6"):
        InvariantChecker(cache).check([req])


def test_two_records_on_one_row():
    cache, req, slots = cache_with_request()
    other = Req("intruder", [1])
    other.kv.req_pool_idx = req.kv.req_pool_idx
    with pytest.raises(InvariantViolation, match="held by both request 'victim' and request 'intruder'"):
        InvariantChecker(cache).check([req, other])


def test_slot_owned_twice():
    cache, req, slots = cache_with_request()
    other = Req("copycat", [1, 2])
    cache.req_to_token_pool.alloc([other])
    cache.req_to_token_pool.req_to_token[other.kv.req_pool_idx, :2] = slots[:2].to(torch.int32)
    other.kv.kv_allocated_len = other.kv.kv_committed_len = 2
    with pytest.raises(InvariantViolation, match="owned by more than one owner: request 'victim', request 'copycat'"):
        InvariantChecker(cache).check([req, other])


# ---------------------------------------------------------------------------- chunked counting
# The checker counts owners and the free list in chunks of kvcore.invariants._CHUNK slots (one int32 count per
# page, no pool-size int64 temporaries): with tiny chunks every violation is still found and named.


@pytest.fixture(params=[None, 3], ids=["one-chunk", "chunks-of-3"])
def chunk(request, monkeypatch):
    import kvcore.invariants as inv

    if request.param is not None:
        monkeypatch.setattr(inv, "_CHUNK", request.param)
    return request.param


def _tree_cache(n_reqs=5, length=7, page_size=1):
    from kvcore.engine import Engine

    cache = create_cache("radix", size=128, page_size=page_size, max_num_reqs=8, max_context_len=64)
    eng = Engine(cache)
    live = []
    for i in range(n_reqs):
        r = Req(f"r{i}", list(range(100 * i, 100 * i + length)))
        assert eng.admit(r) and eng.extend(r)
        if i % 2:
            live.append(r)
        else:
            eng.finish(r)
    for _ in range(3):  # the running requests hold decoded slots the tree does not
        assert eng.decode(live) == len(live)
    return cache, live


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_count_passes_a_tree_with_requests(chunk, page_size):
    cache, live = _tree_cache(page_size=page_size)
    (report,) = InvariantChecker(cache).check(live)
    assert report.balanced and report.evictable > 0 and report.uncached > 0


def test_chunked_count_names_each_violation(chunk):
    cache, req, slots = cache_with_request()
    lost = cache.token_to_kv_pool_allocator.alloc(2)
    with pytest.raises(InvariantViolation, match=rf"slot {int(lost[0])} leaked.*2 page\(s\) leaked in all"):
        InvariantChecker(cache).check([req])

    cache, req, slots = cache_with_request()
    cache.token_to_kv_pool_allocator.free(slots[2:3])
    with pytest.raises(InvariantViolation, match=rf"slot {int(slots[2])} is in the free list but owned by "
                                                 r"request 'victim' \(use after free\)"):
        InvariantChecker(cache).check([req])

    cache, req, slots = cache_with_request()
    free_slot = int(cache.token_to_kv_pool_allocator.free_slots()[-1])
    cache.token_to_kv_pool_allocator = _DoubleFreeView(cache.token_to_kv_pool_allocator, free_slot)
    with pytest.raises(InvariantViolation, match=rf"slot {free_slot} is in the free list twice"):
        InvariantChecker(cache).check([req])


def test_a_tree_node_sharing_a_request_slot_is_named(chunk):
    cache, live = _tree_cache()
    node_slot = int(next(iter(cache.iter_owned_slots())).slots[0])
    victim = live[0]
    # Its last decoded slot (which only it owns) now names a node's slot: that one leaks, the node's is shared.
    cache.req_to_token_pool.req_to_token[victim.kv.req_pool_idx, victim.kv.kv_allocated_len - 1] = node_slot
    with pytest.raises(InvariantViolation, match=rf"slot {node_slot} is owned by more than one owner: request "
                                                 f"'{victim.rid}', radix node"):
        InvariantChecker(cache).check(live)


def test_padding_and_outside_slots_are_named(chunk):
    cache, req, slots = cache_with_request()
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    row[5] = 0
    with pytest.raises(InvariantViolation, match="padding slot 0 is owned by request 'victim'"):
        InvariantChecker(cache).check([req])
    row[5] = 1000
    with pytest.raises(InvariantViolation, match="slot 1000 is owned by request 'victim' but lies outside the pool"):
        InvariantChecker(cache).check([req])


def test_an_unbalanced_pool_says_which_side_is_over_and_by_how_much(monkeypatch):
    # Old: "pool does not balance: [full] total=... available=..." left the sum to the reader.
    cache, live = _tree_cache()
    (report,) = InvariantChecker(cache).check(live)
    real = cache.evictable_size()
    monkeypatch.setattr(cache, "evictable_size", lambda: real + 42)
    with pytest.raises(InvariantViolation, match=r"pool does not balance: .* = \d+, 42 more than total=128; "
                                                 r"the cache reports \d+ cached token\(s\) .* its size counters are "
                                                 r"42 too high"):
        InvariantChecker(cache).check(live)
    monkeypatch.setattr(cache, "evictable_size", lambda: real)
    alloc = cache.token_to_kv_pool_allocator
    avail = alloc.available_size()
    monkeypatch.setattr(alloc, "available_size", lambda: avail - 5)
    with pytest.raises(InvariantViolation, match=r"5 fewer than total=128; the allocator reports available=\d+ but "
                                                 r"its free list holds \d+ slot\(s\): available_size\(\) is 5 too low"):
        InvariantChecker(cache).check(live)

"""Slot ownership checks: the CPU numpy path and the torch path refuse the same slots, naming them alike."""

import pytest
import torch

import kvcore
from kvcore import InvariantChecker


def _cases(alloc, held, ps):
    free = int(alloc.free_slots()[0])
    mine = int(held[ps])
    return {
        "negative": [mine, -1],
        "far negative": [-(10**6)],
        "past the end": [alloc.size + ps],
        "padding": [0],
        "free": [mine, free],
        "named twice": [mine, int(held[ps + 1]), mine],
        "owned by a node": [int(held[0])],
        "more slots than the pool": [mine] * (alloc.size + ps + 1),
    }


@pytest.mark.parametrize("ps", [1, 4, 3])
def test_numpy_and_torch_paths_refuse_alike_and_change_nothing(ps):
    cache = kvcore.create_cache("radix", size=48, page_size=ps, max_num_reqs=1, max_context_len=48)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(48)
    # Free slots in the middle; the last ones stay handed out (a -1 that wrapped around would land there).
    alloc.free(held[24 : 24 + 4 * ps])
    held = torch.cat((held[:24], held[24 + 4 * ps :]))
    cache.insert(list(range(100, 100 + ps)), held[:ps].clone())  # the tree owns the first page
    for name, slots in _cases(alloc, held, ps).items():
        messages = set()
        for dtype in (torch.int64, torch.int32):  # int64 on the CPU: numpy views; int32: torch ops
            owned, free = alloc.claims.owner_map().clone(), alloc.pages.free_cnt.clone()
            with pytest.raises(ValueError) as err:
                alloc.check_claimable(torch.tensor(slots, dtype=dtype), commit=True)
            messages.add(str(err.value))
            assert torch.equal(alloc.claims.owner_map(), owned) and torch.equal(alloc.pages.free_cnt, free), name
        assert len(messages) == 1, (name, messages)
    good = held[ps : 3 * ps]
    for dtype in (torch.int64, torch.int32):
        alloc.check_claimable(good.to(dtype))  # without commit: nothing claimed
        assert alloc.claimed_slots().tolist() == sorted(held[:ps].tolist())
    alloc.check_claimable(good, commit=True)
    assert alloc.claimed_slots().tolist() == sorted(held[: 3 * ps].tolist())
    with pytest.raises(ValueError, match="already owned"):
        alloc.check_claimable(good[:1].to(torch.int32))
    alloc.disown(good)
    alloc.free(held[ps:])
    InvariantChecker(cache).check([])


def test_claim_stamps_survive_disown_and_reclaim():
    """Claimed slots hold stamps (not 1s) in the owner map: still owned, still given up by disown."""
    cache = kvcore.create_cache("radix", size=64, page_size=1, max_num_reqs=1, max_context_len=64)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(40)
    alloc.check_claimable(held[:20], commit=True)
    alloc.disown(held[5:10])
    alloc.check_claimable(held[5:10], commit=True)  # given up, so claimable again
    for dtype in (torch.int64, torch.int32):
        with pytest.raises(ValueError, match="already owned"):
            alloc.check_claimable(held[19:21].to(dtype))
    alloc.disown(held[:20])
    assert alloc.claimed_slots().numel() == 0
    alloc.free(held)
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("ps", [1, 4, 3])
def test_a_run_of_slots_is_refused_as_by_the_general_path(ps, monkeypatch):
    """A contiguous ascending run (alloc_extend's usual value) takes the slice path; every refusal it
    meets reads as the general path's (runs not recognised) for the same slots, and changes nothing."""
    cache = kvcore.create_cache("radix", size=48, page_size=ps, max_num_reqs=1, max_context_len=48)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(48)
    assert held.tolist() == list(range(ps, 48 + ps))  # a fresh pool hands out one run
    alloc.free(held[8 * ps : 9 * ps])  # page 9 free
    cache.insert(list(range(100, 100 + ps)), held[2 * ps : 3 * ps].clone())  # the tree owns page 3
    runs = {
        "padding": (0, 2 * ps),
        "free": (7 * ps, 3 * ps),
        "owned by a node": (ps, 3 * ps),
        "past the end": (40 + ps, 9 * ps),
    }
    if ps > 1:
        runs["not whole pages"] = (3 * ps + 1, ps)
    for name, (a0, k) in runs.items():
        run = torch.arange(a0, a0 + k, dtype=torch.int64)
        messages = set()
        for general in (False, True):
            with monkeypatch.context() as m:
                if general:
                    m.setattr(alloc.ops, "run_start", lambda a: -1)
                else:
                    assert alloc.ops.run_start(alloc.ops.view(run)) == a0
                owned, free = alloc.claims.owner_map().clone(), alloc.pages.free_cnt.clone()
                for use in ("check_claimable", "claim"):
                    with pytest.raises(ValueError) as err:
                        if use == "claim":
                            alloc.claim(run)
                        else:
                            alloc.check_claimable(run, commit=True)
                    messages.add(str(err.value))
                    assert torch.equal(alloc.claims.owner_map(), owned), name
                    assert torch.equal(alloc.pages.free_cnt, free), name
        assert len(messages) == 1, (name, messages)
    run = held[3 * ps : 6 * ps]
    with pytest.raises(ValueError, match="owned by a tree node"):
        alloc.check_free(held[2 * ps : 4 * ps])
    alloc.check_claimable(run)  # without commit: nothing claimed
    assert alloc.claimed_slots().tolist() == held[2 * ps : 3 * ps].tolist()
    alloc.claim(run)
    assert alloc.claimed_slots().tolist() == held[2 * ps : 6 * ps].tolist()
    with pytest.raises(ValueError, match="owned by a tree node"):
        alloc.free(run)
    alloc.disown(run)
    alloc.free(run)
    alloc.free(torch.cat((held[: 2 * ps], held[6 * ps : 8 * ps], held[9 * ps :])))
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("ps", [4, 3])
def test_whole_pages_out_of_order_are_refused_as_by_the_general_path(ps, monkeypatch):
    """Paged values that are whole pages but not one run are checked per page; every refusal reads
    as the per-slot path's for the same slots, and changes nothing."""
    cache = kvcore.create_cache("radix", size=48, page_size=ps, max_num_reqs=1, max_context_len=48)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(48)
    alloc.free(held[8 * ps : 9 * ps])  # page 9 free
    cache.insert(list(range(100, 100 + ps)), held[2 * ps : 3 * ps].clone())  # the tree owns page 3

    def pages(*ids: int) -> torch.Tensor:
        return torch.cat([torch.arange(i * ps, i * ps + ps) for i in ids])

    cases = {
        "padding": pages(5, 0),
        "free": pages(5, 9, 4),
        "owned by a node": pages(6, 3),
        "past the end": pages(5, 48 // ps + 1),
        "page named twice": pages(5, 4, 5),
        "a page out of order": torch.cat((pages(5), pages(4).flip(0))),
        "negative": pages(5, -1),
    }
    for name, slots in cases.items():
        messages = set()
        for general in (False, True):
            with monkeypatch.context() as m:
                if general:
                    m.setattr(alloc.claims, "_pages_claimable", lambda s, commit: False)
                owned, free = alloc.claims.owner_map().clone(), alloc.pages.free_cnt.clone()
                with pytest.raises(ValueError) as err:
                    alloc.check_claimable(slots, commit=True)
                messages.add(str(err.value))
                assert torch.equal(alloc.claims.owner_map(), owned), name
                assert torch.equal(alloc.pages.free_cnt, free), name
        assert len(messages) == 1, (name, messages)
    good = pages(6, 4, 10)
    alloc.check_claimable(good)  # without commit: nothing claimed
    assert alloc.claimed_slots().tolist() == pages(3).tolist()
    alloc.claim(good)
    assert alloc.claimed_slots().tolist() == pages(3, 4, 6, 10).tolist()
    alloc.disown(good)
    alloc.free(torch.cat((held[: 2 * ps], held[3 * ps : 8 * ps], held[9 * ps :])))  # page 3 stays the tree's
    InvariantChecker(cache).check([])

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

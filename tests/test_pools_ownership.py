"""Ownership claims hold on every allocator and pool kind: with ``strict`` (the default) a free
of slots a tree node owns is refused (it would be a use after free), changing nothing, on every
tree backend and every pool its tree claims in (token slots, mamba state slots)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore import Engine, InvariantChecker, Req, create_cache
from kvcore.pools import SWATokenToKVPoolAllocator, TokenToKVPoolAllocator

TREES = ["radix", "npu", "swa", "swa-pure", "mamba", "unified", "unified-mamba", "unified-swa"]


def _cache_with_a_cached_request(backend: str, ps: int) -> Any:
    kw: dict[str, Any] = {"size": 64 * ps, "page_size": ps, "max_num_reqs": 4, "max_context_len": 16 * ps}
    if "swa" in backend:
        kw["sliding_window_size"] = 2 * ps
    cache = create_cache(backend, **kw)
    engine = Engine(cache)
    req = Req("done", list(range(1, 4 * ps + 2)))
    assert engine.admit(req) and engine.extend(req)
    engine.decode([req], [7])
    engine.finish(req)
    return cache


def _snapshot(cache: Any) -> Any:
    return ([(v.name, v.available(), v.allocator.free_slots().tolist()) for v in cache.pools()],
            sorted((so.pool, so.owner, tuple(so.slots.tolist())) for so in cache.iter_owned_slots()))


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("backend", TREES)
def test_freeing_a_tree_nodes_slots_is_refused(backend: str, ps: int) -> None:
    cache = _cache_with_a_cached_request(backend, ps)
    if not cache.total_size():
        pytest.skip(f"{backend} at page {ps} keeps nothing of this request in its tree")
    tried = 0
    for view in cache.pools():
        alloc = view.allocator
        if not isinstance(alloc, TokenToKVPoolAllocator | SWATokenToKVPoolAllocator):
            continue
        claimed = alloc.claimed_slots()
        if not claimed.numel():
            continue  # a pool the tree does not claim in (the window side of SWA: claims are full-side)
        node = claimed[:ps] if view.page_size == ps else claimed[:1]
        before = _snapshot(cache)
        with pytest.raises(ValueError, match="owned by a tree node"):
            alloc.free(node)
        with pytest.raises(ValueError, match="owned by a tree node"):
            alloc.free(torch.cat((node, node + 10**6)))  # with an out-of-range id too: the claim is named
        assert _snapshot(cache) == before, view.name
        tried += 1
    assert tried, "the tree claimed no slots"
    InvariantChecker(cache).check([])

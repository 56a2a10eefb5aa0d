"""Allocator arguments are checked in one place (kvcore.pools.alloc_args): a batch call whose
``last_loc`` does not end the prefix, is out of range, or whose lengths do not line up is a
ValueError (TypeError for non-integers) and changes nothing, on every token allocator kind."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcore import InvariantChecker, create_cache

PS = 4
BACKENDS = ["radix", "npu", "swa"]  # the paged allocator, its NPU subclass, SWA's full + window pair


def _cache(backend: str) -> Any:
    kw: dict[str, Any] = {"size": 16 * PS, "page_size": PS, "max_num_reqs": 2, "max_context_len": 8 * PS}
    if backend == "swa":
        kw["sliding_window_size"] = 2 * PS
    return create_cache(backend, **kw)


def _state(cache: Any) -> list[Any]:
    out: list[Any] = [(v.name, v.available(), v.allocator.free_slots().tolist()) for v in cache.pools()]
    mapping = getattr(cache.token_to_kv_pool_allocator, "full_to_swa_index_mapping", None)
    if mapping is not None:
        out.append(mapping.tolist())
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_extend_last_loc_must_end_the_prefix(backend: str) -> None:
    cache = _cache(backend)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(2 * PS)  # a request's first 8 slots; a prefix of 3 tokens ends at held[2]
    size = 16 * PS
    bad = {
        "no last slot for a prefix inside a page": (-1, "padding or out of range"),
        "the padding page": (PS - 2, "padding or out of range"),
        "past the pool's end": (size + PS + 2, "padding or out of range"),
        "the wrong offset in its page": (int(held[3]), "does not end a prefix of 3 tokens"),
        "the last slot of a page": (int(held[PS + 3]), "does not end a prefix of 3 tokens"),
    }
    for name, (last, msg) in bad.items():
        before = _state(cache)
        with pytest.raises(ValueError, match=msg):
            alloc.alloc_extend([0, 3], [0, 3], [2, 7], [2, 7], [-1, last], 6)
        assert _state(cache) == before, name
    got = alloc.alloc_extend([0, 3], [0, 3], [2, 7], [2, 7], [-1, int(held[2])], 6)
    assert got is not None and got[2:3].tolist() == [int(held[3])]  # continues right after last_loc
    alloc.free(torch.cat((held, got.to(torch.int64))))
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_last_loc_must_be_the_previous_slot(backend: str) -> None:
    cache = _cache(backend)
    alloc = cache.token_to_kv_pool_allocator
    held = alloc.alloc(2 * PS)  # a request of 5 tokens: its new token (position 5) follows held[4]
    size = 16 * PS
    for last, msg in [(size + 2 * PS - 4, "padding or out of range"), (size + PS, "padding or out of range"),
                      (-1, "padding or out of range"), (int(held[5]), "offset 1 of its page")]:
        before = _state(cache)
        with pytest.raises(ValueError, match=msg):
            alloc.alloc_decode(torch.tensor([6]), [6], torch.tensor([last]))
        assert _state(cache) == before, last
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[0\]=0 must be >= 1"):
        alloc.alloc_decode([0], [0], [-1])
    got = alloc.alloc_decode(torch.tensor([6, 5]), [6, 5], torch.tensor([int(held[4]), -1]))
    assert got is not None and got[0].item() == int(held[5])
    alloc.free(torch.cat((held, got[1:].to(torch.int64))))  # got[0] is held[5]: a slot of the held page
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_lengths_must_line_up(backend: str) -> None:
    cache = _cache(backend)
    alloc = cache.token_to_kv_pool_allocator
    before = _state(cache)
    with pytest.raises(ValueError, match="last_loc has 2 entries for 1 requests"):
        alloc.alloc_extend([0], [0], [4], [4], [-1, -1], 4)
    with pytest.raises(ValueError, match="seq_lens has 2 entries for 1 requests"):
        alloc.alloc_extend([0], [0], [4, 4], [4], [-1], 4)
    with pytest.raises(ValueError, match="last_loc has 0 entries for 2 requests"):
        alloc.alloc_decode([1, 1], [1, 1], [])
    with pytest.raises(ValueError, match="2 prefix lengths but 1 sequence lengths"):
        alloc.alloc_extend([0, 0], [0, 0], [4], [4], [-1], 4)
    with pytest.raises(TypeError, match="seq_lens_cpu must hold integers"):
        alloc.alloc_extend([0], [0], [4], torch.tensor([4.0]), [-1], 4)
    with pytest.raises(TypeError, match="last_loc must hold integers"):
        alloc.alloc_decode([2], [2], torch.tensor([1.5]))
    assert _state(cache) == before
    InvariantChecker(cache).check([])


def test_num_new_pages_must_match_the_lengths() -> None:
    cache = _cache("radix")
    alloc = cache.token_to_kv_pool_allocator
    before = _state(cache)
    with pytest.raises(ValueError, match=r"num_new_pages=1 does not match the lengths \(2 new pages\)"):
        alloc.alloc_extend([0], [0], [5], [5], [-1], 5, 1)
    assert _state(cache) == before
    InvariantChecker(cache).check([])

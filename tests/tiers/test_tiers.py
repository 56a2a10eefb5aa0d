"""The host tier and the store under a tree backend: hits past the device, byte-identical pages, pools counted."""

from __future__ import annotations

import pytest
import torch

import kvcore
import kvcore.testing
from kvcore.testing import admit, finish, make_req, prefill
from kvcore.testing.stores import row_kv
from kvcore.testing.stores import serve_with_kv as serve

KV = {"num_layers": 2, "num_heads": 2, "head_dim": 8, "dtype": "float16"}


def build(backend="radix", **options):
    opts = dict(size=256, page_size=4, max_num_reqs=8, max_context_len=128, kv_buffer=KV)
    opts.update(options)
    return kvcore.create_cache(backend, **opts)


@pytest.mark.parametrize("backend", ["radix", "unified"])
def test_store_gives_a_second_engine_the_first_ones_pages_byte_identical(backend):
    url = f"memory://tiers-{backend}"
    kvcore.open_store(url).clear()
    a, b = build(backend, store=url), build(backend, store=url)
    tokens = list(range(100, 141))  # 10 whole pages of 4 and one token more
    req, hit, kv_a = serve(a, "a", tokens)
    assert hit == 0
    finish(a, req)
    assert a.flush() == 10
    kvcore.InvariantChecker(a).check()

    req_b = make_req("b", tokens)
    assert admit(b, req_b)
    assert len(req_b.prefix_indices) == 40  # everything but the last token, from the store
    assert torch.equal(row_kv(b, req_b, 40).view(torch.uint8), kv_a[:, :40].contiguous().view(torch.uint8))
    assert b.tier_stats()["store_hit_tokens"] == 40
    kvcore.InvariantChecker(b).check(owners=[req_b])
    assert prefill(b, req_b)
    finish(b, req_b)
    kvcore.InvariantChecker(b).check()


def test_host_tier_serves_what_the_device_evicted_and_is_a_counted_pool():
    cache = build(host_size=64)
    assert "host" in [p.name for p in cache.pools()]
    tokens = list(range(7, 7 + 33))
    req, _, kv = serve(cache, "r", tokens)
    finish(cache, req)
    assert cache.tier_stats()["host_cached_tokens"] == 32
    cache.evict(10_000)
    assert cache.evictable_size() == 0
    report = {r.pool: r for r in kvcore.InvariantChecker(cache).check()}
    assert report["host"].evictable == 32

    again = make_req("again", tokens)
    assert admit(cache, again)
    assert len(again.prefix_indices) == 32
    assert torch.equal(row_kv(cache, again, 32), kv[:, :32])
    assert cache.tier_stats()["host_hit_tokens"] == 32
    kvcore.InvariantChecker(cache).check(owners=[again])
    assert prefill(cache, again)
    finish(cache, again)
    kvcore.InvariantChecker(cache).check()


def test_host_tier_drops_least_recently_used_pages_when_full():
    cache = build(host_size=16)
    for i in range(3):
        req, _, _ = serve(cache, f"r{i}", list(range(1000 * i, 1000 * i + 17)), seed=i)
        finish(cache, req)
    assert cache.tier_stats()["host_cached_tokens"] == 16
    kvcore.InvariantChecker(cache).check()


def test_a_store_that_fails_is_a_miss_and_the_engine_recomputes(tmp_path):
    url = f"file://{tmp_path / 'gone'}"
    cache = build(store=url)
    (tmp_path / "gone").write_bytes(b"a file where the directory should be")
    req, _, _ = serve(cache, "r", list(range(21)))
    finish(cache, req)
    assert cache.flush() == 0
    other = build(store=url)
    again = make_req("again", list(range(21)))
    assert admit(other, again) and len(again.prefix_indices) == 0
    assert other.tier_stats()["store"]["errors"] >= 1
    kvcore.InvariantChecker(other).check(owners=[again])
    kvcore.InvariantChecker(cache).check()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"host_size": 10}, "host_size=10 is not a multiple of page_size=4"),
        ({"store": "gopher://x"}, "no store for scheme"),
        ({"store": "memory://", "kv_buffer": None}, "give kv_buffer"),
    ],
)
def test_bad_tier_options_are_refused(options, match):
    with pytest.raises(kvcore.ConfigError, match=match):
        build(**options)


def test_unified_refuses_tiers_with_window_components():
    with pytest.raises(kvcore.ConfigError, match="full"):
        build("unified", components=("full", "swa"), sliding_window_size=8, swa_size=256, host_size=16)


class TestTieredRadixConformance(kvcore.testing.PrefixCacheConformance):
    """The whole backend kit on radix with both tiers on (a private memory store: each cache its own)."""

    backend = "radix"
    backend_options = {"host_size": 256, "store": "memory://", "kv_buffer": KV}
    state_machine_examples = 8


class TestTieredUnifiedConformance(kvcore.testing.PrefixCacheConformance):
    backend = "unified"
    backend_options = {"host_size": 256, "store": "memory://", "kv_buffer": KV}
    state_machine_examples = 8

"""Host write policies (SGLang HiCache's): write_through, write_through_selective (after N hits), write_back."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
import kvcore.testing
from kvcore.testing import admit, finish, make_req, prefill
from kvcore.testing.stores import row_kv
from kvcore.testing.stores import serve_with_kv as serve

KV = {"num_layers": 2, "num_heads": 2, "head_dim": 8, "dtype": "float16"}
BACKENDS = ["radix", "unified"]


def build(backend="radix", **options):
    opts = dict(size=256, page_size=4, max_num_reqs=8, max_context_len=128, kv_buffer=KV)
    opts.update(options)
    return kvcore.create_cache(backend, **opts)


def host_tokens(cache) -> int:
    return cache.tier_stats()["host_cached_tokens"]


def reread(cache, tokens, kv, want):
    """Admit ``tokens`` again after the device forgot them; the ``want`` tokens it gets are ``kv``'s bytes."""
    req = make_req("again", tokens)
    assert admit(cache, req)
    assert len(req.prefix_indices) == want
    assert torch.equal(row_kv(cache, req, want).view(torch.uint8), kv[:, :want].contiguous().view(torch.uint8))
    kvcore.InvariantChecker(cache).check(owners=[req])
    assert prefill(cache, req)
    finish(cache, req)
    kvcore.InvariantChecker(cache).check()


def one_request(backend, policy):
    """A cache with a host tier under ``policy`` after one finished request of 8 whole pages, none written yet."""
    cache = build(backend, host_size=128, host_write_policy=policy)
    tokens = list(range(7, 7 + 33))
    req, _, kv = serve(cache, "r1", tokens)
    finish(cache, req)
    assert host_tokens(cache) == 0
    return cache, tokens, kv


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_writes_a_page_once_a_second_request_caches_it(backend):
    cache, tokens, kv = one_request(backend, "write_through_selective")  # one hit: below SGLang's threshold of 2
    second = make_req("r2", tokens)
    assert admit(cache, second) and prefill(cache, second)
    finish(cache, second)
    assert host_tokens(cache) == 32
    cache.evict(10_000)
    reread(cache, tokens, kv, 32)


def test_selective_threshold_is_an_option():
    cache = build(host_size=128, host_write_policy="write_through_selective", host_write_threshold=3)
    tokens = list(range(50, 50 + 17))
    for i in range(3):
        req = make_req(f"r{i}", tokens)
        assert admit(cache, req) and prefill(cache, req)
        finish(cache, req)
        assert host_tokens(cache) == (16 if i == 2 else 0)
    kvcore.InvariantChecker(cache).check()


def test_selective_counts_no_hit_for_a_chunked_prefill():
    cache = build(host_size=128, host_write_policy="write_through_selective")
    tokens = list(range(300, 300 + 25))
    req = make_req("chunked", tokens)
    assert admit(cache, req)
    assert prefill(cache, req, 12)  # a chunk: cache_unfinished_req(chunked=True)
    assert prefill(cache, req)
    finish(cache, req)
    assert host_tokens(cache) == 0  # the chunk did not count: one hit only
    kvcore.InvariantChecker(cache).check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_back_writes_nothing_until_the_device_evicts(backend):
    cache, tokens, kv = one_request(backend, "write_back")
    cache.evict(10_000)
    assert cache.evictable_size() == 0
    assert host_tokens(cache) == 32
    assert cache.tier_stats()["written_back_pages"] == 8
    kvcore.InvariantChecker(cache).check()
    reread(cache, tokens, kv, 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_back_to_a_store_only(backend):
    url = f"memory://write-back-{backend}"
    kvcore.open_store(url).clear()
    a = build(backend, store=url, host_write_policy="write_back")
    tokens = list(range(900, 900 + 21))
    req, _, kv = serve(a, "a", tokens)
    finish(a, req)
    assert a.flush() == 0
    a.evict(10_000)
    assert a.flush() == 5
    kvcore.InvariantChecker(a).check()
    b = build(backend, store=url)
    reread(b, tokens, kv, 20)
    assert b.tier_stats()["store_hit_tokens"] == 20


def prefix_kv(cache, tokens, start, end) -> torch.Tensor:
    """K/V of positions ``[start, end)`` as a function of each position's token prefix (as a model's is):
    ``(2 * layers, end - start, heads, dim)``."""
    pool = cache.kv_pool
    rows = []
    for j in range(start, end):
        gen = torch.Generator().manual_seed(hash(tuple(tokens[: j + 1])) & 0xFFFF_FFFF)
        rows.append(torch.randn((2 * pool.layer_num, pool.head_num, pool.head_dim), generator=gen))
    return torch.stack(rows, dim=1).to(pool.dtype)


def serve_model(cache, rid, tokens):
    """Admit and prefill ``tokens``, writing :func:`prefix_kv` for what was computed; (req, prefix_len)."""
    req = make_req(rid, tokens)
    assert admit(cache, req)
    hit = len(req.prefix_indices)
    assert prefill(cache, req)
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx][hit:len(tokens)].to(torch.int64)
    kv = prefix_kv(cache, tokens, hit, len(tokens))
    layers = cache.kv_pool.layer_num
    for i in range(layers):
        cache.kv_pool.set_kv_buffer(i, slots, kv[i], kv[layers + i])
    return req, hit


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_page_read_back_is_the_page_written_under_device_pressure(backend, policy):
    """A device of 64 slots under 40 prompts sharing prefixes: evictions happen inside admissions (make_room);
    every hit, from any tier, holds the bytes computed for those tokens."""
    cache = build(backend, size=64, host_size=96, store="memory://", host_write_policy=policy)
    rng = random.Random(7)
    stems = [[rng.randrange(2, 500) for _ in range(12)] for _ in range(4)]
    hits = 0
    for i in range(40):
        tokens = stems[rng.randrange(4)] + [rng.randrange(2, 500) for _ in range(rng.choice([1, 5, 9]))]
        req, hit = serve_model(cache, f"r{i}", tokens)
        hits += hit
        if hit:
            got = row_kv(cache, req, hit).view(torch.uint8)
            assert torch.equal(got, prefix_kv(cache, tokens, 0, hit).view(torch.uint8)), (i, hit)
        finish(cache, req)
        cache.flush()
        kvcore.InvariantChecker(cache).check()
    stats = cache.tier_stats()
    assert hits > 0 and stats["host_hit_tokens"] + stats["store_hit_tokens"] > 0, stats
    cache.evict(10_000)
    report = {r.pool: r for r in kvcore.InvariantChecker(cache).check()}
    assert report["full"].available == report["full"].total == 64  # 0 leaked device slots


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"host_write_policy": "write_later"}, "host_write_policy"),
        ({"host_write_policy": "write_back"}, "needs a tier to write to"),
        ({"host_size": 16, "host_write_threshold": 3}, "write_through_selective' only"),
        ({"host_size": 16, "host_write_policy": "write_through_selective", "host_write_threshold": 0},
         "host_write_threshold"),
    ],
)
def test_bad_write_policy_options_are_refused(options, match):
    with pytest.raises(kvcore.ConfigError, match=match):
        build(**options)


class TestWriteBackRadixConformance(kvcore.testing.PrefixCacheConformance):
    """The backend kit on radix with write-back to a host tier and a private store."""

    backend = "radix"
    backend_options = {"host_size": 256, "store": "memory://", "kv_buffer": KV, "host_write_policy": "write_back"}
    state_machine_examples = 8


class TestSelectiveUnifiedConformance(kvcore.testing.PrefixCacheConformance):
    backend = "unified"
    backend_options = {"host_size": 256, "store": "memory://", "kv_buffer": KV,
                       "host_write_policy": "write_through_selective"}
    state_machine_examples = 8

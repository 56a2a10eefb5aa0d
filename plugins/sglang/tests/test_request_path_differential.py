"""Differential through SGLang 0.5.19's own request path: SGLang's cache against the kvcore one from the registry.

Two worlds, each with its own SGLang pools (``ReqToTokenPool``, ``TokenToKVPoolAllocator``
or ``PagedTokenToKVPoolAllocator``) and SGLang ``Req`` objects: one runs SGLang's
``RadixCache`` (or ``ChunkCache``), the other the cache ``create_tree_cache`` builds for
``--radix-cache-backend kvcore-radix`` (``kvcore-chunk``).  Seeded random streams
(admit, chunked prefill, decode, finish, abort, retract, explicit eviction and eviction
under memory pressure) go through SGLang's own code in both: ``Req.init_next_round_input``
(the match), ``alloc_req_slots``, ``alloc_token_slots``, ``alloc_paged_token_slots_extend``,
``alloc_paged_token_slots_decode`` (which evict through ``evict_from_tree_cache``),
``maybe_cache_unfinished_req``, ``release_kv_cache`` and ``release_req`` (retraction).
After every step both worlds must agree on every answer (matched slots, lock and evict
results), every size, the exact free lists, every request record and row, the tree and
the KV events; SGLang's own pool check (``SchedulerInvariantChecker._check_pool_invariant``:
available + evictable + protected + session_held + uncached == total) must hold in both,
and kvcore's ``InvariantChecker`` in the kvcore world.

The driver (the worlds, the streams) is ``tools/sglang_request_path_shim.py``.  Stubbed
because they cannot run on a CPU-only machine (and nothing else): SGLang's paged allocation
kernels ``alloc_extend_kernel`` / ``alloc_decode_kernel`` (Triton; replaced by SGLang's own
CPU reference ``alloc_extend_naive`` and a loop doing what ``alloc_decode_kernel`` does),
``write_cache_indices`` (the driver writes the row with slice assignments, as that kernel
does) and the model forward (sampled tokens come from the seeded RNG).
"""

from __future__ import annotations

import pytest

from tools.sglang_request_path_shim import run_stream

pytestmark = pytest.mark.usefixtures("sglang_request_path")

SEEDS = range(4)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_kvcore_radix_matches_sglang_radix_cache(seed, page_size):
    counts = run_stream(seed, cache_kind="radix", kvcore_name="kvcore-radix", page_size=page_size, steps=250,
                        enable_kv_cache_events=seed % 2 == 0)
    # The stream really did each thing (else the comparison proves little).
    for what in ("admit", "chunk", "decode", "finish", "abort", "retract", "evict", "probe", "alloc_evict"):
        assert counts[what] > 0, counts


@pytest.mark.parametrize(("name", "page_size"), [("radix", 1), ("radix", 4), ("unified", 4)])
def test_salted_requests_match_sglang_with_its_salted_kv_events(name, page_size):
    """``cache_salt`` requests: never a prefix shared across salts, and SGLang's salted events
    (``BlockStoredWithMetadata``, namespace-aware block hashes) the same."""
    counts = run_stream(13, cache_kind=name, kvcore_name=f"kvcore-{name}", page_size=page_size, steps=250,
                        salts=True, enable_kv_cache_events=True)
    assert counts["admit"] > 0 and counts["evict"] > 0, counts


@pytest.mark.parametrize(("name", "page_size"), [("radix", 1), ("radix", 4), ("unified", 4)])
def test_strict_slot_checks_on_sglang_pools_change_nothing(monkeypatch, name, page_size):
    """KVCORE_SGLANG_STRICT=1: kvcore's slot claims over SGLang's allocator; a sound stream is unchanged."""
    monkeypatch.setenv("KVCORE_SGLANG_STRICT", "1")
    run_stream(2, cache_kind=name, kvcore_name=f"kvcore-{name}", page_size=page_size, steps=200)


@pytest.mark.parametrize("policy", ["lfu", "fifo", "priority"])
def test_kvcore_radix_matches_sglang_other_eviction_policies(policy):
    run_stream(7, cache_kind="radix", kvcore_name="kvcore-radix", page_size=1, steps=200, eviction_policy=policy)


@pytest.mark.parametrize("name", ["radix", "unified"])
def test_disabled_tree_matches_sglang(name):
    """``disable`` (SGLang's --disable-radix-cache with a registered backend): nothing is matched or kept.

    Whole prompts only: a disabled RadixCache (SGLang's and so kvcore's) keeps no prefix between
    chunks, since SGLang serves chunked prefill with --disable-radix-cache from a ChunkCache.
    """
    run_stream(5, cache_kind=name, kvcore_name=f"kvcore-{name}", page_size=4, steps=120, chunks=(1000,),
               disable=True)


def test_kvcore_radix_disable_finished_insert():
    run_stream(3, cache_kind="radix", kvcore_name="kvcore-radix", page_size=4, steps=150,
               disable_finished_insert=True)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_kvcore_unified_matches_sglang_unified_radix_cache(seed, page_size):
    counts = run_stream(seed, cache_kind="unified", kvcore_name="kvcore-unified", page_size=page_size, steps=250,
                        enable_kv_cache_events=seed % 2 == 0)
    for what in ("admit", "chunk", "decode", "finish", "retract", "evict", "alloc_evict"):
        assert counts[what] > 0, counts


@pytest.mark.parametrize("page_size", [1, 4])
def test_kvcore_chunk_matches_sglang_chunk_cache(page_size):
    run_stream(11, cache_kind="chunk", kvcore_name="kvcore-chunk", page_size=page_size, steps=200)


def test_a_declared_third_party_backend_runs_sglangs_request_path():
    """kvcore-example (declared by kvcore-example-backend, not by kvcore-sglang) under SGLang's request path.

    The example tree does not promise SGLang's free-list order (it frees an eviction's victims
    in one call), so it runs alone: SGLang's pool check and kvcore's invariant checker after
    every step, and SGLang's idle check at the end.
    """
    for seed in range(3):
        counts = run_stream(seed, cache_kind="radix", kvcore_name="kvcore-example", page_size=1 + 3 * (seed % 2),
                            steps=200, solo=True)
        assert counts["chunk"] and counts["finish"] and counts["alloc_evict"], counts

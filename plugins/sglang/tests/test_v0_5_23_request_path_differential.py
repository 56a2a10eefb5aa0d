"""kvcore-radix, kvcore-unified and kvcore-chunk on SGLang 0.5.23's own request path, against SGLang 0.5.23's caches.

Driver: ``tools/sglang023_request_path.py`` (what it stands in for is listed there: the model
forward and ``write_cache_indices``).  Every stream runs SGLang's ``RadixCache`` (kvcore-radix),
its ``UnifiedRadixCache`` with component full (kvcore-unified, on its Python tree core and on its
Rust one) or the ``UnifiedRadixCache`` SGLang builds for ``--disable-radix-cache`` (kvcore-chunk)
beside the cache SGLang's registry builds for the kvcore name, and compares after every step every
answer, free list, size, record, row, the tree (slots, locks, hit counts, priorities; on the Rust
core, which keeps no Python nodes, the KV-canary walk's rows), the DFS-weight order and the KV
events; SGLang's pool check holds in both, kvcore's InvariantChecker in kvcore's.
"""

from __future__ import annotations

import pytest
from kvcore_sglang.common.build import STRICT_ENV
from sglang.srt.runtime_context import get_context

from tools.sglang023_request_path import run_stream


@pytest.fixture(autouse=True)
def scheduler_context():
    # A scheduler process runs with its ServerArgs published; SGLang's request path reads them.
    with get_context().override_server_args():
        yield


def _ran(counts: dict, *ops: str) -> None:
    missing = [op for op in ops if not counts.get(op)]
    assert not missing, f"the stream never ran {missing}: {counts}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_radix_matches_sglang_radix_cache(seed: int, page_size: int) -> None:
    counts = run_stream(seed, name="kvcore-radix", page_size=page_size, steps=160)
    _ran(counts, "admit", "chunk", "decode", "finish", "probe")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_radix_events_and_salts(seed: int, page_size: int) -> None:
    counts = run_stream(seed, name="kvcore-radix", page_size=page_size, steps=140, salts=True,
                        enable_kv_cache_events=True)
    _ran(counts, "admit", "finish")


@pytest.mark.parametrize("policy", ["fifo", "mru", "filo", "priority", "lfu", "slru"])
def test_radix_eviction_policies(policy: str) -> None:
    # lfu and slru read hit counts, which SGLang 0.5.23 counts once per request and node.
    counts = run_stream(7, name="kvcore-radix", page_size=1, steps=160, size=80, eviction_policy=policy)
    _ran(counts, "admit", "finish")


def test_radix_under_pressure_evicts_and_retracts() -> None:
    counts = run_stream(3, name="kvcore-radix", page_size=4, steps=220, size=64, chunks=(4, 8))
    _ran(counts, "retract", "pressure")


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_strict_slot_checks(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    run_stream(11, name="kvcore-radix", page_size=page_size, steps=120)


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_disabled_matches_disabled_radix_cache(page_size: int) -> None:
    run_stream(5, name="kvcore-radix", page_size=page_size, steps=120, disable=True)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_unified_matches_sglang_unified_radix_cache(seed: int, page_size: int) -> None:
    # SGLang's UnifiedRadixCache with component full, on its Python tree core (pinned, not the env's default).
    counts = run_stream(seed, name="kvcore-unified", page_size=page_size, steps=160, tree_core="python")
    _ran(counts, "admit", "chunk", "decode", "finish", "probe", "evict")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(2))
def test_unified_matches_sglang_rust_tree_core(seed: int, page_size: int) -> None:
    counts = run_stream(seed, name="kvcore-unified", page_size=page_size, steps=160, tree_core="rust")
    _ran(counts, "admit", "chunk", "decode", "finish", "probe", "evict")


@pytest.mark.parametrize("tree_core", ["python", "rust"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_unified_events_and_salts(tree_core: str, page_size: int) -> None:
    counts = run_stream(0, name="kvcore-unified", page_size=page_size, steps=140, salts=True,
                        enable_kv_cache_events=True, tree_core=tree_core)
    _ran(counts, "admit", "finish", "evict")


@pytest.mark.parametrize("tree_core", ["python", "rust"])
def test_unified_under_pressure_evicts_and_retracts(tree_core: str) -> None:
    counts = run_stream(3, name="kvcore-unified", page_size=4, steps=220, size=64, chunks=(4, 8), tree_core=tree_core)
    _ran(counts, "retract", "pressure", "evict")


@pytest.mark.parametrize("page_size", [1, 4])
def test_unified_strict_slot_checks(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    run_stream(11, name="kvcore-unified", page_size=page_size, steps=120, tree_core="python")


@pytest.mark.parametrize("page_size", [1, 4])
def test_unified_disabled_matches_disabled_unified_radix_cache(page_size: int) -> None:
    run_stream(5, name="kvcore-unified", page_size=page_size, steps=120, disable=True, tree_core="python")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(2))
def test_chunk_matches_disable_radix_cache(seed: int, page_size: int) -> None:
    counts = run_stream(seed, name="kvcore-chunk", page_size=page_size, steps=140)
    _ran(counts, "admit", "chunk", "finish")

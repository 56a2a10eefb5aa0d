"""kvcore-unified and kvcore-swa (components full + swa) against SGLang 0.5.19's ``UnifiedRadixCache``.

On a hybrid sliding-window model SGLang's default tree is its ``UnifiedRadixCache`` with
components FULL and SWA (``registry._create_unified_radix_cache``); ``--radix-cache-backend
kvcore-unified`` builds kvcore's ``unified`` backend with components ("full", "swa") on the
same ``SWATokenToKVPoolAllocator``, and ``kvcore-swa`` its ``swa`` backend, the same tree.
Two worlds, each with SGLang's own pools (``ReqToTokenPool``, ``SWATokenToKVPoolAllocator``
over its ``SWAKVPool``), run one seeded stream (``tools/sglang_request_path_shim.py``): admit
(locking as ``PrefillAdder`` does),
chunked prefill (SGLang's unified ``cache_unfinished_req`` frees what left the window first,
``SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS``, on by default), decode with the
scheduler's window steps (``free_swa_out_of_window_slots`` in a free group,
``dec_swa_lock_only`` past the window), finish, abort, retract, explicit two-pool eviction and
eviction under memory pressure (``evict_for_alloc``).  After every step both must agree on
every answer, both free lists, the full-to-window map, the plain and the four pool sizes and
``total_size()``, every record (with ``swa_evicted_seqlen`` and the skipped-tombstone count of
its lock) and row, the tree (slots, both locks, tombstones) and the KV events; SGLang's pool
check must hold for both pools, and kvcore's ``InvariantChecker`` in the kvcore world.

The eviction answer compared is the full pool's gain and the count beside it.  SGLang's
legacy ``SWARadixCache`` fell short of the gain when its window phase deleted the tombstones a
deleted leaf uncovered; its ``UnifiedRadixCache`` keeps them, so the stream's short-count tally
(``sglang_undercounts``) must stay 0.

Stubbed (CPU only): the Triton allocation kernels, ``write_cache_indices`` and the
forward, as in ``test_request_path_differential.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from kvcore_sglang.v0_5_19 import KvcoreTreeCache

from tools.sglang_request_path_shim import SWAWorld, run_stream

pytestmark = pytest.mark.usefixtures("sglang_request_path")

# page_size, window, full pool, window pool
CONFIGS = [(1, 4, 112, 40), (1, 8, 112, 48), (4, 8, 160, 64), (4, 12, 192, 64)]


NAMES = ["kvcore-unified", "kvcore-swa"]


def stream(seed: int, page_size: int, window: int, size: int, swa_size: int, steps: int = 250,
           name: str = "kvcore-unified", **kw) -> Counter:
    return Counter(run_stream(seed, cache_kind="unified-swa", kvcore_name=name, page_size=page_size,
                              steps=steps, world=SWAWorld, size=size,
                              world_options=dict(swa_size=swa_size, window=window), chunks=(8, 16, 24),
                              finish_weight=0.7, **kw))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("page_size", "window", "size", "swa_size"), CONFIGS)
def test_kvcore_unified_swa_matches_sglang_unified_radix_cache(page_size, window, size, swa_size, name):
    total: Counter = Counter()
    for seed in range(4):
        total.update(stream(seed, page_size, window, size, swa_size, name=name, enable_kv_cache_events=seed % 2 == 0))
    assert total["sglang_undercounts"] == 0, total
    # The streams really did each thing (else the comparison proves little).
    for what in ("admit", "chunk", "decode", "finish", "abort", "retract", "evict", "alloc_evict", "window_free",
                 "window_lock"):
        assert total[what] > 0, total


@pytest.mark.parametrize("name", NAMES)
def test_kvcore_unified_swa_strict_slot_checks_change_nothing(monkeypatch, name):
    """KVCORE_SGLANG_STRICT=1: kvcore's unified tree claims its full slots in the view of SGLang's allocator."""
    monkeypatch.setenv("KVCORE_SGLANG_STRICT", "1")
    stream(1, 4, 8, 160, 64, steps=200, name=name)


@pytest.mark.parametrize("name", NAMES)
def test_kvcore_unified_swa_disabled_matches_sglang(name):
    """``disable``: a chunk cache, as SGLang's disabled UnifiedRadixCache calls itself; whole prompts."""
    run_stream(5, cache_kind="unified-swa", kvcore_name=name, page_size=4, steps=150, world=SWAWorld,
               size=160, world_options=dict(swa_size=160, window=8), chunks=(1000,), finish_weight=0.7, disable=True)


class FinishedInsertOff(SWAWorld):
    """The reference for ``disable_finished_insert``: what the option means (SGLang's RadixCache turns
    ``cache_finished_req`` into ``is_insert=False``), since SGLang 0.5.19's UnifiedRadixCache ignores it."""

    def finish(self, rid: str, is_insert: bool = True) -> None:
        super().finish(rid, is_insert and isinstance(self.cache, KvcoreTreeCache))


@pytest.mark.parametrize("name", NAMES)
def test_kvcore_unified_swa_disable_finished_insert(name):
    """``disable_finished_insert`` honoured: finished requests are released without inserting.

    A deliberate difference from SGLang 0.5.19's UnifiedRadixCache, which inserts anyway;
    the SGLang world is therefore given ``is_insert=False`` at every finish.
    """
    run_stream(3, cache_kind="unified-swa", kvcore_name=name, page_size=4, steps=150,
               world=FinishedInsertOff, size=160, world_options=dict(swa_size=64, window=8), chunks=(8, 16, 24),
               finish_weight=0.7, disable_finished_insert=True)

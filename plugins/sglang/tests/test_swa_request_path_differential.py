"""kvcore-swa against SGLang 0.5.19's ``SWARadixCache``, through SGLang's own request path.

Two worlds, each with SGLang's own pools (``ReqToTokenPool``, ``SWATokenToKVPoolAllocator``
over its ``SWAKVPool`` with one full and one window layer), run one seeded stream
(``tools/sglang_request_path_shim.py``): admit (locking as ``PrefillAdder`` does, keeping
``swa_uuid_for_lock``), chunked prefill, decode with the scheduler's window steps
(``free_swa_out_of_window_slots`` in a free group, ``dec_swa_lock_only`` past the window),
finish, abort, retract, explicit two-pool eviction and eviction under memory pressure.
After every step both must agree on every answer, both free lists, the full-to-window
map, the four sizes and ``total_size()``, every record (with ``swa_evicted_seqlen``) and
row, the tree (slots, both locks, tombstones) and the KV events; SGLang's pool check must
hold for both pools, and kvcore's ``InvariantChecker`` in the kvcore world.

No difference is allowed.  The eviction answer is compared as SGLang answers it, beside the
full pool's gain: SGLang's window-phase eviction frees the tombstone leaves it uncovers
without counting them in ``num_tokens_evicted``, and kvcore-swa answers SGLang the same
(kvcore's own ``evict`` reports the gain: ``test_insert_differential.py``).

Stubbed (CPU only): the Triton allocation kernels, ``write_cache_indices`` and the
forward, as in ``test_request_path_differential.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tools.sglang_request_path_shim import SWAWorld, run_stream

pytestmark = pytest.mark.usefixtures("sglang_request_path")

# page_size, window, full pool, window pool
CONFIGS = [(1, 4, 112, 40), (1, 8, 112, 48), (4, 8, 160, 64), (4, 12, 192, 64)]


@pytest.mark.parametrize(("page_size", "window", "size", "swa_size"), CONFIGS)
def test_kvcore_swa_matches_sglang_swa_radix_cache(page_size, window, size, swa_size):
    total: Counter = Counter()
    for seed in range(4):
        # Chunks smaller than the window pool (a prompt longer than it still runs, chunk by chunk).
        total.update(run_stream(seed, cache_kind="swa", kvcore_name="kvcore-swa", page_size=page_size, steps=250,
                                world=SWAWorld, size=size, world_options=dict(swa_size=swa_size, window=window),
                                chunks=(8, 16, 24), finish_weight=0.7, enable_kv_cache_events=seed % 2 == 0))
    # The streams really did each thing (else the comparison proves little).
    for what in ("admit", "chunk", "decode", "finish", "abort", "retract", "evict", "alloc_evict", "window_free",
                 "window_lock"):
        assert total[what] > 0, total


def test_kvcore_swa_strict_slot_checks_change_nothing(monkeypatch):
    """KVCORE_SGLANG_STRICT=1: kvcore-swa claims its full slots in the view of SGLang's allocator."""
    monkeypatch.setenv("KVCORE_SGLANG_STRICT", "1")
    run_stream(1, cache_kind="swa", kvcore_name="kvcore-swa", page_size=4, steps=200, world=SWAWorld, size=160,
               world_options=dict(swa_size=64, window=8), chunks=(8, 16, 24), finish_weight=0.7)


def test_kvcore_swa_disabled_matches_sglang():
    """``disable``: nothing matched or kept; whole prompts (a disabled tree keeps no prefix between chunks)."""
    run_stream(5, cache_kind="swa", kvcore_name="kvcore-swa", page_size=4, steps=150, world=SWAWorld, size=160,
               world_options=dict(swa_size=160, window=8), chunks=(1000,), finish_weight=0.7, disable=True)


"""kvcore-mamba and kvcore-unified (components full + mamba) against SGLang 0.5.19's ``UnifiedRadixCache``.

On a hybrid SSM model SGLang's default tree is its ``UnifiedRadixCache`` with components FULL
and MAMBA (``registry._create_unified_radix_cache``); ``kvcore-mamba`` is kvcore's one tree with
components ("full", "mamba"), the same tree ``kvcore-unified`` builds there, so every case runs
under both names.  (SGLang's legacy ``MambaRadixCache`` answers otherwise in places:
kvcore-mamba's README lists where.)

Two worlds, each with SGLang's own pools (``HybridReqToTokenPool`` over a ``MambaPool`` of
two small layers and its ``MambaSlotAllocator``, a ``TokenToKVPoolAllocator``), run one
seeded stream (``tools/sglang_request_path_shim.py``, :class:`MambaWorld`): admit with the
copy-on-write match (``Req.init_next_round_input``: a state slot and ``mamba_cow_src_index``),
a waiting request matched again while it keeps its slot, chunked prefill (each chunk's state
snapshot copied into the tree), decode, finish, abort (before and after the first chunk),
retract, explicit two-pool eviction and eviction under memory pressure (``alloc_req_slots``
evicting states, ``_alloc_mamba_slot``).  The forward runs SGLang's own
``_collect_deferred_mamba_cow_and_clear`` and the copies and clears it asks for, then writes
each request's state from its tokens.  After every step both must agree on every answer
(matched slots, ``mamba_branching_seqlen``, evict counts, what a released request's record still
holds: SGLang leaves the state slot it gave its tree there), both free lists, the four sizes and
``total_size()``, the state tensors of every slot, every record (row, lengths, state slot,
copy-on-write source, clear mark), the tree (slots, both locks, states) and the KV events;
SGLang's pool checks (full and mamba) and the tree's sanity check must hold in both worlds,
and kvcore's ``InvariantChecker`` in the kvcore world.

Both Mamba strategies: no-buffer (page size 1) and extra-buffer (two ping-pong tracking slots
per request; page size 4, and 1).  Stubbed (CPU only): ``write_cache_indices`` and the model
forward, as in ``test_request_path_differential.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from sglang.srt.runtime_context import get_context

from tools.sglang_request_path_shim import MambaWorld, run_stream

pytestmark = pytest.mark.usefixtures("sglang_request_path")

# kvcore's names for the one tree with components (full, mamba) on a hybrid SSM model.
NAMES = pytest.mark.parametrize("kvcore_name", ["kvcore-unified", "kvcore-mamba"], ids=["unified", "mamba"])

# full pool, state slots, mamba_cache_chunk_size
CONFIGS = [(160, 40, 8), (128, 32, 4), (160, 24, 16)]


@NAMES
@pytest.mark.parametrize(("size", "mamba_size", "chunk_size"), CONFIGS)
def test_matches_sglang_unified_radix_cache(kvcore_name, size, mamba_size, chunk_size):
    total: Counter = Counter()
    for seed in range(4):
        total.update(run_stream(seed, cache_kind="unified-mamba", kvcore_name=kvcore_name, page_size=1, steps=250,
                                world=MambaWorld, size=size,
                                world_options=dict(mamba_size=mamba_size, chunk_size=chunk_size),
                                chunks=(4, 8, 16, 1000), enable_kv_cache_events=seed % 2 == 0))
    # The streams really did each thing (else the comparison proves little).
    for what in ("admit", "chunk", "decode", "finish", "abort", "retract", "evict", "alloc_evict", "match_waiting"):
        assert total[what] > 0, total


# page size, full pool, state slots, mamba_cache_chunk_size, track interval (decode snapshots)
EXTRA_BUFFER_CONFIGS = [(4, 160, 40, 8, 16), (4, 192, 48, 16, 32), (1, 112, 40, 4, 8)]


@NAMES
@pytest.mark.parametrize(("page_size", "size", "mamba_size", "chunk_size", "interval"), EXTRA_BUFFER_CONFIGS)
def test_extra_buffer_matches_sglang(kvcore_name, page_size, size, mamba_size, chunk_size, interval):
    """SGLang's extra-buffer strategy: two ping-pong tracking slots per request, snapshots the scheduler decides.

    SGLang's own ``_mamba_radix_cache_v2_req_prepare_for_extend`` tracks each prefill extend and
    the decode steps reaching ``mamba_track_grid`` track there (the shim's ``track_slot``); the
    kernel's write of the snapshot is the forward's copy into the tracked slot.  kvcore reads the
    tracking fields SGLang's scheduler wrote (it replays nothing) and donates the tracked slot
    through SGLang's ``set_mamba_ping_pong_slot``.
    """
    total: Counter = Counter()
    with get_context().override_server_args(mamba_track_interval=interval):
        for seed in range(3):
            total.update(run_stream(seed, cache_kind="unified-mamba", kvcore_name=kvcore_name, page_size=page_size,
                                    steps=250, world=MambaWorld, size=size, finish_weight=1,
                                    world_options=dict(mamba_size=mamba_size, chunk_size=chunk_size,
                                                       extra_buffer=True),
                                    chunks=(8, 16, 1000), enable_kv_cache_events=seed % 2 == 1))
    for what in ("admit", "chunk", "decode", "finish", "abort", "retract", "evict", "match_waiting"):
        assert total[what] > 0, total


@NAMES
def test_strict_slot_checks_change_nothing(kvcore_name, monkeypatch):
    """KVCORE_SGLANG_STRICT=1: kvcore claims its full slots and state slots in the views of SGLang's pools."""
    monkeypatch.setenv("KVCORE_SGLANG_STRICT", "1")
    run_stream(2, cache_kind="unified-mamba", kvcore_name=kvcore_name, page_size=1, steps=200, world=MambaWorld,
               size=112, world_options=dict(mamba_size=24, chunk_size=4), chunks=(4, 8, 1000))


@NAMES
def test_disabled_matches_sglang(kvcore_name):
    """``disable``: nothing matched or kept, every state slot given back with its request."""
    run_stream(3, cache_kind="unified-mamba", kvcore_name=kvcore_name, page_size=1, steps=150, world=MambaWorld,
               size=160, world_options=dict(mamba_size=24, chunk_size=4), chunks=(1000,), disable=True)

"""``unified`` with a mamba component: requests at page size > 1 (SGLang's extra-buffer mode) and
retraction offload of the request's state, driven through kvcore.Engine with the checker after every step.

``mamba`` is the same tree with the same components (full, mamba): each scenario runs under both names.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import Req
from kvcore.engine import Engine

KV = dict(num_layers=2, num_heads=1, head_dim=2, dtype="float32")


BACKENDS = ["unified-mamba", "mamba"]


def _build(page: int, backend: str = "unified-mamba", **extra):
    opts: dict = dict(size=96 * page, page_size=page, max_num_reqs=6, max_context_len=64 * page,
                      mamba_cache_chunk_size=2 * page, kv_buffer=KV)
    opts.update(extra)
    return kvcore.create_cache(backend, **opts)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_counts(cache) -> list:
    return [(v.name, v.available()) for v in cache.pools()]


def run_to_decode(eng: Engine, req: Req, steps: int, live: tuple = ()) -> None:
    owners = [*live, req]
    assert eng.admit(req)
    eng.check(owners)
    assert eng.extend(req)
    eng.check(owners)
    for i in range(steps):
        assert eng.decode([req], [900 + i]) == 1
        eng.check(owners)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [1, 4], ids=lambda p: f"page{p}")
def test_offload_retract_keeps_and_restores_the_state(page, backend):
    cache = _build(page, backend)
    eng = Engine(cache)
    total = free_counts(cache)
    other = Req("o", toks(500, 2 * page + 3))
    run_to_decode(eng, other, 2)
    r = Req("r", toks(0, 3 * page + 1))
    run_to_decode(eng, r, page + 2, (other,))
    held = cache.request_state_slots(r.kv)
    assert held == (3 if page > 1 else 1)  # its own slot, plus two ping-pong slots with pages
    comp = r.kv.components["mamba"]
    mp = cache.mamba_pool.mamba_cache
    idx = comp.mamba_pool_idx.reshape(1).to(torch.int64)
    mp.temporal[:, idx] = 3.5
    mp.conv[0][:, idx] = -2.0
    backup = eng.retract(r, mode="offload")
    eng.check([other])
    assert backup is not None and backup.state is not None
    assert float(backup.state["mamba"]["temporal"].flatten()[0]) == 3.5
    assert backup.nbytes >= cache.mamba_pool.slot_bytes
    assert cache.request_state_slots(r.kv) == 0  # the retraction gave every state slot back
    # Another request takes slots (reusing r's state slot) while r waits.
    third = Req("t", toks(700, 2 * page))
    run_to_decode(eng, third, 1, (other,))
    assert eng.resume(r)
    eng.check([other, third, r])
    assert r.kv.retraction_backup is None and cache.request_state_slots(r.kv) == held
    idx = r.kv.components["mamba"].mamba_pool_idx.reshape(1).to(torch.int64)
    assert torch.all(mp.temporal[:, idx] == 3.5) and torch.all(mp.conv[0][:, idx] == -2.0)
    for _ in range(page + 1):
        assert eng.decode([r, other, third]) == 3
        eng.check([r, other, third])
    for q in (r, other, third):
        eng.finish(q)
        eng.check([x for x in (r, other, third) if x.kv.is_held])
    cache.reset()
    assert free_counts(cache) == total


@pytest.mark.parametrize("backend", BACKENDS)
def test_restore_without_a_state_slot_is_refused(backend):
    cache = _build(1, backend)
    r = Req("r", toks(0, 5))
    backup_like = {"mamba": {"conv": [torch.zeros(2, 1, 6, 3)], "temporal": torch.zeros(2, 1, 2, 4, 4)}}
    before = free_counts(cache)
    with pytest.raises(ValueError, match="holds no state slot"):
        cache.restore_request_state(r, backup_like)
    assert free_counts(cache) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_backup_of_a_request_without_state_is_none(backend):
    cache = _build(4, backend)
    assert cache.backup_request_state(Req("r", toks(0, 5))) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_not_a_multiple_of_the_page_is_refused(backend):
    with pytest.raises(ValueError, match="mamba_cache_chunk_size=6 must be a multiple of page_size=4"):
        kvcore.create_cache(backend, size=256, page_size=4, mamba_cache_chunk_size=6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_tokens", [None, 8], ids=["whole", "chunked"])
def test_paged_requests_cache_tracked_snapshots_only(chunk_tokens, backend):
    """Page 4: shared-prefix requests reuse the tracked snapshots; every slot comes back at the end."""
    page = 4
    cache = _build(page, backend, mamba_track_interval=8)
    eng = Engine(cache)
    total = free_counts(cache)
    stem = toks(0, 6 * page)
    reqs = [Req(f"r{i}", stem + toks(100 * (i + 1), page + i)) for i in range(4)]
    done: list[Req] = []
    for q in reqs:
        assert eng.admit(q)
        eng.check([q])
        while q.kv.kv_committed_len < len(q.origin_input_ids):
            n = len(q.origin_input_ids)
            assert eng.extend(q, min(n, q.kv.kv_committed_len + chunk_tokens) if chunk_tokens else None)
            eng.check([q])
        for i in range(9):
            assert eng.decode([q], [i]) == 1
            eng.check([q])
        eng.finish(q)
        eng.check()
        done.append(q)
    # The later requests matched the stem from a tracked snapshot (a multiple of the chunk).
    m = cache.match_prefix(kvcore.RadixKey(stem + [7]))
    assert m.device_indices.numel() > 0 and m.device_indices.numel() % (2 * page) == 0
    st = cache.stats()
    assert st["cow_copies"] >= 1 and st["state_snapshots"] >= 4, st
    cache.evict(10**6, mamba_num=10**6)
    eng.check()
    cache.reset()
    assert free_counts(cache) == total

"""HiSparse's device paths: staging on a side stream with events, swap-in checked against ``naive_load_topk``.

On CUDA (``cuda`` cases, marked ``cuda``: ``benchmarks/device_check.sh`` runs them) the staging
copy runs on the coordinator's side stream behind a CUDA event, the host pool is pinned and the
host-to-device copies are asynchronous; on the CPU the same calls run synchronously (no events).
Both run the same comparison: each staged token's host copy is the K/V written on the device,
and every swap-in's device bytes equal those of ``naive_load_topk`` on a twin cache and the host
copy of the selected tokens, layer by layer, for several decode steps of a batch.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore import Engine, Req

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs CUDA")]),
]
LAYERS, HEADS, DIM = 3, 4, 32  # large enough that a staging copy is not over before the host looks at it
DBS, TOP_K = 64, 24


def build(device: str, page_size: int):
    return kvcore.create_cache(
        "hisparse", size=2048, page_size=page_size, max_num_reqs=4, max_context_len=640, device=device,
        device_buffer_size=DBS, top_k=TOP_K, host_to_device_ratio=2,
        kv_buffer={"num_layers": LAYERS, "num_heads": HEADS, "head_dim": DIM, "dtype": "float16"},
    )


def kv_of(rid: int, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """K of token ``pos`` of request ``rid`` in ``layer``: distinct per element and exact in float16 (V is -K)."""
    base = (rid * 509 + pos.to(torch.float32) * 3 + layer * 1511) % 2039
    k = base.reshape(-1, 1, 1) + torch.arange(HEADS * DIM, dtype=torch.float32).reshape(1, HEADS, DIM) % 7 / 8
    return k.to(torch.float16)


def write(cache, rid: int, req: Req, positions: torch.Tensor) -> None:
    table = cache.req_to_token_pool.req_to_token
    slots = table[req.kv.req_pool_idx, positions.to(table.device)].to(torch.int64)
    dev = cache.kv_pool.k_buffer[0].device
    for layer in range(LAYERS):
        k = kv_of(rid, positions, layer).to(dev)
        cache.kv_pool.set_kv_buffer(layer, slots, k, -k)


class Writer:
    """Engine ``kv_writer`` for prefill: the batch is the newest ``len(slots)`` positions of ``req``."""

    def __init__(self, cache):
        self.cache, self.req, self.rid = cache, None, 0

    def __call__(self, slots):
        kv = self.req.kv
        write(self.cache, self.rid, self.req, torch.arange(kv.kv_allocated_len - slots.numel(), kv.kv_allocated_len))


def device_k(cache, layer: int, locs: torch.Tensor) -> torch.Tensor:
    buf = cache.kv_pool.k_buffer[layer]
    return buf[locs.to(device=buf.device, dtype=torch.int64)].cpu()


def device_v(cache, layer: int, locs: torch.Tensor) -> torch.Tensor:
    buf = cache.kv_pool.v_buffer[layer]
    return buf[locs.to(device=buf.device, dtype=torch.int64)].cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 8])
def test_side_stream_staging_and_swap_in_match_naive_load_topk(device, page_size):
    rng = random.Random(7 + page_size)
    caches = [build(device, page_size), build(device, page_size)]  # swap-in, and its naive twin
    prompts = [list(range(1, 401)), list(range(1, 41)), list(range(1, 601))]  # long, short (< DBS), long
    reqs = [[Req(f"r{i}", p) for i, p in enumerate(prompts)] for _ in caches]
    engines = []
    for cache, rs in zip(caches, reqs):
        coord = cache.coordinator
        assert (coord.write_staging_stream is not None) == (device == "cuda")
        assert cache.host_pool.k_buffer[0].is_pinned() == (device == "cuda")
        writer = Writer(cache)
        eng = Engine(cache, kv_writer=writer)
        for i, r in enumerate(rs):
            writer.req, writer.rid = r, i
            assert eng.admit(r) and eng.extend(r)  # the prompt's completion admits it into staging
        acts = list(coord.ack_staging_queue)
        assert [a.req for a in acts] == rs
        assert all((a.finish_event is not None) == (device == "cuda") for a in acts)
        # Collect without waiting, as SGLang's scheduler polls: each request once its event fired.
        ready: list[Req] = []
        for _ in range(1_000_000):
            ready += coord.collect_ready_reqs()
            if not coord.has_ongoing_staging():
                break
        assert ready == rs
        # The host copy is what was written on the device: the side stream's copy finished before collection.
        for i, r in enumerate(rs):
            state = coord.state_of(r.kv)
            assert state.ready and not state.staging
            pos = torch.arange(len(prompts[i]))
            for layer in range(LAYERS):
                host = state.host_locs[pos]
                assert torch.equal(cache.host_pool.k_buffer[layer][host], kv_of(i, pos, layer)), (i, layer)
                assert torch.equal(cache.host_pool.v_buffer[layer][host], -kv_of(i, pos, layer)), (i, layer)
        kvcore.InvariantChecker(cache).check(rs)
        engines.append(eng)

    prev: list[list[int]] = [[] for _ in prompts]
    for step in range(12):
        lens = [r.kv.kv_allocated_len + 1 for r in reqs[0]]
        rows_sel = []
        for i, n in enumerate(lens):
            keep = [t for t in prev[i] if t < n][: TOP_K // 2] if step % 3 else []  # some hits, some misses
            fresh = rng.sample([t for t in range(n - 1) if t not in set(keep)], min(TOP_K, n - 1) - len(keep))
            picks = (keep + fresh)[: TOP_K - 1] + [n - 1]  # and the newest token, from the reserved slot
            prev[i] = picks
            rows_sel.append(picks + [-1] * (TOP_K - len(picks)))
        sel = torch.tensor(rows_sel, dtype=torch.int64)
        results = []
        for cache, eng, rs in zip(caches, engines, reqs):
            writer, eng.kv_writer = eng.kv_writer, None
            assert eng.decode(rs, [5] * len(rs)) == len(rs)  # the new token's K/V is written after its mapping
            eng.kv_writer = writer
            coord = cache.coordinator
            rows = torch.tensor([r.kv.req_pool_idx for r in rs])
            lens_t = torch.tensor(lens)
            table = cache.req_to_token_pool.req_to_token
            out_loc = table[rows.to(table.device), (lens_t - 1).to(table.device)].to(torch.int64)
            coord.map_last_loc_to_buffer(rs, lens, out_loc)
            for i, r in enumerate(rs):
                write(cache, i, r, torch.tensor([lens[i] - 1]))
            load = coord.swap_in_selected_pages if cache is caches[0] else coord.naive_load_topk
            locs = [load(rows, lens_t, sel, layer) for layer in range(LAYERS)]
            assert all(t.device.type == device and t.dtype == torch.int32 for t in locs)
            results.append(locs)
            kvcore.InvariantChecker(cache).check(rs)
        for layer in range(LAYERS):
            for i in range(len(prompts)):
                valid = sel[i] >= 0
                pos = sel[i][valid]
                got_k = device_k(caches[0], layer, results[0][layer][i][valid])
                assert torch.equal(got_k, kv_of(i, pos, layer)), f"step {step} layer {layer} request {i}"
                assert torch.equal(device_v(caches[0], layer, results[0][layer][i][valid]), -kv_of(i, pos, layer))
                assert torch.equal(got_k, device_k(caches[1], layer, results[1][layer][i][valid]))
                assert bool((results[0][layer][i][~valid] == -1).all())
    stats = caches[0].coordinator.stats()
    assert stats["buffer_hits"] > 0 and stats["buffer_misses"] > 0 and stats["bytes_h2d"] > 0
    for cache, eng, rs in zip(caches, engines, reqs):
        for r in rs:
            eng.finish(r)
        kvcore.InvariantChecker(cache).check([])
        assert all(v.available() == v.capacity for v in cache.pools())

"""HiSparse scenarios on real bytes: staging, direct admission, swap-in hits and misses (checked against
the host copy and against ``naive_load_topk`` on a twin cache), retraction, finish, bad input."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore import Engine, Req
from kvcore.factory import ConfigError
from kvcore.fuzz import run_fuzz

NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
DBS, TOP_K, LAYERS = 32, 12, 2


def build(device="cpu", page_size=1, size=512, dbs=DBS, top_k=TOP_K, ratio=2, rows=6, width=256):
    return kvcore.create_cache(
        "hisparse", size=size, page_size=page_size, max_num_reqs=rows, max_context_len=width, device=device,
        device_buffer_size=dbs, top_k=top_k, host_to_device_ratio=ratio,
        kv_buffer={"num_layers": LAYERS, "num_heads": 1, "head_dim": 4, "dtype": "float32"},
    )


def check(cache, owners=()):
    return kvcore.InvariantChecker(cache).check(list(owners))


def expected(rid: int, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """The K value every test writes for token ``pos`` of request ``rid`` in ``layer`` (V is its negative)."""
    base = (rid * 10_000 + pos.to(torch.float32) * 4 + layer * 1_000_000).reshape(-1, 1, 1)
    return base + torch.arange(4, dtype=torch.float32).reshape(1, 1, 4)


def write(cache, rid: int, req: Req, positions: torch.Tensor) -> None:
    """Write K/V of ``positions`` of ``req`` at their logical slots (the pool maps them to device slots)."""
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, positions.to(cache.req_to_token_pool.device)]
    for layer in range(LAYERS):
        k = expected(rid, positions, layer)
        cache.kv_pool.set_kv_buffer(layer, slots.to(torch.int64), k, -k)


class Writer:
    """Engine ``kv_writer`` for prefill chunks: positions are the record's newest ``len(slots)``."""

    def __init__(self, cache):
        self.cache, self.req, self.rid = cache, None, 0

    def __call__(self, slots):
        kv = self.req.kv
        pos = torch.arange(kv.kv_allocated_len - slots.numel(), kv.kv_allocated_len)
        write(self.cache, self.rid, self.req, pos)


def prefill(cache, eng: Engine, writer: Writer, req: Req, rid: int, chunk: int | None = None) -> None:
    writer.req, writer.rid = req, rid
    assert eng.admit(req)
    total = len(req.fill_ids)
    while req.kv.kv_committed_len < total:
        end = total if chunk is None else req.kv.kv_committed_len + chunk
        assert eng.extend(req, end)


def decode_alloc(eng: Engine, reqs: list[Req]) -> None:
    """Engine.decode without the writer: the new token's K/V is written after its mapping (as a forward pass does)."""
    writer, eng.kv_writer = eng.kv_writer, None
    try:
        assert eng.decode(reqs, [3] * len(reqs)) == len(reqs)
    finally:
        eng.kv_writer = writer


def selection(rng: random.Random, seq_lens: list[int], k: int, prev: list[list[int]] | None, reuse: float):
    """Per request: ``reuse`` of last step's picks that are still valid, the rest fresh; -1 padded."""
    rows = []
    for i, n in enumerate(seq_lens):
        want = min(k, n)
        picks: list[int] = []
        if prev is not None:
            old = [t for t in prev[i] if t < n]
            rng.shuffle(old)
            picks = old[: int(reuse * want)]
        pool = [t for t in range(n) if t not in set(picks)]
        picks += rng.sample(pool, want - len(picks))
        if rng.random() < 0.5 and n - 1 not in picks:
            picks[-1] = n - 1  # the newest token, served from the reserved slot
        rows.append(picks + [-1] * (k - len(picks)))
    return torch.tensor(rows, dtype=torch.int64)


def device_values(cache, layer: int, locs: torch.Tensor) -> torch.Tensor:
    return cache.kv_pool.k_buffer[layer][locs.to(torch.int64).to(cache.kv_pool.k_buffer[layer].device)].cpu()


def oracle_step(cache, reqs: list[Req], sel: torch.Tensor) -> list[torch.Tensor]:
    """The same decode step through the coordinator's public API with ``naive_load_topk``."""
    coord = cache.coordinator
    coord.collect_ready_reqs(wait=True)
    lens = [r.kv.kv_allocated_len for r in reqs]
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs])
    r2t = cache.req_to_token_pool.req_to_token
    out_loc = r2t[rows.to(r2t.device), torch.tensor(lens).to(r2t.device) - 1].to(torch.int64)
    coord.map_last_loc_to_buffer(reqs, lens, out_loc)
    return [coord.naive_load_topk(rows, torch.tensor(lens), sel, layer) for layer in range(LAYERS)]


def snapshot(cache):
    alloc = cache.token_to_kv_pool_allocator
    return (
        [(v.name, v.available()) for v in cache.pools()],
        alloc.full_to_hisparse_device_index_mapping.clone(),
        [(s.rid, s.staging, s.device_buffer_size_now, s.device_buffer.clone(), s.buffer_tokens.clone(),
          s.lru_slots.clone(), s.host_allocated_len) for s in cache.coordinator.states()],
        cache.coordinator.stats(),
    )


def same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[3] == b[3] and len(a[2]) == len(b[2]) and all(
        x[:3] == y[:3] and all(torch.equal(p, q) for p, q in zip(x[3:6], y[3:6])) and x[6] == y[6]
        for x, y in zip(a[2], b[2])
    )


# ------------------------------------------------------------------------------------------ bytes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_every_step_the_buffer_holds_the_host_copy_of_the_selection(device, page_size):
    rng = random.Random(page_size)
    caches = [build(device, page_size), build(device, page_size)]  # swap-in, and its naive twin
    engines = [Engine(c, kv_writer=Writer(c)) for c in caches]
    prompts = [list(range(1, 21)), list(range(1, 71)), list(range(1, 101))]  # short (< DBS) and long
    reqs = [[Req(f"r{i}", p) for i, p in enumerate(prompts)] for _ in caches]
    for c, e, rs in zip(caches, engines, reqs):
        for i, r in enumerate(rs):
            prefill(c, e, e.kv_writer, r, i, chunk=24)
            # Staged at the end of the prefill: the host copy is exact.
            state = c.coordinator.state_of(r.kv)
            assert state is not None and state.staging
            host = c.host_pool.k_buffer[0][state.host_locs[: len(prompts[i])]]
            assert torch.equal(host, expected(i, torch.arange(len(prompts[i])), 0))
        check(c, rs)
    prev = None
    for step in range(60):
        lens = [r.kv.kv_allocated_len + 1 for r in reqs[0]]
        reuse = 1.0 if step % 10 == 9 else 0.7
        sel = selection(rng, lens, TOP_K, prev, reuse)
        prev = [[t for t in row.tolist() if t >= 0] for row in sel]
        results = []
        for c, e, rs in zip(caches, engines, reqs):
            decode_alloc(e, rs)
            if c is caches[0]:
                misses = c.coordinator.buffer_misses
                locs = c.on_decode_step(rs, sel)
                if reuse == 1.0:
                    # Last step's tokens again: all in the buffer but last step's newest token, which
                    # left the reserved slot for the host.
                    was_newest = sum(int(n > DBS and n - 2 in sel[i].tolist()) for i, n in enumerate(lens))
                    assert c.coordinator.buffer_misses - misses == LAYERS * was_newest
            else:
                locs = oracle_step(c, rs, sel)
            for i, r in enumerate(rs):
                write(c, i, r, torch.tensor([r.kv.kv_allocated_len - 1]))
            results.append(locs)
            check(c, rs)
        for layer in range(LAYERS):
            for i in range(len(prompts)):
                valid = sel[i] >= 0
                got = device_values(caches[0], layer, results[0][layer][i][valid])
                want = expected(i, sel[i][valid], layer)
                assert torch.equal(got, want), f"step {step} layer {layer} request {i}"
                assert torch.equal(got, device_values(caches[1], layer, results[1][layer][i][valid]))
                assert bool((results[0][layer][i][~valid] == -1).all())
    stats = caches[0].coordinator.stats()
    assert stats["buffer_hits"] > 0 and stats["buffer_misses"] > 0
    assert stats["swap_in_tokens"] == stats["buffer_misses"]
    for c, e, rs in zip(caches, engines, reqs):
        for r in rs:
            e.finish(r)
        check(c)
        assert all(v.available() == v.capacity for v in c.pools())


# ------------------------------------------------------------------------------------------ scenarios
def test_staging_then_collect_gives_a_buffer_and_returns_the_prefill_slots():
    cache = build(page_size=4)
    eng = Engine(cache, kv_writer=Writer(cache))
    long, short = Req("long", list(range(1, 81))), Req("short", list(range(1, 11)))
    prefill(cache, eng, eng.kv_writer, long, 0)
    prefill(cache, eng, eng.kv_writer, short, 1)
    coord = cache.coordinator
    assert coord.has_ongoing_staging() and [a.req for a in coord.ack_staging_queue] == [long, short]
    stats = coord.get_token_stats()
    assert stats.device_tokens == 80 + 12 and stats.host_tokens == 80 + 12
    check(cache, [long, short])
    assert coord.collect_ready_reqs() == [long, short]
    assert not coord.has_ongoing_staging()
    assert coord.state_of(long.kv).device_buffer_size_now == DBS + 4
    assert coord.state_of(short.kv).device_buffer_size_now == 12
    assert coord.get_token_stats().device_tokens == DBS + 4 + 12
    # The logical slots no longer map to the device: the buffer is the coordinator's.
    mapped = cache.kv_pool.translate_loc_from_full_to_hisparse_device(
        cache.req_to_token_pool.req_to_token[long.kv.req_pool_idx, :80].to(torch.int64))
    assert bool((mapped == 0).all())
    check(cache, [long, short])
    eng.finish(long)
    eng.finish(short)
    check(cache)
    assert all(v.available() == v.capacity for v in cache.pools())


@pytest.mark.parametrize("length", [20, 100])
def test_direct_admission_from_host(length):
    cache = build(page_size=4)
    coord = cache.coordinator
    req = Req("direct", list(range(1, length + 1)))
    eng = Engine(cache)
    assert eng.admit(req)
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc_logical_only([0], [0], [length], [length], [-1], length)
    cache.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, length)), slots.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = length
    assert cache.pools()[1].available() == cache.pools()[1].capacity  # nothing on the device
    host = coord.alloc_host_slots(req, length)
    for layer in range(LAYERS):  # the KV arrives in host memory (RDMA in disaggregated decode)
        k = expected(0, torch.arange(length), layer)
        cache.host_pool.k_buffer[layer][host] = k
        cache.host_pool.v_buffer[layer][host] = -k
    check(cache, [req])
    coord.admit_request_direct(req)
    state = coord.state_of(req.kv)
    assert state.ready
    if length <= DBS:
        assert torch.equal(device_values(cache, 0, state.device_buffer[:length]), expected(0, torch.arange(length), 0))
    else:
        assert bool((state.buffer_tokens[:, :DBS] == -1).all())
    check(cache, [req])
    decode_alloc(eng, [req])
    sel = torch.tensor([list(range(0, 20, 2))])
    misses = coord.buffer_misses
    locs = cache.on_decode_step([req], sel)
    assert coord.buffer_misses - misses == (0 if length + 1 <= DBS else LAYERS * 10)
    write(cache, 0, req, torch.tensor([length]))
    for layer in range(LAYERS):
        assert torch.equal(device_values(cache, layer, locs[layer][0][:10]), expected(0, sel[0], layer))
    check(cache, [req])
    eng.finish(req)
    check(cache)
    assert all(v.available() == v.capacity for v in cache.pools())


def test_swap_in_hits_misses_and_lru_order():
    cache = build(page_size=1)
    eng = Engine(cache, kv_writer=Writer(cache))
    req = Req("r", list(range(1, 101)))
    prefill(cache, eng, eng.kv_writer, req, 0)
    coord = cache.coordinator
    decode_alloc(eng, [req])
    n = req.kv.kv_allocated_len  # 101: the buffer holds tokens 0..31 after staging
    sel = torch.tensor([[0, 1, 2, 40, 41, 42, 43, 44, 45, 46, 47, n - 1]])
    cache.on_decode_step([req], sel)
    write(cache, 0, req, torch.tensor([n - 1]))
    # Per layer: 0, 1, 2 hit, 40..47 miss, the newest token is served from the reserved slot.
    assert coord.buffer_hits == LAYERS * 4 and coord.buffer_misses == LAYERS * 8
    state = coord.state_of(req.kv)
    lru = state.lru_slots[0].tolist()
    assert lru[-3:] == [0, 1, 2]  # hits most recently used
    assert sorted(state.buffer_tokens[0][lru[-11:-3]].tolist()) == list(range(40, 48))  # misses next
    assert lru[:3] == [11, 12, 13]  # slots 3..10 were evicted, least recent first
    decode_alloc(eng, [req])
    before = coord.swap_in_tokens
    locs = cache.on_decode_step([req], torch.tensor([[40, 41, 0, n - 1, n]]))  # n - 1 now lives on the host
    write(cache, 0, req, torch.tensor([n]))
    assert coord.swap_in_tokens - before == LAYERS * 1
    assert torch.equal(device_values(cache, 1, locs[1][0][:5]), expected(0, torch.tensor([40, 41, 0, n - 1, n]), 1))
    assert coord.swap_in_tokens == coord.buffer_misses
    check(cache, [req])
    eng.finish(req)
    check(cache)


def test_retract_while_staging_and_while_decoding():
    cache = build(page_size=4)
    eng = Engine(cache, kv_writer=Writer(cache))
    a, b = Req("a", list(range(1, 61))), Req("b", list(range(1, 61)))
    prefill(cache, eng, eng.kv_writer, a, 0)
    decode_alloc(eng, [a])
    cache.on_decode_step([a], torch.tensor([[0, 5, 59, 60]]))
    prefill(cache, eng, eng.kv_writer, b, 1)
    assert cache.coordinator.state_of(b.kv).staging
    check(cache, [a, b])
    eng.retract(b)  # still staging: SGLang's abort_staging_request
    assert not cache.coordinator.has_ongoing_staging()
    check(cache, [a])
    eng.retract(a)  # decoding: request_finished
    check(cache)
    assert all(v.available() == v.capacity for v in cache.pools())
    assert a.kv.components == {} and b.kv.components == {}
    # Retracted requests come back and run again.
    prefill(cache, eng, eng.kv_writer, a, 0)
    decode_alloc(eng, [a])
    cache.on_decode_step([a], torch.tensor([[1, 2, 3]]))
    check(cache, [a])
    eng.finish(a)
    check(cache)
    assert all(v.available() == v.capacity for v in cache.pools())


def test_finish_without_staging_returns_everything():
    cache = build(page_size=1)
    eng = Engine(cache, cache_prompt=False)  # never staged: the plain chunk-cache path
    req = Req("plain", list(range(1, 41)))
    assert eng.admit(req) and eng.extend(req)
    assert eng.decode([req]) and eng.decode([req])
    check(cache, [req])
    eng.finish(req)
    check(cache)
    assert all(v.available() == v.capacity for v in cache.pools())


def test_staging_record_extended_past_its_prefill_frees_each_device_page_once():
    """The seeded stream that found it (``kvcore fuzz --backend hisparse --seed 0 --page-size 16``).

    A session's record still in staging (prefill 83 tokens) was extended to 101 tokens before its
    session ended; the staging release freed the device slots of the prefill only, so the page
    holding positions 80..95 went back whole while positions 83..95 still mapped into it, and the
    row's own free then freed that page a second time.  The fuzz runs the invariant checker after
    every operation.
    """
    result = run_fuzz("hisparse", 11_400, seed=0, page_size=16, check_every=1)
    assert result.ops == 11_400 and result.checks > 11_400


# ------------------------------------------------------------------------------------------ bad input
def test_bad_selection_and_missing_buffer_change_nothing():
    cache = build(page_size=4)
    eng = Engine(cache, kv_writer=Writer(cache))
    req, staged = Req("r", list(range(1, 61))), Req("s", list(range(1, 61)))
    prefill(cache, eng, eng.kv_writer, req, 0)
    decode_alloc(eng, [req])
    cache.on_decode_step([req], torch.tensor([[1, 2]]))
    prefill(cache, eng, eng.kv_writer, staged, 1)
    decode_alloc(eng, [req])
    n = req.kv.kv_allocated_len
    coord = cache.coordinator
    rows = torch.tensor([req.kv.req_pool_idx])
    lens = torch.tensor([n])
    before = snapshot(cache)
    bad = [
        torch.tensor([[0, n]]),                      # beyond the request's length
        torch.tensor([[-2, 1]]),                     # negative (only -1 pads)
        torch.tensor([[4, 4]]),                      # a token twice
        torch.zeros((1, TOP_K + 1), dtype=torch.int64),  # wider than top_k
        torch.tensor([[0.5, 1.0]]),                  # not positions
        torch.tensor([[1], [2]]),                    # two rows for one request
    ]
    for sel in bad:
        with pytest.raises(ValueError):
            cache.on_decode_step([req], sel)
        with pytest.raises(ValueError):
            coord.swap_in_selected_pages(rows, lens, sel, 0)
        assert same(snapshot(cache), before)
    with pytest.raises(ValueError, match="device buffer"):  # staged but not collected: no buffer yet
        coord.swap_in_selected_pages(torch.tensor([staged.kv.req_pool_idx]), torch.tensor([60]),
                                     torch.tensor([[1]]), 0)
    with pytest.raises(ValueError, match="layer_id"):
        coord.swap_in_selected_pages(rows, lens, torch.tensor([[1]]), LAYERS)
    with pytest.raises(ValueError, match="already admitted"):
        coord.admit_request_into_staging(req)
    assert same(snapshot(cache), before)
    check(cache, [req, staged])
    cache.on_decode_step([req], torch.tensor([[0, n - 1]]))
    eng.finish(req)
    eng.finish(staged)
    check(cache)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(device_buffer_size=8, top_k=16), "smaller than top_k"),
        (dict(host_to_device_ratio=0), "host_to_device_ratio"),
        (dict(device_buffer_size=30, page_size=4), "multiple of page_size"),
        (dict(size=32, device_buffer_size=32), "cannot hold one request's buffer"),
    ],
)
def test_bad_config_is_a_clear_error(options, message):
    opts = dict(size=512, max_num_reqs=4, max_context_len=256, device_buffer_size=32, top_k=8) | options
    with pytest.raises(ConfigError, match=message):
        kvcore.create_cache("hisparse", **opts)

"""The rest of the request lifecycle, driven through kvcore.Engine: retraction (recompute and offload),
disaggregated decode (pre-allocation), session trims and aborts, release checks.

The invariant checker runs after every step.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import DecodeReqToTokenPool, Req, StreamingSession
from kvcore.engine import Engine

BACKENDS = ["radix", "swa", "mamba", "chunk", "swa-chunk"]
KV = dict(num_layers=2, num_heads=1, head_dim=2, dtype="float32")


def _build(backend: str, page: int, *, pages: int = 64, rows: int = 8, kv: bool = True, **extra):
    specs = kvcore.available_backends()
    if backend not in specs:
        pytest.skip(f"backend {backend!r} is not installed")
    fields = specs[backend].config.model_fields
    opts: dict = dict(size=pages * page, page_size=page, max_num_reqs=rows, max_context_len=32 * page)
    if "sliding_window_size" in fields:
        opts["sliding_window_size"] = 2 * page
    if kv:
        opts["kv_buffer"] = KV
    opts.update(extra)
    return kvcore.create_cache(backend, **opts)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=[1, 4], ids=lambda p: f"page{p}")
def page(request):
    return request.param


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def free_counts(cache) -> list:
    return [(v.name, v.available()) for v in cache.pools()]


def writer(cache):
    """A K/V writer that stores, at every new slot, a value derived from a running position counter."""
    pool = cache.kv_pool
    counter = [0]

    def write(slots: torch.Tensor) -> None:
        n = int(slots.numel())
        vals = torch.arange(counter[0], counter[0] + n, dtype=torch.float32) + 1
        counter[0] += n
        for layer in range(pool.layer_num):
            k = (vals + 1000 * layer).reshape(n, 1, 1).expand(n, pool.head_num, pool.head_dim)
            pool.set_kv_buffer(layer, slots, k, -k)

    return write


def row_kv(cache, req: Req, n: int) -> list[torch.Tensor]:
    """The K of row positions [0, n) of every layer (the data, wherever the slots are)."""
    pool = cache.kv_pool
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    return [pool.get_key_buffer(layer)[slots].clone() for layer in range(pool.layer_num)]


def run_to_decode(eng: Engine, req: Req, steps: int, live: tuple = ()) -> None:
    """Admit, prefill and decode ``steps`` tokens; ``live``: the other requests holding KV now."""
    owners = [*live, req]
    assert eng.admit(req)
    eng.check(owners)
    assert eng.extend(req)
    eng.check(owners)
    for i in range(steps):
        assert eng.decode([req], [900 + i]) == 1
        eng.check(owners)


# ---------------------------------------------------------------------------- retraction


def test_reset_for_retract_refuses_a_held_record():
    cache = _build("chunk", 1, kv=False)
    eng = Engine(cache)
    r = Req("r", toks(0, 5))
    assert eng.admit(r) and eng.extend(r)
    with pytest.raises(AssertionError, match="released"):
        r.reset_for_retract()
    eng.finish(r)
    eng.check()


def test_recompute_retract_keeps_floor_count_record_and_outputs(backend, page):
    cache = _build(backend, page)
    eng = Engine(cache)
    total = free_counts(cache)
    r = Req("r", toks(0, 3 * page + 1))
    run_to_decode(eng, r, page + 1)
    r.kv.swa_evict_floor = 2 * page
    kv = r.kv
    assert eng.retract(r) is None
    eng.check()
    assert r.kv is kv and r.retraction_count == 1 and r.is_retracted
    assert (kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len, kv.kv_allocated_len) == (None, 0, 0, 0)
    assert kv.swa_evict_floor == 2 * page and kv.retraction_backup is None and kv.components == {}
    assert r.lock is None and r.last_node is None and r.prefix_indices.numel() == 0
    assert len(r.output_ids) == page + 1
    # Recompute: admitted again, prompt and outputs prefilled again, then it decodes on.
    assert eng.admit(r)
    eng.check([r])
    assert eng.extend(r)
    eng.check([r])
    assert eng.decode([r]) == 1
    eng.check([r])
    eng.retract(r)
    assert r.retraction_count == 2
    eng.check()
    cache.reset()
    assert free_counts(cache) == total


def test_offload_retract_resumes_without_recompute(backend, page):
    cache = _build(backend, page)
    eng = Engine(cache)
    eng.kv_writer = writer(cache)
    total = free_counts(cache)
    other = Req("o", toks(500, 2 * page + 3))
    run_to_decode(eng, other, 2)
    r = Req("r", toks(0, 3 * page + 1))
    run_to_decode(eng, r, page + 2, (other,))
    r.kv.swa_evict_floor = page
    n = r.seqlen - 1
    before = row_kv(cache, r, n)
    backup = eng.retract(r, mode="offload")
    eng.check([other])
    assert backup is not None and r.kv.retraction_backup is backup and backup.num_tokens == n
    kv_bytes = 2 * KV["num_layers"] * n * KV["num_heads"] * KV["head_dim"] * 4
    assert backup.nbytes >= kv_bytes and eng.offloaded_bytes == backup.nbytes and eng.offloaded_tokens == n
    assert r.kv.swa_evict_floor == page and not r.kv.is_held
    # Another request takes memory (and reuses the freed slots) while r waits.
    third = Req("t", toks(700, 2 * page))
    run_to_decode(eng, third, 1, (other,))
    assert eng.resume(r)
    eng.check([other, third, r])
    assert r.kv.retraction_backup is None and not r.is_retracted and eng.loaded_bytes == backup.nbytes
    assert r.kv.kv_committed_len == r.kv.kv_allocated_len == n
    # Window backends may have freed out-of-window positions after the resume: compare what is still there.
    after = row_kv(cache, r, n)
    lo = max(r.kv.swa_dead_lo(page), r.kv.swa_evicted_seqlen) if r.kv.swa_evicted_seqlen else 0
    for b, a in zip(before, after):
        assert torch.equal(b[lo:] if lo else b, a[lo:] if lo else a)
    for _ in range(page + 1):
        assert eng.decode([r, other, third]) == 3
        eng.check([r, other, third])
    for q in (r, other, third):
        eng.finish(q)
        eng.check([x for x in (r, other, third) if x.kv.is_held])
    cache.reset()
    assert free_counts(cache) == total


def test_offload_keeps_and_restores_the_mamba_state():
    cache = _build("mamba", 1)
    eng = Engine(cache)
    r = Req("r", toks(0, 9))
    run_to_decode(eng, r, 2)
    comp = r.kv.components["mamba"]
    mp = cache.mamba_pool.mamba_cache
    idx = comp.mamba_pool_idx.reshape(1).to(torch.int64)
    mp.temporal[:, idx] = 3.5
    mp.conv[0][:, idx] = -2.0
    backup = eng.retract(r, mode="offload")
    eng.check()
    # The tree saves each component's request state under its name.
    assert backup.state is not None and float(backup.state["mamba"]["temporal"].flatten()[0]) == 3.5
    assert backup.nbytes >= cache.mamba_pool.slot_bytes
    assert eng.resume(r)
    eng.check([r])
    idx = r.kv.components["mamba"].mamba_pool_idx.reshape(1).to(torch.int64)
    assert torch.all(mp.temporal[:, idx] == 3.5) and torch.all(mp.conv[0][:, idx] == -2.0)
    assert eng.decode([r]) == 1
    eng.check([r])
    eng.finish(r)
    eng.check()


def test_offload_of_a_chunked_prefill_falls_back_to_recompute():
    cache = _build("radix", 1)
    eng = Engine(cache)
    r = Req("r", toks(0, 20))
    assert eng.admit(r) and eng.extend(r, 8)
    eng.check([r])
    assert eng.retract(r, mode="offload") is None
    assert r.kv.retraction_backup is None and eng.offloaded_bytes == 0
    eng.check()
    with pytest.raises(ValueError, match="no retraction backup"):
        eng.resume(r)
    with pytest.raises(ValueError, match="retract mode"):
        eng.retract(r, mode="swap")
    eng.check()


def test_resume_short_of_slots_holds_nothing_and_keeps_the_backup():
    cache = _build("radix", 1, pages=24, kv=False)
    eng = Engine(cache)
    r = Req("r", toks(0, 10))
    run_to_decode(eng, r, 3)
    eng.retract(r, mode="offload")
    eng.check()
    hog = Req("h", toks(100, 20))
    assert eng.admit(hog) and eng.extend(hog)
    eng.check([hog])
    rows = cache.req_to_token_pool.available_size()
    assert not eng.resume(r)
    eng.check([hog])
    assert not r.kv.is_held and r.kv.retraction_backup is not None
    assert cache.req_to_token_pool.available_size() == rows
    eng.finish(hog)
    eng.check()
    assert eng.resume(r)
    eng.check([r])
    eng.finish(r)
    eng.check()


def test_offload_retract_of_a_session_turn_keeps_floor_and_backup():
    cache = _build("radix", 1)
    s = StreamingSession(cache)
    eng = Engine(s)
    t1 = Req("t1", toks(0, 6), session_id="s")
    run_to_decode(eng, t1, 2)
    eng.finish(t1)
    eng.check()
    t2 = Req("t2", t1.fill_ids + toks(50, 3), session_id="s")
    run_to_decode(eng, t2, 2)
    t2.kv.swa_evict_floor = 4
    backup = eng.retract(t2, mode="offload")
    eng.check()
    assert "s" not in s.slots  # the turn ran on the session's record: the session went with it
    assert t2.kv.retraction_backup is backup and t2.kv.swa_evict_floor == 4
    assert eng.resume(t2)
    eng.check([t2])
    eng.finish(t2)  # a first turn again: the session slot adopts the record
    eng.check()
    assert s.slots["s"].kv.is_held
    eng.end_session("s")
    eng.check()


# ---------------------------------------------------------------------------- disaggregated decode


def test_decode_pool_rows_on_top_of_the_running_ones():
    pool = DecodeReqToTokenPool(2, 8, pre_alloc_size=3)
    assert pool.req_to_token.shape == (6, 8) and pool.size == 2 and pool.pre_alloc_size == 3
    assert pool.num_rows == 5 and pool.available_size() == 5

    class Owner:
        def __init__(self, rid):
            self.rid = rid
            self.kv = kvcore.ReqKvInfo()

    a, b, c = Owner("a"), Owner("b"), Owner("c")
    assert pool.alloc([a, b]) == [1, 2]  # a queue: taken from the head
    pool.free(a)
    assert pool.free_rows() == [3, 4, 5, 1]
    assert pool.alloc([c]) == [3]
    with pytest.raises(ValueError, match="allocated KV"):
        pool.alloc([b])
    with pytest.raises(ValueError):
        DecodeReqToTokenPool(2, 8, pre_alloc_size=-1)


def test_pre_alloc_receive_commit_decode(page):
    for backend in ("radix", "swa", "chunk"):
        cache = _build(backend, page, rows=2, pre_alloc_size=3)
        assert isinstance(cache.req_to_token_pool, DecodeReqToTokenPool)
        eng = Engine(cache)
        eng.kv_writer = writer(cache)
        total = free_counts(cache)
        # Five requests arrive from prefill (each with its first token); two run, three more are pre-allocated.
        reqs = [Req(f"r{i}", toks(10 * i, 3 * page + i), [77]) for i in range(5)]
        for r in reqs:
            dst = eng.pre_alloc(r)
            assert dst is not None and dst.numel() == len(r.origin_input_ids)
            assert r.kv.kv_committed_len == r.kv.kv_allocated_len == len(r.origin_input_ids)
            eng.check(reqs[: reqs.index(r) + 1])
        extra = Req("x", toks(999, 4), [1])
        assert eng.pre_alloc(extra) is None and not extra.kv.is_held  # every row is taken
        eng.check(reqs)
        # The transfer of r4 failed: abort it; the others commit and decode.
        eng.abort(reqs[4])
        eng.check(reqs[:4])
        for r in reqs[:4]:
            eng.process_prebuilt(r)
            eng.check(reqs[:4])
        for _ in range(page + 1):
            assert eng.decode(reqs[:4]) == 4
            eng.check(reqs[:4])
        for i, r in enumerate(reqs[:4]):
            eng.finish(r)
            eng.check(reqs[i + 1 : 4])
        cache.reset()
        assert free_counts(cache) == total and cache.req_to_token_pool.available_size() == 5


def test_pre_alloc_with_a_decode_side_prefix_match():
    cache = _build("radix", 1, rows=2, pre_alloc_size=2)
    eng = Engine(cache)
    a = Req("a", toks(0, 12), [5])
    assert eng.pre_alloc(a) is not None
    eng.process_prebuilt(a)  # the received prompt enters the tree
    eng.check([a])
    b = Req("b", toks(0, 12) + toks(40, 4), [6])
    dst = eng.pre_alloc(b, match_prefix=True)
    assert dst is not None and dst.numel() == 4 and b.kv.cache_protected_len == 12
    eng.check([a, b])
    with pytest.raises(ValueError, match="pre-allocated"):
        eng.process_prebuilt(Req("z", [1, 2]))
    eng.process_prebuilt(b)
    for r in (a, b):
        eng.finish(r)
    eng.check()


# ---------------------------------------------------------------------------- sessions


def test_trim_overshoot_cuts_the_record_to_the_finished_length():
    cache = _build("radix", 1, kv=False, max_context_len=64)
    s = StreamingSession(cache)
    eng = Engine(s)
    r = Req("t1", toks(0, 26), session_id="s")
    run_to_decode(eng, r, 18)  # 44 positions: speculative decoding overshot max_new_tokens=12
    assert r.kv.kv_allocated_len == 44
    row = cache.req_to_token_pool.req_to_token[r.kv.req_pool_idx]
    tail = row[38:44].to(torch.int64).clone()
    free_before = cache.token_to_kv_pool_allocator.available_size()
    r.finished_len = 12
    eng.finish(r)
    eng.check()
    slot = s.slots["s"]
    assert (slot.kv.kv_committed_len, slot.kv.kv_allocated_len) == (38, 38)
    assert len(r.output_ids) == 12 and slot.token_ids == r.origin_input_ids + r.output_ids
    assert cache.token_to_kv_pool_allocator.available_size() == free_before + 6
    assert set(tail.tolist()) <= set(cache.token_to_kv_pool_allocator.free_slots().tolist())
    assert s.session_held_req_count() == 1 and s.session_held_req_count({slot.kv.req_pool_idx}) == 0
    eng.end_session("s")
    eng.check()


def test_trim_overshoot_below_the_window_cursor_rounds_to_a_page():
    cache = _build("swa", 4, kv=False)
    s = StreamingSession(cache)
    eng = Engine(s)
    r = Req("t1", toks(0, 10), session_id="s")
    run_to_decode(eng, r, 16)
    assert r.kv.swa_evicted_seqlen > 12
    r.finished_len = 3  # target 13, below the cursor: rounded down to 12
    eng.finish(r)
    eng.check()
    kv = s.slots["s"].kv
    assert kv.kv_allocated_len == kv.kv_committed_len == kv.swa_evicted_seqlen == 12
    eng.end_session("s")
    eng.check()


def test_abort_of_a_first_turn_leaves_no_session():
    cache = _build("radix", 1, kv=False)
    s = StreamingSession(cache)
    eng = Engine(s)
    total = free_counts(cache)
    warm = Req("w", toks(0, 8))
    run_to_decode(eng, warm, 1)
    eng.finish(warm)
    eng.check()
    r = Req("t1", toks(0, 12), session_id="s")
    run_to_decode(eng, r, 3)
    assert r.kv.cache_protected_len > 0  # locked on the tree's prefix
    eng.abort(r)
    eng.check()
    assert "s" not in s.slots and cache.protected_size() == 0 and s.session_held_req_count() == 0
    cache.reset()
    assert free_counts(cache) == total


def test_abort_of_a_later_turn_releases_the_session():
    cache = _build("radix", 1, kv=False)
    s = StreamingSession(cache)
    eng = Engine(s)
    t1 = Req("t1", toks(0, 10), session_id="s")
    run_to_decode(eng, t1, 2)
    eng.finish(t1)
    eng.check()
    assert s.session_held_req_count() == 1 and "s" in eng.idle_sessions
    t2 = Req("t2", t1.fill_ids + toks(60, 4), session_id="s")
    run_to_decode(eng, t2, 2)
    eng.abort(t2)
    eng.check()
    assert "s" not in s.slots and s.session_held_req_count() == 0 and cache.protected_size() == 0
    # The next turn starts afresh (the tree still serves the prefix it cached).
    t3 = Req("t3", t1.fill_ids + toks(60, 4), session_id="s")
    run_to_decode(eng, t3, 1)
    eng.finish(t3)
    eng.check()
    eng.end_session("s")
    eng.check()


def test_session_held_mamba_slots_asks_the_cache():
    cache = _build("mamba", 1, kv=False)
    s = StreamingSession(cache)
    eng = Engine(s)
    t1 = Req("t1", toks(0, 10), session_id="s")
    run_to_decode(eng, t1, 2)
    eng.finish(t1)
    eng.check()
    kv = s.slots["s"].kv
    assert s.session_held_mamba_slots() == cache.request_state_slots(kv) == 1
    assert s.session_held_mamba_slots({kv.req_pool_idx}) == 0
    eng.end_session("s")
    eng.check()
    assert s.session_held_mamba_slots() == 0
    radix = StreamingSession(_build("radix", 1, kv=False))
    assert radix.session_held_mamba_slots() == 0


def test_page_aligned_sessions_reuse_whole_pages_only():
    cache = _build("radix", 4, kv=False)
    cache.session_page_aligned = True  # what the npu device sets (DeviceSpec.page_aligned_sessions)
    s = StreamingSession(cache)
    eng = Engine(s)
    t1 = Req("t1", toks(0, 9), session_id="s")
    run_to_decode(eng, t1, 2)  # 11 committed
    eng.finish(t1)
    eng.check()
    t2 = Req("t2", t1.fill_ids + toks(80, 3), session_id="s")
    assert eng.admit(t2)
    eng.check([t2])
    assert t2.kv.kv_allocated_len == 8 and t2.kv is s.slots["s"].kv  # 11 reusable, 8 in whole pages
    assert eng.extend(t2)
    eng.check([t2])
    eng.finish(t2)
    eng.check()
    # A turn sharing less than one page: the session is released, the tree matches afresh.
    t3 = Req("t3", [1000, 1001, 1002], session_id="s")
    assert eng.admit(t3)
    eng.check([t3])
    assert "s" not in s.slots and t3.kv.cache_protected_len == 0
    eng.extend(t3)
    eng.finish(t3)
    eng.end_session("s")
    eng.check()


# ---------------------------------------------------------------------------- release checks


def test_finish_refuses_over_allocation_without_speculative_decoding():
    cache = _build("radix", 1, kv=False)
    eng = Engine(cache)
    r = Req("r", toks(0, 8))
    run_to_decode(eng, r, 1)
    assert eng.extend_slots(r, r.kv.kv_allocated_len + 3)  # allocated, never committed
    with pytest.raises(ValueError, match="over-allocated"):
        eng.finish(r)
    eng.check([r])
    assert r.kv.is_held
    spec = Engine(cache, speculative=True)
    spec.finish(r)  # a speculative tail is freed
    spec.check()


def test_strip_thinking_cache_keeps_only_the_prompt():
    cache = _build("radix", 1, kv=False)
    eng = Engine(cache)
    r = Req("r", toks(0, 8), strip_thinking_cache=True)
    run_to_decode(eng, r, 5)
    r.reasoning_tokens = 5
    assert r.effective_kv_committed_len() == 8
    eng.finish(r)
    eng.check()
    assert cache.evictable_size() == 8  # the reasoning tokens went back as over-allocation


# ---------------------------------------------------------------------------- the bench


@pytest.mark.parametrize("backend", ["radix", "swa", "mamba"])
def test_bench_offload_against_recompute_retraction(backend):
    if backend not in kvcore.available_backends():
        pytest.skip(f"backend {backend!r} is not installed")
    from kvcore.bench import run_bench

    opts = dict(workload="long-decode", num_requests=4, seed=3, size=3072, max_num_reqs=4, window=64,
                check_every=97, write_kv=True, kv_layers=1, kv_heads=1, kv_head_dim=4)
    reps = {m: run_bench([backend], retract_mode=m, **opts)[0] for m in ("recompute", "offload")}
    for rep in reps.values():
        assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
        assert rep["invariant_violations"] == 0, rep["violations"]
        assert rep["retractions"] > 0
    rec, off = reps["recompute"], reps["offload"]
    assert rec["retract_offload_bytes"] == 0 and rec["retract_loaded_tokens"] == 0
    assert off["retract_offload_bytes"] > 0 and off["retract_loaded_tokens"] == off["retract_offload_tokens"] > 0
    # K and V, 1 layer x 1 head x 4 dims of float16 per position, plus any per-request state (mamba).
    assert off["retract_offload_bytes"] >= off["retract_offload_tokens"] * 2 * 4 * 2
    # Recompute prefills prompt + outputs again (SGLang's fill_ids); offload loads them back instead.
    assert rec["retract_recomputed_tokens"] > off["retract_recomputed_tokens"]


def test_bench_pd_decode_pre_allocation_unblocks_prefill():
    from kvcore.bench import run_bench

    opts = dict(workload="pd-decode", num_requests=30, seed=2, size=20480, max_num_reqs=8, check_every=29)
    plain, pre = (run_bench(["radix"], pre_alloc_size=n, **opts)[0] for n in (0, 8))
    for rep in (plain, pre):
        assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
        assert rep["invariant_violations"] == 0, rep["violations"]
        assert rep["pd_preallocated"] == 30 and rep["running_peak"] <= 8
    assert pre["pd_wait_steps_mean"] < plain["pd_wait_steps_mean"]
    assert pre["steps"] <= plain["steps"]


def test_bench_refuses_an_unknown_retract_mode():
    from typer.testing import CliRunner

    from kvcore.cli import app

    out = CliRunner().invoke(app, ["bench", "-b", "radix", "--retract-mode", "swap", "--no-reference"])
    assert out.exit_code != 0 and "retract-mode" in (out.output + str(out.exception))


# ---------------------------------------------------------------------------- admission and the window floor


def test_a_later_turn_keeps_the_trees_protected_length():
    cache = _build("radix", 1, kv=False)
    s = StreamingSession(cache)
    eng = Engine(s)
    warm = Req("w", toks(0, 9))
    run_to_decode(eng, warm, 1)
    eng.finish(warm)
    eng.check()
    t1 = Req("t1", toks(0, 12), session_id="s")
    run_to_decode(eng, t1, 3)
    protected = t1.kv.cache_protected_len
    assert protected >= 8
    eng.finish(t1)
    eng.check()
    t2 = Req("t2", t1.fill_ids + toks(50, 3), session_id="s")
    assert eng.admit(t2)
    eng.check([t2])
    # The session reuses 15 tokens, the tree still owns only its part of the shared record.
    assert t2.kv.kv_allocated_len == 15 and t2.kv.cache_protected_len == protected
    eng.abort(t2)
    eng.check()


def test_prefill_aware_swa_sets_the_floor_per_chunk():
    page = 1
    cache = _build("swa", page, kv=False)
    # No prompt caching: only the floor keeps the prompt's window slots.
    aware = Engine(cache, prefill_aware_swa=True, cache_prompt=False)
    plain = Engine(cache, cache_prompt=False)
    r, q = Req("r", toks(0, 20)), Req("q", toks(100, 20))
    assert aware.admit(r) and plain.admit(q)
    for end in (6, 13, 20):
        assert aware.extend(r, end) and plain.extend(q, end)
        aware.check([r, q])
        assert r.kv.swa_evict_floor == end and q.kv.swa_evict_floor == 0
    for _ in range(12):
        assert aware.decode([r, q]) == 2
        aware.check([r, q])
    # Both slid past the window; only the one without a floor freed prompt window slots above the tree's part.
    assert r.kv.swa_dead_lo(page) == 20 and r.kv.swa_evicted_seqlen > 20
    assert q.kv.swa_dead_lo(page) == q.kv.cache_protected_len < 20 < q.kv.swa_evicted_seqlen
    for x in (r, q):
        aware.finish(x)
    aware.check()


def test_testing_helpers_retract_and_resume():
    from kvcore.testing import helpers

    cache = _build("radix", 1, kv=False)
    r = helpers.make_req("r", toks(0, 9))
    assert helpers.admit(cache, r) and helpers.prefill(cache, r) and helpers.decode(cache, r, 2) == 2
    helpers.check_invariants(cache, [r])
    backup = helpers.retract(cache, r, "offload")
    helpers.check_invariants(cache)
    assert backup is not None and backup.cpu_tensors is None and backup.nbytes == 0  # no K/V buffer: lengths only
    assert helpers.resume(cache, r)
    helpers.check_invariants(cache, [r])
    helpers.finish(cache, r)
    helpers.check_invariants(cache)

"""Differential runs against SGLang 0.5.19's own NPU allocator and RadixCache at page size 128, on the CPU.

SGLang's ``NPUPagedTokenToKVPoolAllocator`` (``hardware_backend/npu/allocator_npu.py``) is
loaded from its source over the shim of ``tools/sglang_shim.py``.  Below 200 new pages it
calls ``sgl_kernel_npu``'s Triton kernel, which does not exist here: a stand-in runs
SGLang's own ``alloc_extend_naive`` for it (the path SGLang takes above 200 pages, and the
one kvcore-npu takes always).  Everything else — ``alloc_decode`` in torch, the host-side
``unique`` in ``free``, the ``.int()`` results — is SGLang's code.  Needs SGLang's source
(``$KVCORE_SGLANG_SRC``); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tools.sglang_shim import default_src, load_sglang  # noqa: E402

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")

from kvcore_npu import NPUPagedTokenToKVPoolAllocator  # noqa: E402

import kvcore  # noqa: E402
from kvcore import InvariantChecker, RadixKey, Req  # noqa: E402

PAGE = 128


@pytest.fixture(scope="module")
def sg():
    ns = load_sglang(SRC)
    paged = sys.modules["sglang.srt.mem_cache.allocator.paged"]

    class NaiveStandIn:
        """Stands in for sgl_kernel_npu's alloc_extend_kernel: SGLang's own naive path."""

        def __getitem__(self, grid):
            def run(prefix_lens, seq_lens, last_loc, free_pages, out, bs_upper, page_size, max_tokens):
                paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out, page_size, out.device)

            return run

    kernel = types.ModuleType("sgl_kernel_npu.mem_cache.allocator")
    kernel.alloc_extend_kernel = NaiveStandIn()  # type: ignore[attr-defined]
    saved = {n: sys.modules.get(n) for n in ("sgl_kernel_npu", "sgl_kernel_npu.mem_cache", kernel.__name__)}
    sys.modules["sgl_kernel_npu"] = types.ModuleType("sgl_kernel_npu")
    sys.modules["sgl_kernel_npu.mem_cache"] = types.ModuleType("sgl_kernel_npu.mem_cache")
    sys.modules[kernel.__name__] = kernel
    path = Path(SRC) / "sglang" / "srt" / "hardware_backend" / "npu" / "allocator_npu.py"
    spec = importlib.util.spec_from_file_location("sglang_allocator_npu_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ns.NPUPagedTokenToKVPoolAllocator = module.NPUPagedTokenToKVPoolAllocator
    yield ns
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


def sg_alloc(sg, size):
    return sg.NPUPagedTokenToKVPoolAllocator(size, PAGE, torch.float16, "cpu", None, False)


def T(v):
    return torch.tensor(v, dtype=torch.int64)


def test_npu_allocator_against_sglang(sg):
    for seed in range(4):
        rng = random.Random(seed)
        size = 40 * PAGE
        s, o = sg_alloc(sg, size), NPUPagedTokenToKVPoolAllocator(size, PAGE)
        rows: list[list[int]] = []
        for step in range(200):
            where = f"seed={seed} step={step}"
            op = rng.random()
            if op < 0.4:
                bs = rng.randrange(1, 4)
                pre, seq, last, owners = [], [], [], []
                for _ in range(bs):
                    r = rng.choice(rows) if rows and rng.random() < 0.5 else None
                    if r is not None and any(r is x for x in owners):
                        r = None
                    a = len(r) if r else 0
                    pre.append(a)
                    seq.append(a + rng.randrange(1, 3 * PAGE + 5))
                    last.append(r[-1] if r else -1)
                    owners.append(r)
                n = sum(seq) - sum(pre)
                a_s = s.alloc_extend(T(pre), T(pre), T(seq), T(seq), T(last), n)
                a_o = o.alloc_extend(pre, pre, seq, seq, last, n)
                assert (a_s is None) == (a_o is None), where
                if a_o is None:
                    continue
                assert a_s.dtype == a_o.dtype == torch.int32, where
                assert a_s.tolist() == a_o.tolist(), where
                k = 0
                for r, a, b in zip(owners, pre, seq):
                    new = a_o[k : k + b - a].tolist()
                    k += b - a
                    (rows.append(new) if r is None else r.extend(new))
            elif op < 0.65 and rows:
                batch = rng.sample(rows, min(len(rows), rng.randrange(1, 4)))
                seq = [len(r) + 1 for r in batch]
                last = [r[-1] for r in batch]
                d_s = s.alloc_decode(T(seq), T(seq), T(last))
                d_o = o.alloc_decode(seq, seq, last)
                assert (d_s is None) == (d_o is None), where
                if d_o is not None:
                    assert d_s.dtype == d_o.dtype == torch.int32 and d_s.tolist() == d_o.tolist(), where
                    for r, x in zip(batch, d_o.tolist()):
                        r.append(x)
            elif rows:
                r = rows.pop(rng.randrange(len(rows)))
                s.free(T(r))
                o.free(T(r))
            free_o = o.free_slots().reshape(-1, PAGE)[:, 0] // PAGE
            assert s.free_pages.tolist() == free_o.tolist(), where
            assert s.available_size() == o.available_size(), where


class Clock:
    """One time per operation for both sides (SGLang's readings inside one operation differ by < 1e-3)."""

    def __init__(self):
        self.t = 1000.0
        self.k = 0

    def tick(self):
        self.t += 1.0
        self.k = 0

    def __call__(self):
        return self.t

    def sglang(self):
        self.k += 1
        return self.t + self.k * 1e-6


class SgKv:
    def __init__(self):
        self.req_pool_idx = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0

    @property
    def holds_kv(self):
        return self.req_pool_idx is not None


class SgReq:
    def __init__(self, rid, ids):
        self.rid = rid
        self.origin_input_ids = list(ids)
        self.output_ids: list[int] = []
        self.extra_key = None
        self.cache_salt = None
        self.priority = 0
        self.kv = SgKv()
        self.last_node = None
        self.prefix_indices = None

    def get_fill_ids(self):
        return self.origin_input_ids + self.output_ids


def test_radix_on_npu_pools_against_sglang(sg, monkeypatch):
    """Backend ``npu`` and SGLang's RadixCache on its NPU allocator, driven in lockstep at page 128."""
    clock = Clock()
    import time as _time

    fake_time = types.SimpleNamespace(monotonic=clock.sglang, time=clock.sglang, perf_counter=_time.perf_counter)
    monkeypatch.setattr(sg.radix_cache, "time", fake_time)
    for seed in range(3):
        _radix_run(sg, clock, seed)


def _radix_run(sg, clock, seed):
    rng = random.Random(f"npu-{seed}")
    size, rows_n, ctx = 24 * PAGE, 6, 8 * PAGE
    s_alloc = sg_alloc(sg, size)
    s_rows = sg.ReqToTokenPool(size=rows_n, max_context_len=ctx, device="cpu", enable_memory_saver=False)
    s = sg.RadixCache(sg.CacheInitParams(disable=False, req_to_token_pool=s_rows,
                                         token_to_kv_pool_allocator=s_alloc, page_size=PAGE,
                                         eviction_policy="lru"))
    o = kvcore.create_cache("npu", size=size, max_num_reqs=rows_n, max_context_len=ctx)
    o.clock = clock
    o_alloc, o_rows = o.token_to_kv_pool_allocator, o.req_to_token_pool
    bases = [[rng.randrange(4) for _ in range(2 * PAGE + 40)] for _ in range(3)]
    live: list[tuple[SgReq, Req]] = []

    def check(where):
        assert s.evictable_size() == o.evictable_size(), where
        assert s.protected_size() == o.protected_size(), where
        assert s_alloc.available_size() == o_alloc.available_size(), where
        free_o = o_alloc.free_slots().reshape(-1, PAGE)[:, 0] // PAGE
        assert s_alloc.free_pages.tolist() == free_o.tolist(), where
        assert s_rows.free_slots == o_rows.free_rows(), where

    def evict(n):
        clock.tick()
        assert s.evict(sg.EvictParams(num_tokens=n)).num_tokens_evicted == o.evict(n).num_tokens_evicted

    def extend(sr, orq, n):
        pre = sr.kv.kv_committed_len
        last = [int(s_rows.req_to_token[sr.kv.req_pool_idx, pre - 1]) if pre else -1,
                int(o_rows.req_to_token[orq.kv.req_pool_idx, pre - 1]) if pre else -1]
        for _ in range(2):
            a_s = s_alloc.alloc_extend(T([pre]), T([pre]), T([pre + n]), T([pre + n]), T([last[0]]), n)
            a_o = o_alloc.alloc_extend([pre], [pre], [pre + n], [pre + n], [last[1]], n)
            assert (a_s is None) == (a_o is None)
            if a_o is not None:
                break
            evict(n + PAGE)
        if a_o is None:
            return False
        assert a_s.dtype == a_o.dtype == torch.int32 and a_s.tolist() == a_o.tolist()
        s_rows.write((sr.kv.req_pool_idx, slice(pre, pre + n)), a_s)
        o_rows.write((orq.kv.req_pool_idx, slice(pre, pre + n)), a_o)
        for kv in (sr.kv, orq.kv):
            kv.kv_committed_len = kv.kv_allocated_len = pre + n
        return True

    for step in range(60):
        where = f"seed={seed} step={step}"
        op = rng.random()
        if op < 0.4 and len(live) < 4:
            base = rng.choice(bases)
            ids = base[: rng.randrange(1, len(base))] + [rng.randrange(4) for _ in range(rng.randrange(0, 200))]
            sr, orq = SgReq(f"r{step}", ids), Req(f"r{step}", ids)
            clock.tick()
            sm = s.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey(ids[:-1], None)))
            om = o.match_prefix(RadixKey(ids[:-1]))
            assert sm.device_indices.tolist() == om.device_indices.tolist(), where
            if s_rows.alloc([sr]) is None:
                assert o_rows.alloc([orq]) is None
                continue
            assert o_rows.alloc([orq]) == [sr.kv.req_pool_idx]
            n = int(om.device_indices.numel())
            sr.last_node, orq.last_node = sm.last_device_node, om.last_device_node
            s.inc_lock_ref(sr.last_node)
            orq.lock = o.inc_lock_ref(orq.last_node)
            s_rows.write((sr.kv.req_pool_idx, slice(0, n)), sm.device_indices)
            o_rows.write((orq.kv.req_pool_idx, slice(0, n)), om.device_indices)
            for kv in (sr.kv, orq.kv):
                kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = n
            if extend(sr, orq, len(ids) - n):
                live.append((sr, orq))
            else:
                s_rows.free(sr)
                o_rows.free(orq)
                s.dec_lock_ref(sr.last_node)
                o.dec_lock_ref(orq.last_node, orq.lock)
        elif op < 0.6 and live:
            sr, orq = rng.choice(live)
            if sr.kv.kv_committed_len < ctx - 1:
                pre = sr.kv.kv_committed_len
                last_s = int(s_rows.req_to_token[sr.kv.req_pool_idx, pre - 1])
                last_o = int(o_rows.req_to_token[orq.kv.req_pool_idx, pre - 1])
                d_s = s_alloc.alloc_decode(T([pre + 1]), T([pre + 1]), T([last_s]))
                d_o = o_alloc.alloc_decode([pre + 1], [pre + 1], [last_o])
                assert (d_s is None) == (d_o is None), where
                if d_o is not None:
                    assert d_s.tolist() == d_o.tolist() and d_o.dtype == torch.int32, where
                    s_rows.write((sr.kv.req_pool_idx, slice(pre, pre + 1)), d_s)
                    o_rows.write((orq.kv.req_pool_idx, slice(pre, pre + 1)), d_o)
                    tok = rng.randrange(4)
                    sr.output_ids.append(tok)
                    orq.output_ids.append(tok)
                    for kv in (sr.kv, orq.kv):
                        kv.kv_committed_len = kv.kv_allocated_len = pre + 1
        elif op < 0.7 and live:
            sr, orq = rng.choice(live)
            clock.tick()
            s.cache_unfinished_req(sr, chunked=False)
            o.cache_unfinished_req(orq, chunked=False)
            assert sr.prefix_indices.tolist() == orq.prefix_indices.tolist(), where
        elif op < 0.92 and live:
            sr, orq = live.pop(rng.randrange(len(live)))
            clock.tick()
            s.cache_finished_req(sr, is_insert=True, kv_len_to_handle=sr.kv.kv_committed_len)
            o.cache_finished_req(orq, is_insert=True)
            s_rows.free(sr)
            o_rows.free(orq)
        else:
            evict(rng.randrange(1, 3 * PAGE))
        check(where)
        InvariantChecker(o).check([orq for _, orq in live])
    for sr, orq in live:
        clock.tick()
        s.cache_finished_req(sr, is_insert=True, kv_len_to_handle=sr.kv.kv_committed_len)
        o.cache_finished_req(orq, is_insert=True)
        s_rows.free(sr)
        o_rows.free(orq)
    check("all finished")
    evict(10**6)
    check("evict all")
    assert o_alloc.available_size() == size
    InvariantChecker(o).check([])


def test_npu_allocator_large_extend_takes_sglang_naive_path(sg):
    """At 200 new pages or more SGLang itself runs alloc_extend_naive (no kernel): same slots, int32."""
    size = 512 * PAGE
    s, o = sg_alloc(sg, size), NPUPagedTokenToKVPoolAllocator(size, PAGE)
    first = [50, 0, 7 * PAGE + 3]
    got_s = s.alloc_extend(T([0] * 3), T([0] * 3), T(first), T(first), T([-1] * 3), sum(first))
    got_o = o.alloc_extend([0] * 3, [0] * 3, first, first, [-1] * 3, sum(first))
    assert got_s.tolist() == got_o.tolist()
    lasts = [int(got_o[49]), -1, int(got_o[-1])]
    pre, seq = [50, 0, 7 * PAGE + 3], [50 + 100 * PAGE, 90 * PAGE + 1, 7 * PAGE + 3 + 20 * PAGE]
    n = sum(seq) - sum(pre)
    got_s = s.alloc_extend(T(pre), T(pre), T(seq), T(seq), T(lasts), n)
    got_o = o.alloc_extend(pre, pre, seq, seq, lasts, n)
    assert got_s.dtype == got_o.dtype == torch.int32 and got_s.tolist() == got_o.tolist()
    assert s.free_pages.tolist() == (o.free_slots().reshape(-1, PAGE)[:, 0] // PAGE).tolist()

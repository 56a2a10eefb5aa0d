"""Differential runs against SGLang 0.5.19's own NPU allocator and RadixCache at page size 128, on the CPU.

SGLang's ``NPUPagedTokenToKVPoolAllocator`` (``hardware_backend/npu/allocator_npu.py``) is
loaded from its source over ``tools/sglang_loader.py``.  Below 200 new pages it
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
from kvcore_npu import NPUPagedTokenToKVPoolAllocator

import kvcore
from kvcore import InvariantChecker, RadixKey, Req
from tools.differential import Clock, Harness
from tools.sglang_loader import default_src, load_sglang

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")

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


class NPURadixRun(Harness):
    """Backend ``npu`` and SGLang's RadixCache on its NPU allocator at page 128, compared after every operation."""

    compare_after_op = True

    def __init__(self, sg, clock, seed):
        super().__init__(sg, seed=f"npu-{seed}")
        self.clock = clock
        self.size, rows_n, self.ctx = 24 * PAGE, 6, 8 * PAGE
        self.s_alloc = sg_alloc(sg, self.size)
        self.s_rows = sg.ReqToTokenPool(size=rows_n, max_context_len=self.ctx, device="cpu", enable_memory_saver=False)
        self.s = sg.RadixCache(sg.CacheInitParams(disable=False, req_to_token_pool=self.s_rows,
                                                  token_to_kv_pool_allocator=self.s_alloc, page_size=PAGE,
                                                  eviction_policy="lru"))
        self.o = kvcore.create_cache("npu", size=self.size, max_num_reqs=rows_n, max_context_len=self.ctx)
        self.o.clock = clock
        self.o_alloc, self.o_rows = self.o.token_to_kv_pool_allocator, self.o.req_to_token_pool
        self.bases = [[self.rng.randrange(4) for _ in range(2 * PAGE + 40)] for _ in range(3)]
        self.live: list[tuple[object, Req]] = []

    def compare(self, where):
        s, o = self.s, self.o
        self.eq(f"{where}: evictable_size", o.evictable_size(), s.evictable_size())
        self.eq(f"{where}: protected_size", o.protected_size(), s.protected_size())
        self.eq(f"{where}: available_size", self.o_alloc.available_size(), self.s_alloc.available_size())
        free_o = self.o_alloc.free_slots().reshape(-1, PAGE)[:, 0] // PAGE
        self.eq(f"{where}: free pages", free_o.tolist(), self.s_alloc.free_pages.tolist())
        self.eq(f"{where}: free rows", self.o_rows.free_rows(), self.s_rows.free_slots)
        InvariantChecker(o).check([orq for _, orq in self.live])

    def evict(self, n):
        self.clock.tick()
        self.eq(f"evict({n})", self.o.evict(n).num_tokens_evicted,
                self.s.evict(self.sg.EvictParams(num_tokens=n)).num_tokens_evicted)

    def extend(self, sr, orq, n):
        s_rows, o_rows = self.s_rows, self.o_rows
        pre = sr.kv.kv_committed_len
        last = [int(s_rows.req_to_token[sr.kv.req_pool_idx, pre - 1]) if pre else -1,
                int(o_rows.req_to_token[orq.kv.req_pool_idx, pre - 1]) if pre else -1]
        for _ in range(2):
            a_s = self.s_alloc.alloc_extend(T([pre]), T([pre]), T([pre + n]), T([pre + n]), T([last[0]]), n)
            a_o = self.o_alloc.alloc_extend([pre], [pre], [pre + n], [pre + n], [last[1]], n)
            self.eq("extend refused", a_o is None, a_s is None)
            if a_o is not None:
                break
            self.evict(n + PAGE)
        if a_o is None:
            return False
        self.eq("extend dtypes", (a_o.dtype, a_s.dtype), (torch.int32, torch.int32))
        self.eq("extend slots", a_o.tolist(), a_s.tolist())
        s_rows.write((sr.kv.req_pool_idx, slice(pre, pre + n)), a_s)
        o_rows.write((orq.kv.req_pool_idx, slice(pre, pre + n)), a_o)
        for kv in (sr.kv, orq.kv):
            kv.kv_committed_len = kv.kv_allocated_len = pre + n
        return True

    def finish(self, sr, orq):
        self.clock.tick()
        self.s.cache_finished_req(sr, is_insert=True, kv_len_to_handle=sr.kv.kv_committed_len)
        self.o.cache_finished_req(orq, is_insert=True)
        self.s_rows.free(sr)
        self.o_rows.free(orq)

    def operation(self):
        sg, rng, s, o, live = self.sg, self.rng, self.s, self.o, self.live
        s_rows, o_rows = self.s_rows, self.o_rows
        step = self.op
        op = rng.random()
        if op < 0.4 and len(live) < 4:
            base = rng.choice(self.bases)
            ids = base[: rng.randrange(1, len(base))] + [rng.randrange(4) for _ in range(rng.randrange(0, 200))]
            sr, orq = sg.SGReq(f"r{step}", ids), Req(f"r{step}", ids)
            self.clock.tick()
            sm = s.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey(ids[:-1], None)))
            om = o.match_prefix(RadixKey(ids[:-1]))
            self.eq("match", om.device_indices.tolist(), sm.device_indices.tolist())
            if s_rows.alloc([sr]) is None:
                self.eq("row refused", o_rows.alloc([orq]), None)
                return
            self.eq("row", o_rows.alloc([orq]), [sr.kv.req_pool_idx])
            n = int(om.device_indices.numel())
            sr.last_node, orq.last_node = sm.last_device_node, om.last_device_node
            s.inc_lock_ref(sr.last_node)
            orq.lock = o.inc_lock_ref(orq.last_node)
            s_rows.write((sr.kv.req_pool_idx, slice(0, n)), sm.device_indices)
            o_rows.write((orq.kv.req_pool_idx, slice(0, n)), om.device_indices)
            for kv in (sr.kv, orq.kv):
                kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = n
            if self.extend(sr, orq, len(ids) - n):
                live.append((sr, orq))
            else:
                s_rows.free(sr)
                o_rows.free(orq)
                s.dec_lock_ref(sr.last_node)
                o.dec_lock_ref(orq.last_node, orq.lock)
        elif op < 0.6 and live:
            sr, orq = rng.choice(live)
            if sr.kv.kv_committed_len < self.ctx - 1:
                pre = sr.kv.kv_committed_len
                last_s = int(s_rows.req_to_token[sr.kv.req_pool_idx, pre - 1])
                last_o = int(o_rows.req_to_token[orq.kv.req_pool_idx, pre - 1])
                d_s = self.s_alloc.alloc_decode(T([pre + 1]), T([pre + 1]), T([last_s]))
                d_o = self.o_alloc.alloc_decode([pre + 1], [pre + 1], [last_o])
                self.eq("decode refused", d_o is None, d_s is None)
                if d_o is not None:
                    self.eq("decode slot", (d_o.tolist(), d_o.dtype), (d_s.tolist(), torch.int32))
                    s_rows.write((sr.kv.req_pool_idx, slice(pre, pre + 1)), d_s)
                    o_rows.write((orq.kv.req_pool_idx, slice(pre, pre + 1)), d_o)
                    tok = rng.randrange(4)
                    sr.output_ids.append(tok)
                    orq.output_ids.append(tok)
                    for kv in (sr.kv, orq.kv):
                        kv.kv_committed_len = kv.kv_allocated_len = pre + 1
        elif op < 0.7 and live:
            sr, orq = rng.choice(live)
            self.clock.tick()
            s.cache_unfinished_req(sr, chunked=False)
            o.cache_unfinished_req(orq, chunked=False)
            self.eq("prefix_indices", orq.prefix_indices.tolist(), sr.prefix_indices.tolist())
        elif op < 0.92 and live:
            self.finish(*live.pop(rng.randrange(len(live))))
        else:
            self.evict(rng.randrange(1, 3 * PAGE))

    def drain(self):
        for sr, orq in self.live:
            self.finish(sr, orq)
        self.live = []
        self.compare("all finished")
        self.evict(10**6)
        self.compare("evict all")
        self.eq("available_size after evicting all", self.o_alloc.available_size(), self.size)


def test_radix_on_npu_pools_against_sglang(sg, monkeypatch):
    """Backend ``npu`` and SGLang's RadixCache on its NPU allocator, driven in lockstep at page 128."""
    clock = Clock().install(monkeypatch, sg.radix_cache)
    for seed in range(3):
        NPURadixRun(sg, clock, seed).run(60)


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

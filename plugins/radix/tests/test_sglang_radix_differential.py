"""Differential checks: random operation sequences through SGLang's own classes and kvcore's.

Every answer (matched slots, prefix lengths, evicted counts, lock deltas, allocated
slot indices) and every size (evictable / protected / total, pool availability and
the free lists themselves) must agree after every operation.

Needs SGLang 0.5.19's source: ``$KVCORE_SGLANG_SRC`` or ``/tmp/sgl/src`` (see
``tools/README.md``); skipped otherwise.  Deliberate contract differences that the
checks account for: ``LockResult.delta`` is positive for a lock (SGLang: negative);
``cache_finished_req`` clears ``req.last_node`` (SGLang leaves it); SGLang's
``cache_finished_req`` takes ``kv_len_to_handle`` where ours reads
``kv.kv_committed_len``.
"""

from __future__ import annotations

import math
import os
import random
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.sglang_shim import default_src, load_sglang  # noqa: E402

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")

import kvcore  # noqa: E402
from kvcore.keys import RadixKey  # noqa: E402
from kvcore.pools import ReqToTokenPool, TokenToKVPoolAllocator  # noqa: E402
from kvcore.pools.swa_allocator import SWATokenToKVPoolAllocator  # noqa: E402
from kvcore.record import Req, ReqKvInfo  # noqa: E402

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]


@pytest.fixture(scope="module")
def sg():
    return load_sglang(SRC)


class Clock:
    """A deterministic clock advanced once per top-level operation.

    kvcore reads ``clock()`` (one value per operation).  SGLang reads
    ``time.monotonic()`` several times inside one operation and with a real clock
    each later reading is (slightly) larger -- e.g. a new leaf is newer than the
    path it hangs from -- so its readings are ``t + k * 1e-6`` for the k-th call of
    the operation, and its times are compared after ``floor``.  Without that, SGLang
    breaks the resulting ties arbitrarily (heap order over a set of nodes).
    """

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


@pytest.fixture
def clock(sg, monkeypatch):
    clk = Clock()
    import time as _time

    fake = types.SimpleNamespace(monotonic=clk.sglang, time=clk.sglang, perf_counter=_time.perf_counter)
    monkeypatch.setattr(sg.radix_cache, "time", fake)
    return clk


# --------------------------------------------------------------------------- helpers


def sg_allocator(sg, size, page_size):
    if page_size == 1:
        return sg.TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    return sg.PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)


def sg_free_list(a):
    assert a.release_pages.numel() == 0
    return a.free_pages.tolist()


def our_free_list(a):
    pages = a.free_slots()
    if a.page_size > 1:
        pages = pages.reshape(-1, a.page_size)[:, 0] // a.page_size
    return pages.tolist()


def dump_tree(root, ours: bool):
    """Canonical tree: (depth, extra, key, value, lock_ref, hit_count, priority, access, creation)."""
    out = []

    def rec(node, depth):
        kids = list(node.children.values())
        rows = []
        for c in kids:
            key = list(c.key) if ours else list(c.key.token_ids)
            extra = c.extra_key if ours else c.key.extra_key
            rows.append((str(extra), key, c))
        rows.sort(key=lambda r: (r[0], r[1]))
        for extra, key, c in rows:
            out.append((depth, extra, tuple(key), tuple(c.value.tolist()), c.lock_ref, c.hit_count,
                        c.priority, math.floor(c.last_access_time), math.floor(c.creation_time)))
            rec(c, depth + 1)

    rec(root, 0)
    return out


class Pair:
    """SGLang's RadixCache + pools and kvcore's radix cache, driven in lockstep."""

    def __init__(self, sg, clock, page_size, policy, size=256, rows=8, ctx=128):
        self.sg, self.clock, self.ps = sg, clock, page_size
        self.s_alloc = sg_allocator(sg, size, page_size)
        self.s_rows = sg.ReqToTokenPool(size=rows, max_context_len=ctx, device="cpu", enable_memory_saver=False)
        self.s = sg.RadixCache(sg.CacheInitParams(
            disable=False, req_to_token_pool=self.s_rows, token_to_kv_pool_allocator=self.s_alloc,
            page_size=page_size, eviction_policy=policy))
        self.o = kvcore.create_cache("radix", size=size, page_size=page_size, max_num_reqs=rows,
                                     max_context_len=ctx, eviction_policy=policy)
        self.o.clock = clock
        self.o_alloc = self.o.token_to_kv_pool_allocator
        self.o_rows = self.o.req_to_token_pool

    def key(self, ids, extra):
        return self.sg.RadixKey(list(ids), extra), RadixKey(list(ids), extra)

    def check(self, where=""):
        s, o = self.s, self.o
        assert s.evictable_size() == o.evictable_size(), where
        assert s.protected_size() == o.protected_size(), where
        assert s.total_size() == o.total_size(), where
        assert self.s_alloc.available_size() == self.o_alloc.available_size(), where
        assert sg_free_list(self.s_alloc) == our_free_list(self.o_alloc), where
        assert self.s_rows.free_slots == self.o_rows.free_rows(), where
        assert dump_tree(s.root_node, False) == dump_tree(o.root_node, True), where

    # -- single operations (each one clock tick) --------------------------------

    def match(self, ids, extra):
        self.clock.tick()
        sk, ok = self.key(ids, extra)
        sm = self.s.match_prefix(self.sg.MatchPrefixParams(key=sk))
        om = self.o.match_prefix(ok)
        assert sm.device_indices.tolist() == om.device_indices.tolist()
        return sm, om

    def alloc(self, n):
        s, o = self.s_alloc.alloc(n), self.o_alloc.alloc(n)
        assert (s is None) == (o is None)
        if s is not None:
            assert s.tolist() == o.tolist()
        return s, o

    def evict(self, n):
        self.clock.tick()
        s = self.s.evict(self.sg.EvictParams(num_tokens=n)).num_tokens_evicted
        o = self.o.evict(n).num_tokens_evicted
        assert s == o, (n, s, o)
        return s

    def insert(self, ids, extra, priority):
        """Insert with freshly allocated slots; the caller's share is freed as an engine would."""
        p = self.ps
        n = len(ids)
        need = -(-n // p) * p
        if need == 0:
            return
        s_slots, o_slots = self.alloc(need)
        if s_slots is None:
            self.evict(need)
            s_slots, o_slots = self.alloc(need)
            if s_slots is None:
                return
        self.clock.tick()
        sk, ok = self.key(ids, extra)
        sr = self.s.insert(self.sg.InsertParams(key=sk, value=s_slots[:n].clone(), priority=priority))
        orr = self.o.insert(ok, o_slots[:n].clone(), priority=priority)
        assert sr.prefix_len == orr.prefix_len
        aligned = n // p * p
        # The tree keeps [prefix_len, aligned); give back the duplicates and the tail.
        s_free = torch.cat([s_slots[: sr.prefix_len], s_slots[aligned:]])
        o_free = torch.cat([o_slots[: orr.prefix_len], o_slots[aligned:]])
        self.s_alloc.free(s_free)
        self.o_alloc.free(o_free)


def make_ids(rng, bases, page_size):
    base = rng.choice(bases)
    cut = rng.randrange(0, len(base) + 1)
    tail = [rng.randrange(6) for _ in range(rng.randrange(0, 3 * page_size + 3))]
    return base[:cut] + tail


def make_bases(rng, n=5, length=30):
    return [[rng.randrange(6) for _ in range(length)] for _ in range(n)]


# --------------------------------------------------------------------------- 1. radix


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_radix_tree_ops(sg, clock, page_size, policy):
    for seed in range(5 if page_size < 16 else 2):
        rng = random.Random(f"{seed}-{page_size}-{policy}")
        pair = Pair(sg, clock, page_size, policy)
        bases = make_bases(rng)
        extras = [None, None, "lora-a"] if seed % 2 else [None]
        locks = []
        for step in range(120):
            op = rng.random()
            extra = rng.choice(extras)
            ids = make_ids(rng, bases, page_size)
            where = f"seed={seed} step={step} op={op:.2f}"
            if op < 0.40:
                pair.insert(ids, extra, rng.randrange(4))
            elif op < 0.60:
                pair.match(ids, extra)
            elif op < 0.72:
                sm, om = pair.match(ids, extra)
                if sm.device_indices.numel():
                    ds = pair.s.inc_lock_ref(sm.last_device_node).delta
                    do = pair.o.inc_lock_ref(om.last_device_node).delta
                    assert -ds == do, where  # documented sign difference
                    locks.append((sm.last_device_node, om.last_device_node, do))
            elif op < 0.84:
                if locks:
                    sn, on, lock = locks.pop(rng.randrange(len(locks)))
                    ds = pair.s.dec_lock_ref(sn).delta
                    do = pair.o.dec_lock_ref(on).delta
                    assert ds == -do, where
            else:
                pair.evict(rng.randrange(1, 40))
            pair.check(where)
        for sn, on, _ in locks:
            pair.s.dec_lock_ref(sn)
            pair.o.dec_lock_ref(on)
        pair.check("unlock all")
        pair.evict(10**6)
        pair.check("evict all")
        assert pair.o.total_size() == 0


# --------------------------------------------------------------------------- 3. requests


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
    """What SGLang's RadixCache.cache_{finished,unfinished}_req read of a request."""

    def __init__(self, rid, ids, extra, priority):
        self.rid = rid
        self.origin_input_ids = list(ids)
        self.output_ids = []
        self.extra_key = extra
        self.cache_salt = None
        self.priority = priority
        self.kv = SgKv()
        self.last_node = None
        self.prefix_indices = None

    def get_fill_ids(self):
        return self.origin_input_ids + self.output_ids


class ReqPair:
    def __init__(self, pair, rid, ids, extra, priority):
        self.pair = pair
        self.s = SgReq(rid, ids, extra, priority)
        self.o = Req(rid, list(ids), extra_key=extra, priority=priority)

    def start(self):
        """match, take a row, lock, allocate the rest of the prompt.  False if out of memory."""
        P = self.pair
        s, o = self.s, self.o
        sm, om = P.match(s.origin_input_ids, s.extra_key)
        rs, ro = P.s_rows.alloc([s]), P.o_rows.alloc([o])
        assert rs == ro
        if rs is None:
            return False
        n_pre = int(sm.device_indices.numel())
        s.last_node, o.last_node = sm.last_device_node, om.last_device_node
        P.s.inc_lock_ref(s.last_node)
        o.lock = P.o.inc_lock_ref(o.last_node)
        P.s_rows.write((s.kv.req_pool_idx, slice(0, n_pre)), sm.device_indices)
        P.o_rows.write((o.kv.req_pool_idx, slice(0, n_pre)), om.device_indices)
        s.kv.cache_protected_len = o.kv.cache_protected_len = n_pre
        s.kv.kv_committed_len = o.kv.kv_committed_len = n_pre
        s.kv.kv_allocated_len = o.kv.kv_allocated_len = n_pre
        return self.extend(len(s.origin_input_ids) - n_pre)

    def _last_loc(self, side_rows, kv, pre):
        return int(side_rows.req_to_token[kv.req_pool_idx, pre - 1]) if pre else -1

    def extend(self, n):
        P = self.pair
        s, o = self.s, self.o
        pre = s.kv.kv_committed_len
        if n == 0:
            return True
        ps = P.ps
        for _attempt in range(2):
            if ps == 1:
                ss, os_ = P.s_alloc.alloc(n), P.o_alloc.alloc(n)
            else:
                t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
                ss = P.s_alloc.alloc_extend(t(pre), t(pre), t(pre + n), t(pre + n),
                                            t(self._last_loc(P.s_rows, s.kv, pre)), n)
                os_ = P.o_alloc.alloc_extend(t(pre), t(pre), t(pre + n), t(pre + n),
                                             t(self._last_loc(P.o_rows, o.kv, pre)), n)
            assert (ss is None) == (os_ is None)
            if ss is not None:
                break
            P.evict(n + ps)
        if ss is None:
            return False
        assert ss.tolist() == os_.tolist()
        P.s_rows.write((s.kv.req_pool_idx, slice(pre, pre + n)), ss.to(torch.int32))
        P.o_rows.write((o.kv.req_pool_idx, slice(pre, pre + n)), os_.to(torch.int32))
        for kv in (s.kv, o.kv):
            kv.kv_committed_len = kv.kv_allocated_len = pre + n
        return True

    def decode(self, token):
        P = self.pair
        s, o = self.s, self.o
        pre = s.kv.kv_committed_len
        ps = P.ps
        for _attempt in range(2):
            if ps == 1:
                ss, os_ = P.s_alloc.alloc(1), P.o_alloc.alloc(1)
            else:
                t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
                ss = P.s_alloc.alloc_decode(t(pre + 1), t(pre + 1), t(self._last_loc(P.s_rows, s.kv, pre)))
                os_ = P.o_alloc.alloc_decode(t(pre + 1), t(pre + 1), t(self._last_loc(P.o_rows, o.kv, pre)))
            assert (ss is None) == (os_ is None)
            if ss is not None:
                break
            P.evict(ps)
        if ss is None:
            return False
        assert ss.tolist() == os_.tolist()
        s.output_ids.append(token)
        o.output_ids.append(token)
        P.s_rows.write((s.kv.req_pool_idx, slice(pre, pre + 1)), ss.to(torch.int32))
        P.o_rows.write((o.kv.req_pool_idx, slice(pre, pre + 1)), os_.to(torch.int32))
        for kv in (s.kv, o.kv):
            kv.kv_committed_len = kv.kv_allocated_len = pre + 1
        return True

    def unfinished(self, chunked):
        P = self.pair
        P.clock.tick()
        P.s.cache_unfinished_req(self.s, chunked=chunked)
        P.o.cache_unfinished_req(self.o, chunked=chunked)
        assert self.s.kv.cache_protected_len == self.o.kv.cache_protected_len
        assert self.s.prefix_indices.tolist() == self.o.prefix_indices.tolist()
        assert self.s.last_node.lock_ref == self.o.last_node.lock_ref

    def finish(self, is_insert=True):
        P = self.pair
        P.clock.tick()
        committed = self.s.kv.kv_committed_len
        P.s.cache_finished_req(self.s, is_insert=is_insert, kv_len_to_handle=committed)
        P.o.cache_finished_req(self.o, is_insert=is_insert)
        P.s_rows.free(self.s)
        P.o_rows.free(self.o)

    def abort(self):
        """Out of memory before anything was cached: give back what the request holds."""
        P = self.pair
        s, o = self.s, self.o
        if s.kv.req_pool_idx is None:
            return
        for rows, alloc, kv in ((P.s_rows, P.s_alloc, s.kv), (P.o_rows, P.o_alloc, o.kv)):
            seg = rows.req_to_token[kv.req_pool_idx, kv.cache_protected_len:kv.kv_committed_len].to(torch.int64)
            if seg.numel():
                alloc.free(seg)
        P.s.dec_lock_ref(s.last_node)
        P.o.dec_lock_ref(o.last_node)
        P.s_rows.free(s)
        P.o_rows.free(o)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "fifo", "mru"])
def test_request_lifecycle(sg, clock, page_size, policy):
    for seed in range(3):
        rng = random.Random(f"req-{seed}-{page_size}-{policy}")
        size = 48 * page_size if page_size > 1 else 160
        pair = Pair(sg, clock, page_size, policy, size=size, rows=6, ctx=160)
        bases = make_bases(rng, 4, 3 * page_size + 10)
        extras = [None, "x"] if seed == 1 else [None]
        live: list[ReqPair] = []
        for step in range(80):
            where = f"seed={seed} step={step}"
            op = rng.random()
            if op < 0.30 and len(live) < 5:
                r = ReqPair(pair, f"r{step}", make_ids(rng, bases, page_size) or [1], rng.choice(extras),
                            rng.randrange(3))
                if r.start():
                    live.append(r)
                else:
                    r.abort()
            elif op < 0.55 and live:
                r = rng.choice(live)
                if not r.decode(rng.randrange(6)):
                    pass
            elif op < 0.70 and live:
                rng.choice(live).unfinished(chunked=rng.random() < 0.5)
            elif op < 0.92 and live:
                r = live.pop(rng.randrange(len(live)))
                r.finish(is_insert=rng.random() < 0.9)
            elif op < 0.96:
                pair.evict(rng.randrange(1, 3 * page_size + 2))
            else:
                pair.match(make_ids(rng, bases, page_size), rng.choice(extras))
            pair.check(where)
        for r in live:
            r.finish()
        pair.check("all finished")
        assert pair.o.protected_size() == 0
        pair.evict(10**6)
        pair.check("evict all")
        assert pair.o_alloc.available_size() == size


# --------------------------------------------------------------------------- 2. pools


def test_req_to_token_pool_rows(sg):
    for seed in range(10):
        rng = random.Random(seed)
        s = sg.ReqToTokenPool(size=7, max_context_len=4, device="cpu", enable_memory_saver=False)
        o = ReqToTokenPool(7, 4)
        held = []
        for _ in range(60):
            if rng.random() < 0.55:
                reqs = [(types.SimpleNamespace(kv=SgKv()), types.SimpleNamespace(kv=ReqKvInfo()))
                        for _ in range(rng.randrange(1, 4))]
                rs = s.alloc([a for a, _ in reqs])
                ro = o.alloc([b for _, b in reqs])
                assert rs == ro
                if rs is not None:
                    held.extend(reqs)
            elif held:
                a, b = held.pop(rng.randrange(len(held)))
                s.free(a)
                o.free(b)
            assert s.available_size() == o.available_size()
            assert s.free_slots == o.free_rows()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_token_allocator(sg, page_size):
    ps = page_size
    for seed in range(8):
        rng = random.Random(seed * 31 + ps)
        size = 40 * ps
        s = sg_allocator(sg, size, ps)
        o = TokenToKVPoolAllocator(size, ps)
        held: list[list[torch.Tensor]] = []  # per "request": [sglang slots, our slots] of its row
        for step in range(150):
            op = rng.random()
            if op < 0.3:
                n = rng.randrange(0, 8) * ps
                a, b = s.alloc(n), o.alloc(n)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    if n:
                        held.append([a, b])
            elif op < 0.55 and ps > 1:
                # alloc_extend over a batch: some requests continue a held row, some are new.
                bs = rng.randrange(1, 4)
                pre, seq, ls, lo, owners = [], [], [], [], []
                for _ in range(bs):
                    if held and rng.random() < 0.5:
                        h = held[rng.randrange(len(held))]
                        if any(h is x for x in owners):
                            h = None
                    else:
                        h = None
                    p0 = len(h[0]) if h is not None else 0
                    pre.append(p0)
                    seq.append(p0 + rng.randrange(1, 3 * ps))
                    ls.append(int(h[0][-1]) if h is not None else -1)
                    lo.append(int(h[1][-1]) if h is not None else -1)
                    owners.append(h)
                T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                n = sum(seq) - sum(pre)
                a = s.alloc_extend(T(pre), T(pre), T(seq), T(seq), T(ls), n)
                b = o.alloc_extend(T(pre), T(pre), T(seq), T(seq), T(lo), n)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist(), (pre, seq, ls)
                    off = 0
                    for h, p0, s1 in zip(owners, pre, seq):
                        k = s1 - p0
                        if h is None:
                            held.append([a[off:off + k], b[off:off + k]])
                        else:
                            h[0] = torch.cat([h[0], a[off:off + k]])
                            h[1] = torch.cat([h[1], b[off:off + k]])
                        off += k
            elif op < 0.7 and ps > 1 and held:
                hs = rng.sample(held, min(len(held), rng.randrange(1, 4)))
                T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                seq = [len(h[0]) + 1 for h in hs]
                a = s.alloc_decode(T(seq), T(seq), T([int(h[0][-1]) for h in hs]))
                b = o.alloc_decode(T(seq), T(seq), T([int(h[1][-1]) for h in hs]))
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    for i, h in enumerate(hs):
                        h[0] = torch.cat([h[0], a[i:i + 1]])
                        h[1] = torch.cat([h[1], b[i:i + 1]])
            elif held:
                h = held.pop(rng.randrange(len(held)))
                # whole pages are owned by one row; free in a random order, as a batch does
                perm = torch.randperm(len(h[0]), generator=torch.Generator().manual_seed(step))
                if rng.random() < 0.5 and hasattr(o, "free_segment"):
                    s.free_segment(h[0], start_pos=0)
                    o.free_segment(h[1], start_pos=0)
                else:
                    s.free(h[0][perm])
                    o.free(h[1][perm])
            assert s.available_size() == o.available_size(), (seed, step)
            assert sg_free_list(s) == our_free_list(o), (seed, step)


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_allocator(sg, page_size):
    ps = page_size
    for seed in range(8):
        rng = random.Random(seed * 7 + ps)
        s = sg.SWATokenToKVPoolAllocator(32 * ps, 16 * ps, ps, torch.float16, "cpu", sg.make_swa_kvpool(), False)
        o = SWATokenToKVPoolAllocator(32 * ps, 16 * ps, ps)
        held = []
        for step in range(120):
            op = rng.random()
            if op < 0.4:
                n = rng.randrange(1, 5) * ps
                if ps == 1:
                    a, b = s.alloc(n), o.alloc(n)
                else:
                    T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                    a = s.alloc_extend(T([0]), T([0]), T([n]), T([n]), T([-1]), n)
                    b = o.alloc_extend(T([0]), T([0]), T([n]), T([n]), T([-1]), n)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    held.append([a, b, True])
            elif op < 0.6 and held:
                h = rng.choice(held)
                if h[2]:
                    s.free_swa(h[0])
                    o.free_swa(h[1])
                    h[2] = False
            elif op < 0.75 and held:
                h = held.pop(rng.randrange(len(held)))
                if h[2]:
                    s.free(h[0])
                    o.free(h[1])
                else:
                    s.free_full(h[0])
                    o.free_full(h[1])
            elif held:
                h = held.pop(rng.randrange(len(held)))
                s.free(h[0])  # SGLang's free after free_swa: the cleared mapping skips the window side
                o.free(h[1])
            assert s.full_available_size() == o.full_available_size(), (seed, step)
            assert s.swa_available_size() == o.swa_available_size(), (seed, step)
            assert s.full_to_swa_index_mapping.tolist() == o._mapping.tolist()
            assert sg_free_list(s.full_attn_allocator) == our_free_list(o.full_attn_allocator)
            assert sg_free_list(s.swa_attn_allocator) == our_free_list(o.swa_attn_allocator)

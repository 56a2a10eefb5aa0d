"""Differential checks of kvcore-radix: random operation sequences through SGLang's RadixCache and ours.

Every answer (matched slots, prefix lengths, evicted counts, lock deltas, allocated
slot indices) and every size (evictable / protected / total, pool availability and
the free lists themselves) and the whole tree must agree after every operation
(``tools/differential.py``'s loop; the pools alone are in
``tests/test_sglang_pools_differential.py``).

Needs SGLang 0.5.19's source: ``$KVCORE_SGLANG_SRC`` or ``/tmp/sgl/src`` (see
``tools/README.md``); skipped otherwise.  Deliberate contract differences that the
checks account for: ``LockResult.delta`` is positive for a lock (SGLang: negative);
``cache_finished_req`` clears ``req.last_node`` (SGLang leaves it); SGLang's
``cache_finished_req`` takes ``kv_len_to_handle`` where ours reads
``kv.kv_committed_len``.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcore
from kvcore import InvariantChecker
from kvcore.keys import RadixKey
from kvcore.record import Req
from tools.differential import Clock, Harness, our_free_pages, sglang_free_pages
from tools.sglang_loader import default_src, load_sglang

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]


@pytest.fixture(scope="module")
def sg():
    return load_sglang(SRC)


@pytest.fixture
def clock(sg, monkeypatch):
    return Clock().install(monkeypatch, sg.radix_cache)


def dump_tree(root, ours: bool):
    """Canonical tree: (depth, extra, key, value, lock_ref, hit_count, priority, access, creation)."""
    out = []

    def rec(node, depth):
        rows = []
        for c in node.children.values():
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


def make_ids(rng, bases, page_size):
    base = rng.choice(bases)
    cut = rng.randrange(0, len(base) + 1)
    tail = [rng.randrange(6) for _ in range(rng.randrange(0, 3 * page_size + 3))]
    return base[:cut] + tail


def make_bases(rng, n=5, length=30):
    return [[rng.randrange(6) for _ in range(length)] for _ in range(n)]


class RadixPair(Harness):
    """SGLang's RadixCache + pools and kvcore's radix cache, driven in lockstep, compared after every operation."""

    compare_after_op = True

    def __init__(self, sg, clock, page_size, policy, *, seed, size=256, rows=8, ctx=128):
        super().__init__(sg, seed=seed)
        self.clock, self.ps = clock, page_size
        self.s_alloc = sg.make_allocator(size, page_size)
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

    def compare(self, where=""):
        s, o = self.s, self.o
        self.eq(f"{where}: evictable_size", o.evictable_size(), s.evictable_size())
        self.eq(f"{where}: protected_size", o.protected_size(), s.protected_size())
        self.eq(f"{where}: total_size", o.total_size(), s.total_size())
        self.eq(f"{where}: available_size", self.o_alloc.available_size(), self.s_alloc.available_size())
        self.eq(f"{where}: free list", our_free_pages(self.o_alloc), sglang_free_pages(self.s_alloc))
        self.eq(f"{where}: free rows", self.o_rows.free_rows(), self.s_rows.free_slots)
        self.eq(f"{where}: tree", dump_tree(o.root_node, True), dump_tree(s.root_node, False))

    # -- single operations (each one clock tick) --------------------------------

    def match(self, ids, extra):
        self.clock.tick()
        sk, ok = self.key(ids, extra)
        sm = self.s.match_prefix(self.sg.MatchPrefixParams(key=sk))
        om = self.o.match_prefix(ok)
        self.eq("match", om.device_indices.tolist(), sm.device_indices.tolist())
        return sm, om

    def alloc(self, n):
        s, o = self.s_alloc.alloc(n), self.o_alloc.alloc(n)
        self.eq(f"alloc({n}) refused", o is None, s is None)
        if s is not None:
            self.eq(f"alloc({n})", o.tolist(), s.tolist())
        return s, o

    def evict(self, n):
        self.clock.tick()
        s = self.s.evict(self.sg.EvictParams(num_tokens=n)).num_tokens_evicted
        o = self.o.evict(n).num_tokens_evicted
        self.eq(f"evict({n})", o, s)
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
        self.eq("insert prefix_len", orr.prefix_len, sr.prefix_len)
        aligned = n // p * p
        # The tree keeps [prefix_len, aligned); give back the duplicates and the tail.
        s_free = torch.cat([s_slots[: sr.prefix_len], s_slots[aligned:]])
        o_free = torch.cat([o_slots[: orr.prefix_len], o_slots[aligned:]])
        self.s_alloc.free(s_free)
        self.o_alloc.free(o_free)


# --------------------------------------------------------------------------- 1. tree operations


class TreeOps(RadixPair):
    """insert / match / lock / unlock / evict at random; locks are given back and everything evicted at the end."""

    def __init__(self, sg, clock, page_size, policy, *, seed, extras):
        super().__init__(sg, clock, page_size, policy, seed=seed)
        self.bases = make_bases(self.rng)
        self.extras = extras
        self.locks = []

    def operation(self):
        rng = self.rng
        op = rng.random()
        extra = rng.choice(self.extras)
        ids = make_ids(rng, self.bases, self.ps)
        if op < 0.40:
            self.insert(ids, extra, rng.randrange(4))
        elif op < 0.60:
            self.match(ids, extra)
        elif op < 0.72:
            sm, om = self.match(ids, extra)
            if sm.device_indices.numel():
                ds = self.s.inc_lock_ref(sm.last_device_node).delta
                do = self.o.inc_lock_ref(om.last_device_node).delta
                self.eq("inc_lock_ref delta (sign flipped, documented)", do, -ds)
                self.locks.append((sm.last_device_node, om.last_device_node, do))
        elif op < 0.84:
            if self.locks:
                sn, on, lock = self.locks.pop(rng.randrange(len(self.locks)))
                ds = self.s.dec_lock_ref(sn).delta
                do = self.o.dec_lock_ref(on).delta
                self.eq("dec_lock_ref delta (sign flipped, documented)", do, -ds)
        else:
            self.evict(rng.randrange(1, 40))

    def drain(self):
        for sn, on, _ in self.locks:
            self.s.dec_lock_ref(sn)
            self.o.dec_lock_ref(on)
        self.compare("unlock all")
        self.evict(10**6)
        self.compare("evict all")
        self.eq("total_size after evicting all", self.o.total_size(), 0)
        InvariantChecker(self.o).check(owners=[])


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_radix_tree_ops(sg, clock, page_size, policy):
    for seed in range(5 if page_size < 16 else 2):
        extras = [None, None, "lora-a"] if seed % 2 else [None]
        TreeOps(sg, clock, page_size, policy, seed=f"{seed}-{page_size}-{policy}", extras=extras).run(120)


# --------------------------------------------------------------------------- 2. requests


class ReqPair:
    """One request on both sides: SGLang's record (its own ReqKvInfo) and kvcore's."""

    def __init__(self, pair, rid, ids, extra, priority):
        self.pair = pair
        self.s = pair.sg.SGReq(rid, ids, extra_key=extra, priority=priority)
        self.o = Req(rid, list(ids), extra_key=extra, priority=priority)

    def start(self):
        """match, take a row, lock, allocate the rest of the prompt.  False if out of memory."""
        P = self.pair
        s, o = self.s, self.o
        sm, om = P.match(s.origin_input_ids, s.extra_key)
        rs, ro = P.s_rows.alloc([s]), P.o_rows.alloc([o])
        P.eq("row", ro, rs)
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
            P.eq("extend refused", os_ is None, ss is None)
            if ss is not None:
                break
            P.evict(n + ps)
        if ss is None:
            return False
        P.eq("extend slots", os_.tolist(), ss.tolist())
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
            P.eq("decode refused", os_ is None, ss is None)
            if ss is not None:
                break
            P.evict(ps)
        if ss is None:
            return False
        P.eq("decode slot", os_.tolist(), ss.tolist())
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
        P.eq("cache_protected_len", self.o.kv.cache_protected_len, self.s.kv.cache_protected_len)
        P.eq("prefix_indices", self.o.prefix_indices.tolist(), self.s.prefix_indices.tolist())
        P.eq("last_node.lock_ref", self.o.last_node.lock_ref, self.s.last_node.lock_ref)

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


class Lifecycle(RadixPair):
    """Requests admitted, decoded, cached mid-way (chunked or not), finished; every pool and the tree compared."""

    def __init__(self, sg, clock, page_size, policy, *, seed, size, extras):
        super().__init__(sg, clock, page_size, policy, seed=seed, size=size, rows=6, ctx=160)
        self.size = size
        self.bases = make_bases(self.rng, 4, 3 * page_size + 10)
        self.extras = extras
        self.live: list[ReqPair] = []

    def operation(self):
        rng, ps, live = self.rng, self.ps, self.live
        op = rng.random()
        if op < 0.30 and len(live) < 5:
            r = ReqPair(self, f"r{self.op}", make_ids(rng, self.bases, ps) or [1], rng.choice(self.extras),
                        rng.randrange(3))
            if r.start():
                live.append(r)
            else:
                r.abort()
        elif op < 0.55 and live:
            rng.choice(live).decode(rng.randrange(6))
        elif op < 0.70 and live:
            rng.choice(live).unfinished(chunked=rng.random() < 0.5)
        elif op < 0.92 and live:
            r = live.pop(rng.randrange(len(live)))
            r.finish(is_insert=rng.random() < 0.9)
        elif op < 0.96:
            self.evict(rng.randrange(1, 3 * ps + 2))
        else:
            self.match(make_ids(rng, self.bases, ps), rng.choice(self.extras))

    def drain(self):
        for r in self.live:
            r.finish()
        self.compare("all finished")
        self.eq("protected_size when all finished", self.o.protected_size(), 0)
        self.evict(10**6)
        self.compare("evict all")
        self.eq("available_size after evicting all", self.o_alloc.available_size(), self.size)
        InvariantChecker(self.o).check(owners=[])


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "fifo", "mru"])
def test_request_lifecycle(sg, clock, page_size, policy):
    for seed in range(3):
        size = 48 * page_size if page_size > 1 else 160
        extras = [None, "x"] if seed == 1 else [None]
        Lifecycle(sg, clock, page_size, policy, seed=f"req-{seed}-{page_size}-{policy}", size=size,
                  extras=extras).run(80)

"""Differential check of ``unified`` against SGLang 0.5.19's own ``UnifiedRadixCache`` (Python TreeCore).

Seeded random operation sequences run through SGLang's cache (loaded from source with
``tools/sglang_unified_shim.py``, on its own ``SWATokenToKVPoolAllocator``) and through
kvcore's ``unified`` backend side by side.  After every operation every answer and
size must agree: match results (length, slots, last node), insert prefix lengths, the
window-lock stop, evict counts, request rows; then both pools' free sizes, which full
slots still own a window slot, every component's evictable/protected sizes, the whole
tree (keys, slots, tombstones, lock counts), the window LRU order and the full
component's evictable leaves in recency order.

Slots are compared through a pairing made at allocation time (ours -> SGLang's); the harness
base is ``tools/differential.py``.
Skips without SGLang's source (``$KVCORE_SGLANG_SRC``).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey, Req, create_cache
from kvcore.tree import iter_subtree
from tools.differential import Harness, ids, load_or_skip, lru_order, path_tokens, tree_rows, window_prompts
from tools.sglang_unified_shim import default_src, load_sglang_unified
from tools.window_differential import WindowHarness

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")


@pytest.fixture(scope="module")
def sg():
    return load_or_skip(load_sglang_unified, SRC, "UnifiedRadixCache")


class UnifiedHarness(Harness):
    """What the (full, swa) and (full, mamba) harnesses share: SGLang's tree core, its node paths and lists."""

    log_tail = 30

    def snode(self, node_id):
        return None if node_id is None else self.core.node_by_id(node_id)

    def their_node(self, node_id):
        return self.snode(node_id)

    def opath(self, node) -> tuple | None:
        return None if node is None else (None,) + path_tokens(node, self.ours.root_node)

    def spath(self, node) -> tuple | None:
        return None if node is None else (None,) + path_tokens(node, self.core.root_node, lambda k: k.token_ids)

    def their_data(self, node, component) -> tuple:
        """A node of SGLang's tree core: its full component's data and ``component``'s."""
        return node.component_data[self.CT.FULL], node.component_data[component]

    def their_lru(self, component) -> list:
        lru = self.core.lru_lists[component]
        return [self.spath(x) for x in lru_order(lru.head, lru.tail, lambda n: n.lru_prev[lru._pt])]

    def eq_leaves(self, what: str) -> None:
        ol = [self.opath(n) for n in sorted(self.ours.leaves, key=lambda n: n.last_access_time)]
        tl = [self.spath(n) for n in sorted(self.core.evictable_device_leaves, key=lambda n: n.last_access_time)]
        self.eq(f"{what}: evictable leaves by recency", ol, tl)


class Diff(UnifiedHarness, WindowHarness):
    """(full, swa): the request lifecycle of tools/window_differential on SGLang's UnifiedRadixCache and ours."""

    def __init__(self, sg, *, page_size: int, window: int, size: int, swa_size: int, num_reqs: int = 6,
                 max_context_len: int = 256, seed: int = 0, backend: str = "unified", evict_floor: bool = False):
        WindowHarness.__init__(self, sg, seed=seed, page_size=page_size, window=window, size=size,
                               evict_floor=evict_floor)
        # ``swa`` is the same tree with the same components, built under its own name and options.
        components = {"components": ("full", "swa")} if backend == "unified" else {}
        self.ours = create_cache(backend, **components, size=size, swa_size=swa_size,
                                 sliding_window_size=window, page_size=page_size, max_num_reqs=num_reqs,
                                 max_context_len=max_context_len)
        self.oa = self.ours.token_to_kv_pool_allocator
        self.sa = sg.make_swa_allocator(size, swa_size, page_size)
        self.srtp = sg.make_req_to_token_pool(num_reqs, max_context_len)
        self.theirs = sg.make_unified_cache(("full", "swa"), self.sa, self.srtp, page_size, window=window)
        self.core = self.theirs.tree_core
        self.CT = sg.ComponentType
        self.checker = InvariantChecker(self.ours)

    def their_root(self):
        return self.core.root_node

    def their_uuid(self, node):
        return node.component_data[self.CT.SWA].metadata.get("uuid")

    # ------------------------------------------------------------------ state comparison
    def _canon_ours(self):
        return tree_rows(self.ours.root_node, lambda n: (n.extra_key, self.opath(n), n.swa_value is None, n.lock_ref,
                                                         n.swa_lock_ref, tuple(self.mapped(n.value))))

    def _canon_theirs(self):
        def row(n):
            f, s = self.their_data(n, self.CT.SWA)
            return (n.key.extra_key, self.spath(n), s.value is None, f.lock_ref, s.lock_ref, ids(f.value))

        return tree_rows(self.core.root_node, row)

    def compare(self, what: str) -> None:
        o, t, CT = self.ours, self.theirs, self.CT
        self.eq(f"{what}: full_available_size", self.oa.full_available_size(), self.sa.full_available_size())
        self.eq(f"{what}: swa_available_size", self.oa.swa_available_size(), self.sa.swa_available_size())
        self.eq(f"{what}: sizes", (o.full_evictable_size(), o.full_protected_size(), o.swa_evictable_size(),
                                   o.swa_protected_size()),
                (t.full_evictable_size(), t.full_protected_size(), t.swa_evictable_size(), t.swa_protected_size()))
        self.eq_window_mapping(what)
        self.eq_rows(f"{what}: trees", self._canon_ours(), self._canon_theirs())
        self.eq(f"{what}: window LRU order", [self.opath(n) for n in o.by_name["swa"].lru], self.their_lru(CT.SWA))
        self.eq_leaves(what)
        self.checker.check([r for r, _, _ in self.live])

    # ------------------------------------------------------------------ allocation
    def ensure(self, n: int) -> bool:
        if self.oa.full_available_size() >= n and self.oa.swa_available_size() >= n:
            return True
        sn = max(0, n - self.oa.swa_available_size())
        fn = max(0, n - self.oa.full_available_size())
        self.evict(fn, sn)
        return self.oa.full_available_size() >= n and self.oa.swa_available_size() >= n


SEEDS = int(os.environ.get("KVCORE_DIFF_SEEDS", "4"))
OPS = int(os.environ.get("KVCORE_DIFF_OPS", "120"))
SWA_CONFIGS = [
    # page_size, window, full pool, window pool
    (1, 4, 120, 24),
    (1, 16, 320, 64),
    (1, 32, 640, 128),
    (4, 8, 192, 48),
    (16, 20, 512, 160),
]


def run_swa(sg, ps, W, size, swa, seed, ops=OPS, backend="unified", evict_floor=False):
    rng = random.Random(f"unified-{ps}-{W}-{seed}")
    diff = Diff(sg, page_size=ps, window=W, size=size, swa_size=swa, seed=seed, backend=backend,
                evict_floor=evict_floor)
    return diff.run(ops, window_prompts(rng, ps, W))


@pytest.mark.parametrize("backend", ["unified", "swa"])
@pytest.mark.parametrize("ps, W, size, swa", SWA_CONFIGS)
def test_unified_full_swa_matches_sglang(sg, ps, W, size, swa, backend):
    for seed in range(SEEDS):
        run_swa(sg, ps, W, size, swa, seed, backend=backend)


@pytest.mark.parametrize("ps, W, size, swa", SWA_CONFIGS)
def test_swa_evict_floor_matches_sglang_but_its_window_leak(sg, ps, W, size, swa):
    """Random floors (prefill-aware SWA) on ``swa``: everything agrees but the documented window leak."""
    for seed in range(SEEDS):
        run_swa(sg, ps, W, size, swa, seed, backend="swa", evict_floor=True)


# ---------------------------------------------------------------------------------------------
# (full, mamba): direct operations (insert with a state slot, match, lock/unlock, evict).


@pytest.fixture(scope="module")
def sgm():
    return load_or_skip(load_sglang_unified, SRC, "UnifiedRadixCache with Mamba", mamba=True)


class MambaDiff(UnifiedHarness):
    def __init__(self, sg, *, page_size: int, size: int, mamba_size: int, chunk: int, seed: int,
                 track_interval: int = 256, backend: str = "unified"):
        super().__init__(sg, seed=seed, pair_size=size + page_size + 1)
        self.ps = page_size
        self.size = size
        self.chunk = chunk
        # ``mamba`` is the same tree with the same components, built under its own name and options.
        components = {"components": ("full", "mamba")} if backend == "unified" else {}
        self.ours = create_cache(backend, **components, size=size, page_size=page_size,
                                 max_num_reqs=4, max_context_len=256, mamba_size=mamba_size,
                                 mamba_cache_chunk_size=chunk, mamba_track_interval=track_interval)
        self.oa = self.ours.token_to_kv_pool_allocator
        self.om = self.ours.mamba_pool
        self.sa = sg.make_allocator(size, page_size)
        extra = page_size > 1  # SGLang's mamba component needs its extra-buffer mode for pages
        self.spool = sg.make_hybrid_pool(4, mamba_size, 256, extra_buffer=extra)
        self.theirs = sg.make_unified_cache(("full", "mamba"), self.sa, self.spool, page_size, chunk_size=chunk,
                                            enable_mamba_extra_buffer=extra)
        self.core = self.theirs.tree_core
        self.CT = sg.ComponentType
        self.mpair = torch.full((mamba_size + 2,), -1, dtype=torch.int64)
        self.held: list = []
        self.live: list = []
        self.checker = InvariantChecker(self.ours)

    def _canon_ours(self):
        def row(n):
            mv = None if n.mamba_value is None else int(self.mpair[int(n.mamba_value[0])])
            return (n.extra_key, self.opath(n), n.lock_ref, n.mamba_lock_ref, mv, tuple(self.mapped(n.value)))

        return tree_rows(self.ours.root_node, row)

    def _canon_theirs(self):
        def row(n):
            f, m = self.their_data(n, self.CT.MAMBA)
            mv = None if m.value is None else int(m.value.reshape(-1)[0])
            return (n.key.extra_key, self.spath(n), f.lock_ref, m.lock_ref, mv, ids(f.value))

        return tree_rows(self.core.root_node, row)

    def compare(self, what: str) -> None:
        o, t, CT = self.ours, self.theirs, self.CT
        self.eq(f"{what}: full available", self.oa.available_size(), self.sa.available_size())
        self.eq(f"{what}: mamba available", self.om.available_size(), self.spool.mamba_allocator.available_size())
        self.eq(f"{what}: sizes", (o.full_evictable_size(), o.full_protected_size(), o.mamba_evictable_size(),
                                   o.mamba_protected_size()),
                (t.full_evictable_size(), t.full_protected_size(), t.mamba_evictable_size(),
                 t.mamba_protected_size()))
        self.eq_rows(f"{what}: trees", self._canon_ours(), self._canon_theirs())
        self.eq(f"{what}: mamba LRU order", [self.opath(n) for n in o.by_name["mamba"].lru], self.their_lru(CT.MAMBA))
        self.eq_leaves(what)
        self.checker.check([r for r, _ in self.live])

    def evict(self, n: int, mn: int) -> None:
        self.log.append(f"evict({n}, mamba_num={mn})")
        r = self.ours.evict(n, mamba_num=mn)
        s = self.theirs.evict(self.sg.EvictParams(num_tokens=n, mamba_num=mn))
        self.eq("evict result", (r.num_tokens_evicted, r.mamba_num_evicted), (s.num_tokens_evicted,
                                                                              s.mamba_num_evicted))
        self.compare("evict")

    def insert(self, key, extra) -> None:
        n = len(key) // self.ps * self.ps
        if n == 0:
            return
        if self.oa.available_size() < n:
            self.evict(n, 0)
        if self.om.available_size() < 1:
            self.evict(0, 1)
        if self.oa.available_size() < n or self.om.available_size() < 1:
            return
        self.log.append(f"insert {key[:n]} extra={extra}")
        o = self.oa.alloc(n)
        s = self.sa.alloc(n)
        self.pair_slots(o, s)
        om = self.om.alloc(1)
        sm = self.spool.mamba_allocator.alloc(1)
        self.mpair[om] = sm
        r = self.ours.insert(RadixKey(key[:n], extra), o, mamba_value=om)
        sr = self.theirs.insert(self.sg.InsertParams(key=self.sg.RadixKey(list(key[:n]), extra), value=s,
                                                     mamba_value=sm))
        self.eq("insert", (r.prefix_len, r.mamba_exist), (sr.prefix_len, sr.mamba_exist))
        if r.mamba_exist:  # the caller's state slot was not taken
            self.om.free(om)
            self.spool.mamba_allocator.free(sm)
        self.compare("insert")

    def match(self, key, extra, hold: bool) -> None:
        sg = self.sg
        self.log.append(f"match {key} extra={extra} hold={hold}")
        m = self.ours.match_prefix(RadixKey(key, extra))
        sm = self.theirs.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey(list(key), extra)))
        self.eq("match slots", self.mapped(m.device_indices), sm.device_indices.tolist())
        self.eq("match last node", self.opath(m.last_device_node), self.spath(self.snode(sm.last_device_node)))
        self.eq("match branching", m.mamba_branching_seqlen, sm.mamba_branching_seqlen)
        if hold and m.last_device_node is not self.ours.root_node:
            self.hold(m.last_device_node, sm.last_device_node)
        self.compare("match")

    def stems(self) -> list[list[int]]:
        rng, ps = self.rng, self.ps
        return [[rng.randrange(4) for _ in range(rng.randrange(ps, 12 * ps))] for _ in range(4)]

    def run(self, n_ops: int, *args) -> Harness:
        return super().run(n_ops, self.stems())

    def operation(self, bases) -> None:
        rng = self.rng
        ps = self.ps
        base = rng.choice(bases)
        key = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, 2 * ps))]
        extra = "x" if rng.random() < 0.1 else None
        r = rng.random()
        if r < 0.35:
            self.insert(key, extra)
        elif r < 0.65:
            self.match(key, extra, hold=rng.random() < 0.35)
        elif r < 0.8 and self.held:
            self.release_held(rng.randrange(len(self.held)))
        else:
            self.evict(rng.choice([0, 0, 1, ps, 3 * ps, 40]), rng.choice([0, 1, 2, 5]))

    def drain(self) -> None:
        while self.held:
            self.release_held(0)
        self.evict(self.size, 10**6)
        self.eq("drained", (self.oa.available_size(), self.ours.mamba_evictable_size()), (self.size, 0))


MAMBA_CONFIGS = [
    # page_size, full pool, state slots, chunk
    (1, 96, 10, 2),
    (1, 160, 24, 4),
    (4, 256, 12, 4),
    (4, 384, 24, 8),
]


def run_mamba(sg, ps, size, mamba_size, chunk, seed, ops=OPS, backend="unified"):
    diff = MambaDiff(sg, page_size=ps, size=size, mamba_size=mamba_size, chunk=chunk, seed=seed, backend=backend)
    return diff.run(ops)


@pytest.mark.parametrize("backend", ["unified", "mamba"])
@pytest.mark.parametrize("ps, size, mamba_size, chunk", MAMBA_CONFIGS)
def test_unified_full_mamba_matches_sglang(sgm, ps, size, mamba_size, chunk, backend):
    for seed in range(SEEDS):
        run_mamba(sgm, ps, size, mamba_size, chunk, seed, backend=backend)


class MambaReqDiff(MambaDiff):
    """(full, mamba) with requests at page size 1: admission with SGLang's copy-on-write match, chunked
    prefill (``cache_unfinished_req`` donates a copy of the state), decode, finish (the request's own
    state goes to the tree unless one is there).  State slots the caches take themselves are paired
    by tree position after each operation; the state pools' free sizes must still agree."""

    max_base = 14  # prompt stems: up to this many tokens

    def __init__(self, sg, **kw):
        super().__init__(sg, **kw)
        self.rid = 0

    def pair_states(self) -> None:
        theirs = {}
        for n in iter_subtree(self.core.root_node):
            v = n.component_data[self.CT.MAMBA].value
            if v is not None:
                theirs[(n.key.extra_key, self.spath(n))] = int(v.reshape(-1)[0])
        for n in iter_subtree(self.ours.root_node):
            if n.mamba_value is not None and int(self.mpair[int(n.mamba_value[0])]) == -1:
                t = theirs.get((n.extra_key, self.opath(n)))
                if t is not None:
                    self.mpair[int(n.mamba_value[0])] = t

    def compare(self, what: str) -> None:
        self.pair_states()
        super().compare(what)
        for req, sreq in self.live:
            self.eq(f"{what}: {req.rid} protected", req.kv.cache_protected_len, sreq.kv.cache_protected_len)

    def room(self, tokens: int) -> bool:
        if self.om.available_size() < 3:
            self.evict(0, 3)
        if self.oa.available_size() < tokens:
            self.evict(tokens, 0)
        return self.om.available_size() >= 3 and self.oa.available_size() >= tokens

    def admit(self, prompt, extra) -> None:
        sg = self.sg
        if len(self.live) >= 3 or not self.room(len(prompt)):
            return
        self.rid += 1
        rid = f"r{self.rid}"
        req = Req(rid, list(prompt), extra_key=extra)
        sreq = sg.SGReq(rid, list(prompt), extra_key=extra)
        key = prompt[:-1]
        self.log.append(f"admit {rid} {prompt} extra={extra}")
        m = self.ours.match_request(req, RadixKey(key, extra))
        sm = self.theirs.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey(list(key), extra), cow_mamba=True,
                                                           req=sreq))
        self.eq("admit match", self.mapped(m.device_indices), sm.device_indices.tolist())
        self.eq("admit branching", m.mamba_branching_seqlen, sm.mamba_branching_seqlen)
        n = int(m.device_indices.numel())
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        sreq.prefix_indices, sreq.last_node = sm.device_indices, sm.last_device_node
        sreq.mamba_branching_seqlen = sm.mamba_branching_seqlen  # as SGLang's scheduler notes it
        req.lock = self.ours.inc_lock_ref(req.last_node)
        res = self.theirs.inc_lock_ref(sreq.last_node)
        sreq.swa_uuid_for_lock, sreq.skip_lock_node_ids = res.swa_uuid_for_lock, res.skip_lock_node_ids
        assert self.ours.req_to_token_pool.alloc([req]) is not None
        assert self.spool.alloc([sreq]) is not None
        self.mpair[int(req.kv.components["mamba"].mamba_pool_idx)] = int(sreq.kv.mamba_pool_idx)
        if n:
            self.ours.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n] = m.device_indices.to(torch.int32)
            self.spool.req_to_token[sreq.kv.req_pool_idx, :n] = sm.device_indices.to(torch.int32)
        req.kv.cache_protected_len = sreq.kv.cache_protected_len = n
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n
        sreq.kv.kv_committed_len = sreq.kv.kv_allocated_len = n
        self.live.append((req, sreq))
        self.compare(f"admit {rid}")

    def grow(self, req, sreq, end: int) -> bool:
        start = req.kv.kv_allocated_len
        if end <= start:
            return True
        if not self.room(end - start):
            return False
        self.place_slots(req, sreq, self.oa.alloc(end - start), self.sa.alloc(end - start), start, end,
                         self.spool.req_to_token)
        return True

    def step(self, i: int) -> None:
        req, sreq = self.live[i]
        total = len(req.origin_input_ids)
        if req.kv.kv_committed_len < total:
            end = min(total, req.kv.kv_committed_len + self.rng.choice([1, 3, 5, 100]))
            self.log.append(f"prefill {req.rid} -> {end}")
            if not self.grow(req, sreq, end):
                return
            kvcore.cache_unfinished_req(req, self.ours, chunked=end < total)
            self.theirs.cache_unfinished_req(sreq, chunked=end < total)
            self.eq("prefix_indices", self.mapped(req.prefix_indices), sreq.prefix_indices.tolist())
            self.compare(f"prefill {req.rid}")
            return
        tok = self.rng.randrange(4)
        req.output_ids.append(tok)
        sreq.output_ids.append(tok)
        self.log.append(f"decode {req.rid} {tok}")
        if not self.grow(req, sreq, req.kv.kv_committed_len + 1):
            req.output_ids.pop()
            sreq.output_ids.pop()
            return
        self.compare(f"decode {req.rid}")

    def finish(self, i: int, is_insert: bool) -> None:
        req, sreq = self.live.pop(i)
        self.log.append(f"finish {req.rid} insert={is_insert}")
        if req.kv.kv_allocated_len == 0:  # admitted with no prefix, never ran: the abort path
            self.ours.dec_lock_ref(req.last_node, req.lock)
            self.ours.req_to_token_pool.free(req)
            self.theirs.dec_lock_ref(sreq.last_node, self.dec_params(sreq))
            self.spool.mamba_allocator.free(sreq.kv.mamba_pool_idx.unsqueeze(-1))
            sreq.kv.mamba_pool_idx = None
            self.spool.free(sreq)
            self.compare(f"abort {req.rid}")
            return
        kvcore.release_kv_cache(req, self.ours, is_insert)
        self.theirs.cache_finished_req(sreq, is_insert, kv_len_to_handle=sreq.kv.kv_committed_len)
        self.spool.free(sreq)
        sreq.kv.kv_allocated_len = 0
        sreq.kv.mamba_pool_idx = None
        self.compare(f"finish {req.rid}")

    def stems(self) -> list[list[int]]:
        rng = self.rng
        return [[rng.randrange(4) for _ in range(rng.randrange(2, self.max_base))] for _ in range(4)]

    def operation(self, bases) -> None:
        rng = self.rng
        base = rng.choice(bases)
        key = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, 4))]
        extra = "x" if rng.random() < 0.1 else None
        r = rng.random()
        if r < 0.2 and len(key) >= 2:
            self.admit(key, extra)
        elif r < 0.55 and self.live:
            self.step(rng.randrange(len(self.live)))
        elif r < 0.62 and self.live:
            self.finish(rng.randrange(len(self.live)), rng.random() < 0.85)
        elif r < 0.75:
            self.match(key, extra, hold=rng.random() < 0.3)
        elif r < 0.85 and self.held:
            self.release_held(rng.randrange(len(self.held)))
        elif r < 0.93:
            self.evict(rng.choice([0, 0, 1, 3, 40]), rng.choice([0, 1, 2]))
        else:
            self.insert(key, extra)

    def drain(self) -> None:
        while self.live:
            self.finish(0, True)
        while self.held:
            self.release_held(0)
        self.evict(self.size, 10**6)
        self.eq("drained", (self.oa.available_size(), self.ours.mamba_evictable_size()), (self.size, 0))


@pytest.mark.parametrize("backend", ["unified", "mamba"])
@pytest.mark.parametrize("size, mamba_size, chunk", [(160, 24, 2), (200, 32, 4)])
def test_unified_full_mamba_requests_match_sglang(sgm, size, mamba_size, chunk, backend):
    for seed in range(SEEDS):
        MambaReqDiff(sgm, page_size=1, size=size, mamba_size=mamba_size, chunk=chunk, seed=seed,
                     backend=backend).run(OPS)


class MambaReqDiffPaged(MambaReqDiff):
    """(full, mamba) with requests at page size > 1: SGLang's extra-buffer mode.

    Every request holds its own state slot and two ping-pong tracking slots (paired with
    SGLang's at admission); the test plays SGLang's scheduler for SGLang's side (``s_track``:
    a prefill extend of at least one chunk tracks at ``start + L // chunk * chunk`` or at the
    branching point inside it, a decode step reaching a multiple of ``lcm(chunk, page,
    interval)`` tracks there) and calls kvcore's ``track_mamba_state`` after each forward.
    Full slots come from ``alloc_extend`` on both sides; the tracking fields are compared too.
    """

    max_base = 48

    def __init__(self, sg, *, track_interval: int, **kw):
        super().__init__(sg, track_interval=track_interval, **kw)
        self.dgrid = math.lcm(self.chunk, self.ps, track_interval)
        self.skips = 0

    def pair_req_states(self) -> None:
        for req, sreq in self.live:
            comp, sk = req.kv.components["mamba"], sreq.kv
            if comp.mamba_pool_idx is not None and sk.mamba_pool_idx is not None:
                self.mpair[int(comp.mamba_pool_idx)] = int(sk.mamba_pool_idx)
            if comp.mamba_ping_pong_track_buffer is not None and sk.mamba_ping_pong_track_buffer is not None:
                for a, b in zip(comp.mamba_ping_pong_track_buffer.tolist(), sk.mamba_ping_pong_track_buffer.tolist()):
                    self.mpair[int(a)] = int(b)

    def compare(self, what: str) -> None:
        self.pair_req_states()
        super().compare(what)
        for req, sreq in self.live:
            comp, sk = req.kv.components["mamba"], sreq.kv
            for f in ("mamba_next_track_idx", "mamba_last_track_idx", "mamba_last_track_seqlen"):
                self.eq(f"{what}: {req.rid}.{f}", getattr(comp, f), getattr(sk, f))
            ours = [int(self.mpair[int(x)]) for x in comp.mamba_ping_pong_track_buffer.tolist()]
            self.eq(f"{what}: {req.rid} ping-pong", ours, sk.mamba_ping_pong_track_buffer.tolist())

    def room(self, tokens: int) -> bool:
        pages = -(-tokens // self.ps) * self.ps
        if self.om.available_size() < 3:
            self.evict(0, 3)
        if self.oa.available_size() < pages:
            self.evict(pages, 0)
        return self.om.available_size() >= 3 and self.oa.available_size() >= pages

    def grow(self, req, sreq, end: int) -> bool:
        start = req.kv.kv_allocated_len
        if end <= start:
            return True
        p = self.ps
        if not self.room(((end + p - 1) // p - (start + p - 1) // p) * p):
            return False
        t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        out = []
        for a, rows, k in ((self.oa, self.ours.req_to_token_pool.req_to_token, req.kv),
                           (self.sa, self.spool.req_to_token, sreq.kv)):
            last = int(rows[k.req_pool_idx, start - 1]) if start else -1
            out.append(a.alloc_extend(t(start), t(start), t(end), t(end), t(last), end - start))
        o, s = out
        assert o is not None and s is not None
        self.place_slots(req, sreq, o, s, start, end, self.spool.req_to_token)
        return True

    def s_track(self, sreq, start: int, end: int, prefill: bool) -> None:
        self.sg.track_like_scheduler(sreq, self.spool, start, end, prefill=prefill, chunk=self.chunk,
                                     decode_grid=self.dgrid)

    def step(self, i: int) -> None:
        req, sreq = self.live[i]
        total = len(req.origin_input_ids)
        start = req.kv.kv_committed_len
        ps = self.ps
        if start < total:
            end = min(total, start + self.rng.choice([ps, 2 * ps, 3 * ps, 100]))
            self.log.append(f"prefill {req.rid} -> {end}")
            if not self.grow(req, sreq, end):
                return
            self.ours.track_mamba_state(req)
            self.s_track(sreq, start, end, True)
            chunked = end < total
            kvcore.cache_unfinished_req(req, self.ours, chunked=chunked)
            sk = sreq.kv
            if (self.spool.mamba_allocator.available_size() or self.theirs.mamba_evictable_size()
                    or sk.mamba_last_track_seqlen is None):
                self.theirs.cache_unfinished_req(sreq, chunked=chunked)
            else:
                # Every state is held or locked: SGLang asserts; kvcore leaves the snapshot uncached.
                self.log.append("  (no state slot: snapshot skipped)")
                self.skips += 1
                sreq.prefix_indices = self.spool.req_to_token[sk.req_pool_idx, :end].to(torch.int64)
            self.eq("prefix_indices", self.mapped(req.prefix_indices), sreq.prefix_indices.tolist())
            self.compare(f"prefill {req.rid}")
            return
        if start + 1 >= 256:
            return
        tok = self.rng.randrange(4)
        req.output_ids.append(tok)
        sreq.output_ids.append(tok)
        self.log.append(f"decode {req.rid} {tok}")
        if not self.grow(req, sreq, start + 1):
            req.output_ids.pop()
            sreq.output_ids.pop()
            return
        self.ours.track_mamba_state(req)
        self.s_track(sreq, start, start + 1, False)
        self.compare(f"decode {req.rid}")

    def finish(self, i: int, is_insert: bool) -> None:
        req, sreq = self.live[i]
        if req.kv.kv_allocated_len == 0:  # never ran: the abort path
            self.live.pop(i)
            self.log.append(f"abort {req.rid}")
            self.ours.dec_lock_ref(req.last_node, req.lock)
            self.ours.req_to_token_pool.free(req)
            self.theirs.dec_lock_ref(sreq.last_node, self.dec_params(sreq))
            self.spool.free_mamba_cache(sreq)
            self.spool.free(sreq)
            self.compare(f"abort {req.rid}")
            return
        self.live.pop(i)
        self.log.append(f"finish {req.rid} insert={is_insert}")
        kvcore.release_kv_cache(req, self.ours, is_insert)
        self.theirs.cache_finished_req(sreq, is_insert, kv_len_to_handle=sreq.kv.kv_committed_len)
        self.spool.free(sreq)
        sreq.kv.kv_allocated_len = 0
        self.eq(f"finish {req.rid}: record holds no state", self.ours.request_state_slots(req.kv), 0)
        self.compare(f"finish {req.rid}")


@pytest.mark.parametrize("size, mamba_size, chunk, interval", [(256, 16, 4, 4), (384, 30, 8, 16), (160, 12, 4, 8)],
                         ids=["tight", "roomy", "scarce"])
@pytest.mark.parametrize("backend", ["unified", "mamba"])
def test_unified_full_mamba_paged_requests_match_sglang(sgm, size, mamba_size, chunk, interval, backend):
    """Page size 4 requests (SGLang's extra-buffer mode) against SGLang's own UnifiedRadixCache."""
    for seed in range(SEEDS):
        MambaReqDiffPaged(sgm, page_size=4, size=size, mamba_size=mamba_size, chunk=chunk, seed=seed,
                          track_interval=interval, backend=backend).run(OPS)

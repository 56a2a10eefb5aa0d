"""Differential check of kvcore-mamba against SGLang 0.5.19's own ``MambaRadixCache``.

Seeded random operation sequences run through SGLang's ``MambaRadixCache`` on a real
``HybridReqToTokenPool`` / ``MambaPool`` / ``TokenToKVPoolAllocator`` (loaded from source
with ``tools/sglang_mamba_shim.py``, on CPU) and through ``kvcore.create_cache("mamba")``,
side by side (the harness base is ``tools/differential.py``), through the same public calls:

* requests: admission (``match_prefix(cow_mamba=True, req=...)``, lock, row and state
  slot, the copy-on-write or the clear of the state, done by the test as SGLang's
  scheduler does), prefill chunks with ``cache_unfinished_req``, decode steps, finish with
  and without insert (``cache_finished_req``); every "forward" writes a value into the
  request's state so that copies can be checked;
* ``match_prefix`` probes (optionally locked and released later), ``insert`` of raw keys
  with fresh slots and a fresh state, ``evict(num_tokens, mamba_num)``.

After every operation: every answer (matched slots, branching point, COW source and
destination slots, insert ``prefix_len`` / ``mamba_exist``, both evict counts), the four
sizes, both free lists in order (full slots, state slots), the whole tree (keys, slots,
states, both lock counts), both LRU orders, every live record (lengths, state slot, row)
and the full state tensors (conv and temporal) must be identical; then kvcore's
invariant checker and both sanity checks run.

Page size 4 runs SGLang's extra-buffer mode on both sides (``enable_mamba_extra_buffer``,
overlap on: two ping-pong slots per request, a paged allocator, allocations through
``alloc_extend``).  The test plays SGLang's scheduler for SGLang's side (``s_track``: the
tracking decision of each forward, after ``_mamba_radix_cache_v2_req_prepare_for_extend`` and
``_mamba_prefix_cache_update``) and calls kvcore's ``track_mamba_state`` after each forward;
the ping-pong buffers, both track indices and ``mamba_last_track_seqlen`` are compared too.
Chunk sizes are whole pages there, as SGLang's chunked prefill is.

Runs when SGLang's source is found (``$KVCORE_SGLANG_SRC``, else ``/tmp/sgl/src``) and its
classes load; skips otherwise.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey, Req, create_cache
from tools.differential import (
    Harness,
    load_or_skip,
    lru_order,
    our_free_pages,
    path_tokens,
    sglang_free_pages,
    tree_rows,
)
from tools.sglang_mamba_shim import default_src, load_sglang_mamba

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")
OPS = int(os.environ.get("KVCORE_DIFF_OPS", "250"))


@pytest.fixture(scope="module")
def sg():
    return load_or_skip(load_sglang_mamba, SRC, "MambaRadixCache")


class Pair(Harness):
    """kvcore-mamba's cache and SGLang's MambaRadixCache driven in lockstep."""

    log_tail = 12

    def __init__(self, sg, *, size: int, mamba_size: int, rows: int, width: int, chunk: int, seed: int,
                 page: int = 1, track_interval: int = 256):
        super().__init__(sg, seed=seed)
        self.page = page
        self.extra = page > 1  # SGLang's extra-buffer mode
        self.chunk = chunk
        self.dgrid = math.lcm(chunk, page, track_interval)
        self.ours = create_cache("mamba", size=size, max_num_reqs=rows, max_context_len=width, page_size=page,
                                 mamba_size=mamba_size, mamba_cache_chunk_size=chunk,
                                 mamba_track_interval=track_interval)
        self.sa = sg.make_allocator(size, page)
        self.spool = sg.make_hybrid_pool(rows, mamba_size, width, extra_buffer=self.extra)
        self.theirs = sg.make_mamba_cache(self.sa, self.spool, chunk, page_size=page, extra_buffer=self.extra)
        self.oa = self.ours.token_to_kv_pool_allocator
        self.otp = self.ours.req_to_token_pool
        self.checker = InvariantChecker(self.ours)
        self.live: list[tuple[Req, object]] = []
        self.held: list[tuple[object, object, object]] = []
        self.inserted: list[tuple[list[int], object]] = []
        self.counter = 0
        self.stats = {"cow": 0, "mamba_exist": 0, "mamba_evicted": 0, "full_evicted": 0, "tombstones": 0}

    # ------------------------------------------------------------------ comparison
    def opath(self, node):
        return None if node is None else (node.extra_key, path_tokens(node, self.ours.root_node))

    def spath(self, node):
        if node is None:
            return None
        root = self.theirs.root_node
        return (None if node is root else node.key.extra_key, path_tokens(node, root, lambda k: k.token_ids))

    @staticmethod
    def _mv(v):
        return None if v is None else [int(x) for x in v.reshape(-1).tolist()]

    def _canon(self, root, path_of, extra_of, lock_of) -> list:
        return tree_rows(root, lambda n: (extra_of(n), path_of(n), tuple(int(x) for x in n.value.tolist()),
                                          self._mv(n.mamba_value), lock_of(n), n.mamba_lock_ref))

    def _lru_ours(self, lru) -> list:
        return [self.opath(n) for n in lru]

    def _lru_theirs(self, lru) -> list:
        return [self.spath(x) for x in lru_order(lru.head, lru.tail, lambda n: getattr(n, lru.prv))]

    def compare(self, what: str) -> None:
        o, t = self.ours, self.theirs
        for name in ("full_evictable_size", "full_protected_size", "mamba_evictable_size", "mamba_protected_size"):
            self.eq(f"{what}: {name}", getattr(o, name)(), getattr(t, name)())
        self.eq(f"{what}: full free list", our_free_pages(self.oa), sglang_free_pages(self.sa, with_released=True))
        self.eq(f"{what}: state free list", o.mamba_allocator.free_slots().tolist(),
                self.spool.mamba_allocator.free_slots.tolist())
        co = self._canon(o.root_node, lambda n: self.opath(n)[1], lambda n: n.extra_key, lambda n: n.lock_ref)
        ct = self._canon(t.root_node, lambda n: self.spath(n)[1], lambda n: n.key.extra_key, lambda n: n.full_lock_ref)
        self.stats["tombstones"] += sum(1 for n in co if n[3] is None)
        self.eq_rows(f"{what}: trees", co, ct)
        self.eq(f"{what}: full LRU order", self._lru_ours(o.full_lru_list), self._lru_theirs(t.full_lru_list))
        self.eq(f"{what}: mamba LRU order", self._lru_ours(o.mamba_lru_list), self._lru_theirs(t.mamba_lru_list))
        for req, sreq in self.live:
            ok, sk = req.kv, sreq.kv
            for f in ("cache_protected_len", "kv_committed_len", "kv_allocated_len"):
                self.eq(f"{what}: {req.rid}.kv.{f}", getattr(ok, f), getattr(sk, f))
            comp = ok.components["mamba"]
            self.eq(f"{what}: {req.rid} state slot", self._mv(comp.mamba_pool_idx), self._mv(sk.mamba_pool_idx))
            if self.extra:
                self.eq(f"{what}: {req.rid} ping-pong", self._mv(comp.mamba_ping_pong_track_buffer),
                        self._mv(sk.mamba_ping_pong_track_buffer))
                for f in ("mamba_next_track_idx", "mamba_last_track_idx", "mamba_last_track_seqlen"):
                    self.eq(f"{what}: {req.rid}.{f}", getattr(comp, f), getattr(sk, f))
            n = ok.kv_allocated_len
            self.eq(f"{what}: {req.rid} row", self.otp.req_to_token[ok.req_pool_idx, :n].tolist(),
                    self.spool.req_to_token[sk.req_pool_idx, :n].tolist())
            self.eq(f"{what}: {req.rid}.last_node", self.opath(req.last_node), self.spath(sreq.last_node))
        oc, sc = o.mamba_pool.mamba_cache, self.spool.mamba_pool.mamba_cache
        for i, (a, b) in enumerate(zip(oc.conv, sc.conv)):
            if not torch.equal(a, b):
                self.fail(f"{what}: conv state {i} differs at slots "
                          f"{(a != b).flatten(2).any(-1).any(0).nonzero().flatten().tolist()}")
        if not torch.equal(oc.temporal, sc.temporal):
            self.fail(f"{what}: temporal state differs at slots "
                      f"{(oc.temporal != sc.temporal).flatten(2).any(-1).any(0).nonzero().flatten().tolist()}")
        self.checker.check(owners=[r for r, _ in self.live])
        o.sanity_check()
        t.sanity_check()

    # ------------------------------------------------------------------ model stand-in
    def forward(self, req: Req, sreq) -> None:
        """The 'forward pass': write a value derived from the request's length into its state, both sides."""
        val = float((hash(req.rid) % 997) + req.kv.kv_committed_len)
        for pool, slot in ((self.ours.mamba_pool, req.kv.components["mamba"].mamba_pool_idx),
                           (self.spool.mamba_pool, sreq.kv.mamba_pool_idx)):
            idx = slot.reshape(1).to(torch.int64)
            for c in pool.mamba_cache.conv:
                c[:, idx] = val
            pool.mamba_cache.temporal[:, idx] = val + 0.5

    def s_track(self, sreq, start: int, end: int, prefill: bool) -> None:
        """SGLang's scheduler's tracking decision of one forward (``sg.track_like_scheduler``).

        The kernel's snapshot write is stood in for by copying the running state into the
        tracked slot before the next ``cache_*_req`` (when kvcore, which has no forward, takes
        its snapshot too).
        """
        if self.sg.track_like_scheduler(sreq, self.spool, start, end, prefill=prefill, chunk=self.chunk,
                                        decode_grid=self.dgrid):
            sk = sreq.kv
            dst = sk.mamba_ping_pong_track_buffer[sk.mamba_last_track_idx].reshape(1)
            self.spool.mamba_pool.copy_from(sk.mamba_pool_idx.reshape(1), dst)

    def s_snapshot(self, sreq) -> None:
        pass  # the snapshot is written at tracking time (s_track), as SGLang's kernel does

    def alloc_range(self, kv, sk, start: int, end: int):
        if self.page == 1:
            return self.oa.alloc(end - start), self.sa.alloc(end - start)
        t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        out = []
        for a, r2t, k in ((self.oa, self.otp, kv), (self.sa, self.spool, sk)):
            last = int(r2t.req_to_token[k.req_pool_idx, start - 1]) if start else -1
            out.append(a.alloc_extend(t(start), t(start), t(end), t(end), t(last), end - start))
        return out[0], out[1]

    def ensure_full(self, n: int) -> bool:
        short = n - self.oa.available_size()
        if short > 0:
            res = self.ours.evict(short)
            sres = self.theirs.evict(self.sg.EvictParams(num_tokens=short))
            self.eq("evict for room", res.num_tokens_evicted, sres.num_tokens_evicted)
        return self.oa.available_size() >= n

    # ------------------------------------------------------------------ operations
    def admit(self, prompt: list[int], extra) -> None:
        self.counter += 1
        rid = f"r{self.counter}"
        req = Req(rid, prompt, extra_key=extra)
        sreq = self.sg.SGReq(rid, prompt, extra_key=extra)
        key = prompt[: len(prompt) - 1]
        need_states = 3 if self.extra else 1
        if self.spool.mamba_allocator.available_size() + self.theirs.mamba_evictable_size() < need_states + 1:
            # No state slot to be had even by eviction: SGLang's scheduler admits nothing (its match asserts).
            return
        self.log.append(f"admit {rid} len={len(prompt)} extra={extra}")
        m = self.ours.match_prefix(RadixKey(key, extra), cow_mamba=True, req=req)
        sm = self.theirs.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(key, extra), cow_mamba=True,
                                                                req=sreq))
        self.eq(f"admit {rid}: matched slots", m.device_indices.tolist(), sm.device_indices.tolist())
        self.eq(f"admit {rid}: branching", m.mamba_branching_seqlen, sm.mamba_branching_seqlen)
        self.eq(f"admit {rid}: last node", self.opath(m.last_device_node), self.spath(sm.last_device_node))
        comp = req.kv.components.get("mamba")
        self.eq(f"admit {rid}: cow dst", self._mv(comp.mamba_pool_idx if comp else None),
                self._mv(sreq.kv.mamba_pool_idx))
        self.eq(f"admit {rid}: cow src", self._mv(comp.mamba_cow_src_index if comp else None),
                self._mv(sreq.kv.mamba_cow_src_index))
        self.ours.inc_lock_ref(m.last_device_node)
        self.theirs.inc_lock_ref(sm.last_device_node)
        req.last_node, sreq.last_node = m.last_device_node, sm.last_device_node
        need = (0 if sreq.kv.holds_mamba else 1) + (2 if self.extra else 0)
        short = need - self.spool.mamba_allocator.available_size()
        if short > 0:
            # SGLang's scheduler makes room for fresh states before the row is taken.
            r = self.ours.evict(0, mamba_num=short)
            sr = self.theirs.evict(self.sg.EvictParams(mamba_num=short))
            self.eq(f"admit {rid}: state eviction", r.mamba_num_evicted, sr.mamba_num_evicted)
        if self.otp.available_size() == 0 or need > self.spool.mamba_allocator.available_size():
            self.log.append(f"  {rid} cancelled (no row or state)")
            self.ours.dec_lock_ref(req.last_node)
            self.theirs.dec_lock_ref(sreq.last_node)
            if sreq.kv.holds_mamba:
                self.ours.req_to_token_pool.free_mamba_cache(req.kv)
                self.spool.mamba_allocator.free(sreq.kv.mamba_pool_idx.unsqueeze(-1))
                sreq.kv.mamba_pool_idx = None
            self.compare(f"cancel {rid}")
            return
        assert self.otp.alloc([req]) is not None
        assert self.spool.alloc([sreq]) is not None
        # The deferred copy-on-write (or clear) the scheduler runs before the forward.
        if sreq.kv.mamba_cow_src_index is not None:
            self.stats["cow"] += 1
            self.ours.mamba_pool.copy_from(comp.mamba_cow_src_index, comp.mamba_pool_idx.reshape(1))
            self.spool.mamba_pool.copy_from(sreq.kv.mamba_cow_src_index, sreq.kv.mamba_pool_idx.unsqueeze(0))
            comp.mamba_cow_src_index = None
            sreq.kv.mamba_cow_src_index = None
        elif sreq.kv.mamba_needs_clear:
            self.spool.mamba_pool.clear_slots(sreq.kv.mamba_pool_idx.unsqueeze(0))
        sreq.kv.mamba_needs_clear = False
        plen = m.prefix_len
        for kv, r2t, idx in ((req.kv, self.otp, m.device_indices), (sreq.kv, self.spool, sm.device_indices)):
            kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = plen
            if plen:
                r2t.write((kv.req_pool_idx, slice(0, plen)), idx.to(torch.int32))
        sreq.prefix_indices = sm.device_indices
        sreq.mamba_branching_seqlen = sm.mamba_branching_seqlen
        self.live.append((req, sreq))
        self.compare(f"admit {rid}")

    def step(self, i: int) -> None:
        req, sreq = self.live[i]
        kv, sk = req.kv, sreq.kv
        total = len(req.fill_ids)
        if kv.kv_committed_len < total:
            sizes = [3, 5, 8, 13, 40] if self.page == 1 else [self.page, 2 * self.page, 3 * self.page, 40]
            end = min(total, kv.kv_committed_len + self.rng.choice(sizes))
            chunked = end < total
            self.log.append(f"extend {req.rid} to {end}{' (chunk)' if chunked else ''}")
        else:
            if total + 1 >= self.otp.max_context_len:
                return
            end = kv.kv_committed_len + 1
            tok = self.rng.randrange(6)
            self.log.append(f"decode {req.rid} tok={tok}")
        start = kv.kv_allocated_len
        p = self.page
        n = ((end + p - 1) // p - (start + p - 1) // p) * p if p > 1 else end - start
        if not self.ensure_full(n):
            self.log.append("  (no room)")
            self.compare("no room")
            return
        prefill = kv.kv_committed_len < total
        slots, sslots = self.alloc_range(kv, sk, start, end)
        self.eq(f"{req.rid}: new slots", slots.tolist(), sslots.tolist())
        self.otp.write((kv.req_pool_idx, slice(start, end)), slots.to(torch.int32))
        self.spool.write((sk.req_pool_idx, slice(start, end)), sslots.to(torch.int32))
        if kv.kv_committed_len >= len(req.fill_ids):
            req.output_ids.append(tok)
            sreq.output_ids.append(tok)
        for k in (kv, sk):
            k.kv_allocated_len = k.kv_committed_len = end
        self.forward(req, sreq)
        if self.extra:
            # The scheduler's tracking decision around this forward, both sides.
            self.ours.track_mamba_state(req)
            self.s_track(sreq, start, end, prefill)
        if kv.kv_committed_len <= len(req.origin_input_ids) and (end < total or self.rng.random() < 0.5):
            # A prefill chunk (or a finished prompt, as SGLang's scheduler caches it).
            chunked = end < total
            self.ours.cache_unfinished_req(req, chunked=chunked)
            self.s_snapshot(sreq)
            if (self.spool.mamba_allocator.available_size() or self.theirs.mamba_evictable_size()
                    or (self.extra and sk.mamba_last_track_seqlen is None)):
                self.theirs.cache_unfinished_req(sreq, chunked=chunked)
            else:
                # Every state is held or locked: SGLang asserts ("Can not alloc mamba cache");
                # kvcore leaves the chunk uncached, as SGLang's own skip path does.
                self.log.append("  (no state slot: snapshot skipped)")
                self.stats["skips"] = self.stats.get("skips", 0) + 1
                sreq.prefix_indices = self.spool.req_to_token[sk.req_pool_idx, :end].to(torch.int64)
            self.eq(f"{req.rid}: prefix_indices", req.prefix_indices.tolist(), sreq.prefix_indices.tolist())
        self.compare(f"step {req.rid}")

    def finish(self, i: int, is_insert: bool) -> None:
        req, sreq = self.live.pop(i)
        self.log.append(f"finish {req.rid} insert={is_insert} committed={req.kv.kv_committed_len}")
        if req.kv.kv_allocated_len == 0:
            self.ours.dec_lock_ref(req.last_node)
            self.theirs.dec_lock_ref(sreq.last_node)
            self.otp.free(req)
            if self.extra:
                self.spool.free_mamba_cache(sreq)
            else:
                self.spool.mamba_allocator.free(sreq.kv.mamba_pool_idx.unsqueeze(-1))
            sreq.kv.mamba_pool_idx = None
            self.spool.free(sreq)
        else:
            kvcore.release_kv_cache(req, self.ours, is_insert)
            if is_insert:
                self.s_snapshot(sreq)
            self.theirs.cache_finished_req(sreq, is_insert, kv_len_to_handle=sreq.kv.kv_committed_len)
            self.spool.free(sreq)
            # SGLang's Req.mark_kv_released: the record lets go of a donated state slot.
            sreq.kv.kv_allocated_len = 0
            sreq.kv.mamba_pool_idx = None
        self.eq(f"finish {req.rid}: record holds no state", req.kv.components["mamba"].mamba_pool_idx, None)
        self.compare(f"finish {req.rid}")

    def probe(self, key: list[int], extra, hold: bool) -> None:
        self.log.append(f"match {len(key)} tokens extra={extra} hold={hold}")
        m = self.ours.match_prefix(RadixKey(key, extra))
        sm = self.theirs.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(key, extra)))
        self.eq("match: slots", m.device_indices.tolist(), sm.device_indices.tolist())
        self.eq("match: branching", m.mamba_branching_seqlen, sm.mamba_branching_seqlen)
        self.eq("match: node", self.opath(m.last_device_node), self.spath(sm.last_device_node))
        if hold:
            lock = self.ours.inc_lock_ref(m.last_device_node)
            self.theirs.inc_lock_ref(sm.last_device_node)
            self.held.append((m.last_device_node, lock, sm.last_device_node))
        self.compare("match")

    def release(self, i: int) -> None:
        node, lock, snode = self.held.pop(i)
        self.log.append("release a held lock")
        self.ours.dec_lock_ref(node, lock)
        self.theirs.dec_lock_ref(snode)
        self.compare("release")

    def evict(self, n: int, mn: int) -> None:
        self.log.append(f"evict {n} tokens, {mn} states")
        r = self.ours.evict(n, mamba_num=mn)
        sr = self.theirs.evict(self.sg.EvictParams(num_tokens=n, mamba_num=mn))
        self.eq("evict: tokens", r.num_tokens_evicted, sr.num_tokens_evicted)
        self.eq("evict: states", r.mamba_num_evicted, sr.mamba_num_evicted)
        self.stats["mamba_evicted"] += r.mamba_num_evicted
        self.stats["full_evicted"] += r.num_tokens_evicted
        self.compare("evict")

    def insert(self, key: list[int], extra) -> None:
        key = key[: len(key) - len(key) % self.page]
        n = len(key)
        if not n or not self.ensure_full(n):
            return
        if self.spool.mamba_allocator.available_size() == 0:
            r = self.ours.evict(0, mamba_num=1)
            sr = self.theirs.evict(self.sg.EvictParams(mamba_num=1))
            self.eq("insert: state eviction", r.mamba_num_evicted, sr.mamba_num_evicted)
            if self.spool.mamba_allocator.available_size() == 0:
                return
        self.log.append(f"insert {n} tokens extra={extra}")
        self.inserted.append((key, extra))
        v, sv = self.oa.alloc(n), self.sa.alloc(n)
        mv, smv = self.ours.mamba_pool.alloc(1), self.spool.mamba_allocator.alloc(1)
        self.eq("insert: slots", (v.tolist(), mv.tolist()), (sv.tolist(), smv.tolist()))
        res = self.ours.insert(RadixKey(key, extra), v, mamba_value=mv)
        sres = self.theirs.insert(self.sg.InsertParams(key=self.sg.RadixKey(key, extra), value=sv, mamba_value=smv))
        self.eq("insert: prefix_len", res.prefix_len, sres.prefix_len)
        self.eq("insert: mamba_exist", res.mamba_exist, sres.mamba_exist)
        if res.mamba_exist:
            self.stats["mamba_exist"] += 1
            self.ours.mamba_pool.free(mv)
            self.spool.mamba_allocator.free(smv)
        self.compare("insert")

    # ------------------------------------------------------------------ driver
    def operation(self, stems: list[list[int]]) -> None:
        rng = self.rng
        width = self.otp.max_context_len
        r = rng.random()
        extra = rng.choice([None, None, None, "x"])
        stem = rng.choice(stems)
        if r < 0.22 and len(self.live) < self.otp.size:
            tail = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
            prompt = (stem + tail)[: width - 12]
            self.admit(prompt, extra)
        elif r < 0.55 and self.live:
            self.step(rng.randrange(len(self.live)))
        elif r < 0.68 and self.live:
            self.finish(rng.randrange(len(self.live)), rng.random() < 0.85)
        elif r < 0.78:
            tail = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
            self.probe(stem[: rng.randrange(len(stem) + 1)] + tail, extra, rng.random() < 0.3)
        elif r < 0.83 and self.held:
            self.release(rng.randrange(len(self.held)))
        elif r < 0.91:
            self.evict(rng.choice([0, 0, 1, 7, 30]), rng.choice([0, 1, 1, 2, 5]))
        elif self.inserted and rng.random() < 0.3:
            self.insert(*rng.choice(self.inserted))  # the same key again: mamba_exist
        else:
            tail = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
            self.insert(stem[: rng.randrange(1, len(stem) + 1)] + tail, extra)

    def drain(self) -> None:
        while self.live:
            self.finish(0, True)
        while self.held:
            self.release(0)
        self.evict(10**6, 10**6)
        self.eq("all full slots back", self.oa.available_size(), self.sa.available_size())


def _stems(rng: random.Random) -> list[list[int]]:
    base = [rng.randrange(4) for _ in range(40)]
    return [base[:24], base[:32] + [rng.randrange(4) for _ in range(8)], [rng.randrange(4) for _ in range(30)],
            base[:10]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size,mamba_size,chunk", [(512, 24, 8), (160, 7, 4)], ids=["roomy", "tight"])
def test_mamba_radix_cache_matches_sglang(sg, seed, size, mamba_size, chunk):
    pair = Pair(sg, size=size, mamba_size=mamba_size, rows=5, width=128, chunk=chunk, seed=seed)
    pair.run(OPS, _stems(random.Random(1000 + seed)))


def test_differential_exercises_cow_and_eviction(sg):
    """The seeded runs do reach the interesting paths (COW copies, state eviction, tombstones)."""
    totals = {"cow": 0, "mamba_exist": 0, "mamba_evicted": 0, "full_evicted": 0, "tombstones": 0}
    for seed in range(3):
        pair = Pair(sg, size=160, mamba_size=7, rows=5, width=128, chunk=4, seed=seed)
        pair.run(OPS, _stems(random.Random(1000 + seed)))
        for k in totals:
            totals[k] += pair.stats[k]
    assert all(v > 0 for v in totals.values()), totals


# ---------------------------------------------------------------------------- page size 4 (extra-buffer mode)

@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size,mamba_size,chunk,interval", [(512, 40, 8, 16), (192, 14, 4, 4)],
                         ids=["roomy", "tight"])
def test_mamba_extra_buffer_matches_sglang(sg, seed, size, mamba_size, chunk, interval):
    """Page size 4: SGLang's extra-buffer mode (ping-pong slots, tracked snapshots) against kvcore's."""
    pair = Pair(sg, size=size, mamba_size=mamba_size, rows=4, width=128, chunk=chunk, seed=seed, page=4,
                track_interval=interval)
    pair.run(OPS, _stems(random.Random(2000 + seed)))


def test_extra_buffer_differential_exercises_cow_and_eviction(sg):
    totals = {"cow": 0, "mamba_exist": 0, "mamba_evicted": 0, "full_evicted": 0, "tombstones": 0}
    for seed in range(3):
        pair = Pair(sg, size=192, mamba_size=14, rows=4, width=128, chunk=4, seed=seed, page=4, track_interval=4)
        pair.run(OPS, _stems(random.Random(2000 + seed)))
        for k in totals:
            totals[k] += pair.stats[k]
    assert all(v > 0 for v in totals.values()), totals

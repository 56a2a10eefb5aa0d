"""The request lifecycle both sliding-window differential harnesses drive (``swa-chunk``'s and the tree's).

SGLang's ``SWAChunkCache`` and its ``UnifiedRadixCache`` with (full, swa) components (what
kvcore's ``unified`` and ``swa`` answer as) sit on the same ``SWATokenToKVPoolAllocator`` and
take requests the same way:
admit (match, lock, row), chunked prefill with ``cache_unfinished_req``, decode with
``free_swa_out_of_window_slots`` and, past the window, ``dec_swa_lock_only``, finish
through ``cache_finished_req`` (SGLang's ``release_kv_cache`` less its Mamba and
speculative branches), plus tree probes (match, hold and release a lock, evict, insert
with a window cursor).  :class:`WindowHarness` runs that on both sides and compares every
answer; a subclass builds the two sides and says how to read its trees:

* ``compare(what)``: the sizes, pools and trees after each operation;
* ``opath`` / ``spath``: a node's path on each side; ``their_node``: SGLang's node from
  what its match returned (the unified tree answers with node ids); ``their_root``: its root;
* ``their_uuid(node)``: the window-lock id SGLang keeps on a node;
* ``ensure(need)``: make room on both sides before an allocation;
* ``their_evict(n, sn)``: SGLang's ``evict`` as ``(full, window)`` counts.
"""

from __future__ import annotations

from typing import Any

import torch

import kvcore
from kvcore import RadixKey, Req
from tools.differential import Harness

__all__ = ["WindowHarness", "prefill_chunk"]


def prefill_chunk(req: Req, plan: dict) -> tuple[int, int] | None:
    """The next prefill chunk ``[start, end)`` of a request planned with ``plan["chunk"]``; None once it is in."""
    total = len(req.origin_input_ids)
    start = req.kv.kv_allocated_len
    return (start, min(total, start + plan["chunk"])) if start < total else None


class WindowHarness(Harness):
    """Requests and tree probes on a (full, window) cache, SGLang's and kvcore's in lockstep."""

    tree = True  # a radix tree (False: a chunk cache, which keeps nothing)
    chunk = False  # SGLang's chunk cache frees the window at each prefill chunk

    def __init__(self, sg: Any, *, seed: Any, page_size: int, window: int, size: int, evict_floor: bool = False):
        super().__init__(sg, seed=seed, pair_size=size + page_size + 1)
        self.ps = page_size
        self.W = window
        self.size = size
        self.evict_floor = evict_floor
        self.live: list[tuple[Req, Any, dict]] = []  # (ours, theirs, plan)
        self.held: list[tuple[Any, Any, Any, Any]] = []  # (our node, lock, their node, their lock result)
        self.rid = 0
        self.sglang_window_leaks = 0  # window slots SGLang leaked under a floor (asserted exactly, then repaired)

    # ------------------------------------------------------------------ what a subclass says

    def spath(self, node: Any) -> Any:
        raise NotImplementedError

    def their_node(self, node: Any) -> Any:
        return node

    def their_uuid(self, node: Any) -> Any:
        raise NotImplementedError

    def ensure(self, need: int) -> bool:
        raise NotImplementedError

    def their_evict(self, n: int, sn: int) -> tuple[int, int]:
        s = self.theirs.evict(self.sg.EvictParams(num_tokens=n, swa_num_tokens=sn))
        return s.num_tokens_evicted, s.swa_num_tokens_evicted

    # ------------------------------------------------------------------ shared comparisons

    def eq_window_mapping(self, what: str) -> None:
        """Which full slots still own a window slot."""
        live_full = (self.oa.full_to_swa_index_mapping > 0).nonzero().flatten()
        ours_live = sorted(self.mapped(live_full))
        sm = self.sa.full_to_swa_index_mapping[:-1]
        theirs_live = sorted((sm > 0).nonzero().flatten().tolist())
        if ours_live != theirs_live:
            self.fail(f"{what}: full slots with a window slot differ: ours-only="
                      f"{sorted(set(ours_live) - set(theirs_live))} "
                      f"sglang-only={sorted(set(theirs_live) - set(ours_live))}")

    def _cmp_match(self, what: str, m: Any, sm: Any) -> None:
        self.eq(f"{what} length", int(m.device_indices.numel()), int(sm.device_indices.numel()))
        self.eq(f"{what} slots", self.mapped(m.device_indices), sm.device_indices.tolist())
        if self.tree:
            self.eq(f"{what} last node", self.opath(m.last_device_node),
                    self.spath(self.their_node(sm.last_device_node)))

    def _stop_path(self, node: Any, uuid: Any, root: Any, path_of: Any, uuid_of: Any) -> Any:
        if uuid is None:
            return None
        x = node
        while x is not root:
            if uuid_of(x) == uuid:
                return path_of(x)
            x = x.parent
        return "not on path"

    def _cmp_lock(self, what: str, onode: Any, lock: Any, snode: Any, res: Any) -> None:
        """Where the window lock stops on each side."""
        if not self.tree:
            return
        a = self._stop_path(onode, lock.stop, self.ours.root_node, self.opath, lambda n: n.swa_uuid)
        b = self._stop_path(snode, res.swa_uuid_for_lock, self.their_root(), self.spath, self.their_uuid)
        self.eq(f"{what}: window lock stop", a, b)

    def their_root(self) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ allocation

    def _pages(self, start: int, end: int) -> int:
        ps = self.ps
        return -(-end // ps) - (-(-start // ps))

    def alloc(self, req: Req, sreq: Any, end: int, decode: bool = False) -> bool:
        ok, sk = req.kv, sreq.kv
        start = ok.kv_allocated_len
        n = end - start
        ps = self.ps
        if not self.ensure(self._pages(start, end) * ps if ps > 1 else n):
            return False
        orow = self.ours.req_to_token_pool.req_to_token[ok.req_pool_idx]
        srow = self.srtp.req_to_token[sk.req_pool_idx]
        T = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        if ps == 1:
            o = self.oa.alloc(n)
            s = self.sa.alloc(n)
        elif decode:
            olast = int(orow[start - 1]) if start else -1
            slast = int(srow[start - 1]) if start else -1
            o = self.oa.alloc_decode([end], [end], [olast])
            s = self.sa.alloc_decode(torch.tensor([end]), torch.tensor([end]), torch.tensor([slast]))
        else:
            olast = int(orow[start - 1]) if start else -1
            slast = int(srow[start - 1]) if start else -1
            o = self.oa.alloc_extend([start], [start], [end], [end], [olast], n)
            s = self.sa.alloc_extend(T(start), T(start), T(end), T(end), T(slast), n)
        if o is None or s is None:
            self.fail(f"allocation of {n} failed: ours={o is not None} sglang={s is not None}")
        self.place_slots(req, sreq, o, s, start, end, self.srtp.req_to_token)
        return True

    # ------------------------------------------------------------------ request operations

    def admit(self, prompt: list[int], extra: Any, chunk: int, max_out: int) -> None:
        self.rid += 1
        rid = f"r{self.rid}"
        req = Req(rid, prompt, extra_key=extra)
        sreq = self.sg.SGReq(rid, prompt, extra_key=extra)
        key = prompt[: len(prompt) - 1]
        self.log.append(f"admit {rid} len={len(prompt)} extra={extra} chunk={chunk} prompt={prompt}")
        m = self.ours.match_prefix(RadixKey(key, extra))
        sm = self.theirs.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(list(key), extra)))
        self._cmp_match(f"admit {rid}: match", m, sm)
        n = int(m.device_indices.numel())
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        sreq.prefix_indices, sreq.last_node = sm.device_indices, sm.last_device_node
        req.kv.cache_protected_len = sreq.kv.cache_protected_len = n
        req.lock = self.ours.inc_lock_ref(req.last_node)
        res = self.theirs.inc_lock_ref(sreq.last_node)
        sreq.swa_uuid_for_lock, sreq.skip_lock_node_ids = res.swa_uuid_for_lock, res.skip_lock_node_ids
        self._cmp_lock(f"admit {rid}: lock", req.last_node, req.lock, self.their_node(sreq.last_node), res)
        assert self.ours.req_to_token_pool.alloc([req]) is not None
        assert self.srtp.alloc([sreq]) is not None
        if n:
            self.ours.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n] = m.device_indices.to(torch.int32)
            self.srtp.req_to_token[sreq.kv.req_pool_idx, :n] = sm.device_indices.to(torch.int32)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n
        sreq.kv.kv_committed_len = sreq.kv.kv_allocated_len = n
        if self.evict_floor and self.rng.random() < 0.5:
            floor = self.rng.randrange(0, len(prompt) + 1)
            req.kv.swa_evict_floor = sreq.kv.swa_evict_floor = floor
            self.log.append(f"  {rid}.swa_evict_floor={floor}")
        self.live.append((req, sreq, {"chunk": chunk, "max_out": max_out, "decoded": 0}))
        self.compare(f"admit {rid}")

    def _free_window(self, req: Req, sreq: Any, pre_len: int) -> None:
        self.ours.free_window_slots([req], [pre_len])
        self.sg.free_out_of_window(self.theirs, sreq, pre_len, window=self.W, page_size=self.ps, chunk=self.chunk)

    def step(self, idx: int) -> None:
        req, sreq, plan = self.live[idx]
        total = len(req.origin_input_ids)
        kv = req.kv
        chunk = prefill_chunk(req, plan)
        if chunk is not None:
            start, end = chunk
            self.log.append(f"prefill {req.rid} [{start}, {end})")
            if not self.alloc(req, sreq, end):
                self.finish(idx, True, why="no memory for prefill")
                return
            if self.chunk:
                self._free_window(req, sreq, start)
            # Between chunks (chunked=True) and, as SGLang's scheduler does, once the
            # prompt is done, so requests arriving during decode can share it.
            kvcore.cache_unfinished_req(req, self.ours, chunked=end < total)
            self.theirs.cache_unfinished_req(sreq, chunked=end < total)
            if self.tree:
                self.eq(f"{req.rid} prefix_indices", self.mapped(req.prefix_indices), sreq.prefix_indices.tolist())
                self.eq(f"{req.rid} cache_protected_len", req.kv.cache_protected_len, sreq.kv.cache_protected_len)
            self.compare(f"prefill {req.rid}")
            return
        if plan["decoded"] >= plan["max_out"]:
            self.finish(idx, self.rng.random() < 0.9)
            return
        tok = self.rng.randrange(4)
        req.output_ids.append(tok)
        sreq.output_ids.append(tok)
        self.log.append(f"decode {req.rid} tok={tok} seqlen={req.seqlen}")
        if not self.alloc(req, sreq, kv.kv_allocated_len + 1, decode=True):
            req.output_ids.pop()
            sreq.output_ids.pop()
            self.finish(idx, True, why="no memory for decode")
            return
        plan["decoded"] += 1
        self._free_window(req, sreq, req.seqlen - 1)
        self.compare(f"decode {req.rid}")
        if (self.tree and plan["decoded"] >= self.W and not plan.get("swa_released")
                and sreq.swa_uuid_for_lock is not None and self.rng.random() < 0.3):
            self.log.append(f"dec_swa_lock_only {req.rid}")
            self.ours.dec_swa_lock_only(req.last_node, req.lock)
            self.theirs.dec_swa_lock_only(sreq.last_node, sreq.swa_uuid_for_lock, sreq.skip_lock_node_ids)
            sreq.swa_prefix_lock_released = True
            plan["swa_released"] = True
            self.compare(f"dec_swa_lock_only {req.rid}")

    def finish(self, idx: int, is_insert: bool, why: str = "") -> None:
        req, sreq, _ = self.live.pop(idx)
        self.log.append(f"finish {req.rid} is_insert={is_insert} {why}")
        committed = sreq.kv.kv_committed_len
        if req.kv.kv_allocated_len == 0:
            # Never got KV (admitted with no prefix, then no memory): give back the lock and the row.
            self.ours.dec_lock_ref(req.last_node, req.lock)
            self.theirs.dec_lock_ref(sreq.last_node, self.dec_params(sreq))
            self.ours.req_to_token_pool.free(req)
            self.srtp.free(sreq)
            self.compare(f"abort {req.rid}")
            return
        # Known SGLang difference (DESIGN.md, "Window side"): the window slots of
        # [protected, swa_dead_lo) that a floor kept are still mapped when the cursor
        # jumped over them, and SGLang's finish frees only their full side: they leak.
        # (Without a floor, swa_dead_lo is the protected length: nothing.)
        sk = sreq.kv
        hi = min(sk.swa_dead_lo(self.ps), sk.swa_evicted_seqlen, sk.kv_allocated_len)
        leak_full = self.srtp.req_to_token[sk.req_pool_idx, sk.cache_protected_len:max(hi, sk.cache_protected_len)]
        leak_full = leak_full.to(torch.int64)
        leak_swa = self.sa.full_to_swa_index_mapping[leak_full]
        leak_full, leak_swa = leak_full[leak_swa > 0], leak_swa[leak_swa > 0]
        kvcore.release_kv_cache(req, self.ours, is_insert=is_insert)
        # SGLang's release_kv_cache, less the mamba / speculative branches.
        self.theirs.cache_finished_req(sreq, is_insert=is_insert, kv_len_to_handle=committed)
        start, end = committed, sreq.kv.kv_allocated_len
        if self.ps > 1:
            start = -(-start // self.ps) * self.ps
        if start < end:
            self.theirs.free_kv_row(sreq.kv, [(start, end)])
        self.srtp.free(sreq)
        sreq.kv.mark_kv_released()
        if leak_swa.numel():
            ps = self.ps
            pages = torch.unique(leak_swa // ps)  # the row may not reach a leaked page's end
            self.eq(f"finish {req.rid}: window slots SGLang leaks under the floor",
                    self.oa.swa_available_size() - self.sa.swa_available_size(), int(pages.numel()) * ps)
            # Give them back on SGLang's side so that the run goes on comparing everything else.
            self.sa.swa_attn_allocator.free(pages * ps)
            full_pages = torch.unique(leak_full // ps)
            self.sa.full_to_swa_index_mapping[(full_pages[:, None] * ps + torch.arange(ps)).flatten()] = 0
            self.sglang_window_leaks += int(pages.numel()) * ps
        self.compare(f"finish {req.rid}")

    # ------------------------------------------------------------------ tree probes

    def probe_match(self, key: list[int], extra: Any, hold: bool) -> None:
        self.log.append(f"match {key} extra={extra} hold={hold}")
        m = self.ours.match_prefix(RadixKey(key, extra))
        sm = self.theirs.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(list(key), extra)))
        self._cmp_match("match", m, sm)
        if hold and self.tree and m.last_device_node is not self.ours.root_node:
            lock, res = self.hold(m.last_device_node, sm.last_device_node)
            self._cmp_lock("hold lock", m.last_device_node, lock, self.their_node(sm.last_device_node), res)
        self.compare("match")

    def evict(self, n: int, sn: int) -> None:
        self.log.append(f"evict({n}, {sn})")
        r = self.ours.evict(n, sn)
        s = self.their_evict(n, sn)
        self.eq("evict result", (r.num_tokens_evicted, r.swa_num_tokens_evicted), s)
        self.compare("evict")

    def insert(self, key: list[int], extra: Any, sev_pages: int) -> None:
        ps = self.ps
        n = len(key) // ps * ps
        if n == 0 or not self.ensure(n):
            return
        sev = min(sev_pages * ps, n)
        self.log.append(f"insert {key} extra={extra} swa_evicted_seqlen={sev}")
        o = self.oa.alloc(n) if ps == 1 else self.oa.alloc_extend([0], [0], [n], [n], [-1], n)
        T = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        s = self.sa.alloc(n) if ps == 1 else self.sa.alloc_extend(T(0), T(0), T(n), T(n), T(-1), n)
        self.pair_slots(o, s)
        # SGLang's insert expects the caller to have freed the window slots below the cursor.
        if sev:
            self.sa.free_swa(s[:sev])
        r = self.ours.insert(RadixKey(key, extra), o, 0, sev)
        sr = self.theirs.insert(self.sg.InsertParams(key=self.sg.RadixKey(list(key), extra), value=s,
                                                     prev_prefix_len=0, swa_evicted_seqlen=sev))
        self.eq("insert prefix_len", r.prefix_len, sr.prefix_len)
        self.compare("insert")

    # ------------------------------------------------------------------ the random driver

    def operation(self, prompts: list[list[int]]) -> None:
        rng = self.rng
        ps = self.ps
        tree = self.tree
        r = rng.random()
        if r < 0.18 and len(self.live) < 5:
            base = rng.choice(prompts)
            cut = rng.randrange(1, len(base) + 1)
            prompt = base[:cut] + [rng.randrange(8) for _ in range(rng.randrange(0, 3 * ps + 6))]
            if len(prompt) < 2:
                prompt = prompt + [0, 1]
            extra = "x" if rng.random() < 0.1 else None
            chunk = rng.choice([1, 3, ps, 2 * ps + 1, self.W, 1000])
            self.admit(prompt, extra, chunk, rng.randrange(0, 3 * self.W + 3))
        elif r < 0.62 and self.live:
            self.step(rng.randrange(len(self.live)))
        elif r < 0.68 and self.live:
            self.finish(rng.randrange(len(self.live)), rng.random() < 0.85)
        elif r < 0.78:
            base = rng.choice(prompts)
            key = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(8) for _ in range(rng.randrange(0, 3))]
            self.probe_match(key, "x" if rng.random() < 0.1 else None, hold=tree and rng.random() < 0.4)
        elif r < 0.84 and self.held:
            self.release_held(rng.randrange(len(self.held)))
        elif r < 0.92:
            self.evict(rng.choice([0, 1, ps, 3 * ps, 40]), rng.choice([0, 0, 1, ps, 2 * self.W, 40]))
        elif tree:
            base = rng.choice(prompts)
            head = base[: rng.randrange(1, len(base) + 1)]
            key = head + [rng.randrange(8) for _ in range(rng.randrange(0, 2 * ps))]
            n = len(key) // ps
            self.insert(key, None, rng.choice([0, 0, rng.randrange(0, n + 1)]) if n else 0)

    def drain(self) -> None:
        """Finish everything, give back held locks, evict everything."""
        while self.live:
            self.finish(0, True)
        while self.held:
            self.release_held(0)
        self.evict(self.size, self.size)
        self.eq("drained full pool", self.oa.full_available_size(), self.size)

"""The serving loop: a seeded continuous-batching scheduler over a backend's real pools.

Each step (1) moves arrived requests to the waiting queue, (2) spends a prefill
token budget: first on the request whose prefill was chunked, then admitting
waiting requests in order (``match_prefix``, lock, row, slots) while memory and
rows allow, (3) decodes one token for every running request in one batched
allocation (after freeing out-of-window slots on SWA backends), and (4) finishes
requests that reached their output length.  Allocation that falls short evicts
from the cache; when eviction cannot help, the newest running request is
retracted: its KV is released, its output reset and it goes back to the front of
the queue.  Follow-up turns of a conversation run on a streaming session when
sessions are on; an idle session is released (least recently used first) when
memory is short.  Everything the backend does (and the pools it runs on) is
timed as backend time; the rest is loop overhead.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvcore.bench.infinite import InfiniteCache
from kvcore.bench.workloads import RequestSpec, Workload
from kvcore.errors import InvariantViolation, KvcoreError
from kvcore.keys import RadixKey
from kvcore.record import Req, ReqKvInfo, ceil_align
from kvcore.release import (
    cache_unfinished_req,
    free_window_slots,
    release_kv_cache,
)

__all__ = ["BenchConfig", "BenchStalled", "RunResult", "run_workload", "build_cache"]


class BenchStalled(KvcoreError, RuntimeError):
    """The loop cannot make progress: the pools are too small for a request."""


@dataclass
class BenchConfig:
    backend: str
    device: str = "cpu"
    size: int = 65536
    page_size: int = 1
    max_num_reqs: int = 128
    chunk_size: int = 2048
    window: int = 256
    swa_size: int | None = None
    swa_interval: int = 1
    sessions: bool = True
    check_every: int = 0
    write_kv: bool | None = None  # None: on for cuda/npu, off for cpu
    kv_layers: int = 4
    kv_heads: int = 8
    kv_head_dim: int = 128
    eviction_policy: str | None = None


@dataclass
class RunResult:
    backend: str
    options: dict
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    infinite_cached_tokens: int = 0
    retractions: int = 0
    evictions: int = 0
    swa_evictions: int = 0
    evict_calls: int = 0
    session_releases: int = 0
    wall_s: float = 0.0
    backend_s: float = 0.0
    kv_write_s: float = 0.0
    kv_bytes_written: int = 0
    check_s: float = 0.0
    step_us: list[float] = field(default_factory=list)
    pools: dict = field(default_factory=dict)
    leaked_slots: int = 0
    leaked_rows: int = 0
    invariant_violations: int = 0
    violations: list[str] = field(default_factory=list)
    checks: int = 0
    # Most window slots one decoding request holds: after a window free, plus the
    # tokens it decodes before the next one (its prompt is whole in the window until then).
    window_per_request_peak: int = 0
    timeline: dict = field(default_factory=dict)


def _has_field(backend: str, name: str) -> bool:
    from kvcore.plugins import get_backend

    return name in get_backend(backend).config.model_fields


def is_swa_backend(backend: str) -> bool:
    return _has_field(backend, "sliding_window_size")


def cache_options(cfg: BenchConfig, max_context_len: int) -> dict:
    """The create_cache options for ``cfg``: window options only where the backend has them."""
    opts: dict[str, Any] = dict(
        size=cfg.size,
        page_size=cfg.page_size,
        max_num_reqs=cfg.max_num_reqs,
        max_context_len=ceil_align(max(max_context_len, 1), cfg.page_size),
        device=cfg.device,
    )
    if _has_field(cfg.backend, "sliding_window_size"):
        opts["sliding_window_size"] = cfg.window
    if _has_field(cfg.backend, "swa_size"):
        opts["swa_size"] = cfg.swa_size if cfg.swa_size is not None else cfg.size
    if cfg.eviction_policy is not None and _has_field(cfg.backend, "eviction_policy"):
        opts["eviction_policy"] = cfg.eviction_policy
    if _write_kv(cfg):
        opts["kv_buffer"] = {"num_layers": cfg.kv_layers, "num_heads": cfg.kv_heads, "head_dim": cfg.kv_head_dim}
    return opts


def _write_kv(cfg: BenchConfig) -> bool:
    return cfg.write_kv if cfg.write_kv is not None else not str(cfg.device).startswith("cpu")


def build_cache(cfg: BenchConfig, workload: Workload):
    from kvcore.factory import create_cache

    opts = cache_options(cfg, workload.max_total_len)
    cache = create_cache(cfg.backend, **opts)
    return cache, opts


class _Job:
    """A request in the loop.  While decoding, its length is ``off + G`` (G: decode rounds so far),
    so per-token bookkeeping is written into the record lazily (``_sync``) before anyone reads it."""

    __slots__ = ("spec", "req", "seq", "prefix_len", "admitted", "off", "end_g", "gen")

    def __init__(self, spec: RequestSpec, seq: int):
        self.spec = spec
        self.req = Req(spec.rid, spec.prompt, session_id=spec.session_id)
        self.seq = seq
        self.prefix_len = -1
        self.admitted = False
        self.off = 0
        self.end_g = 0
        self.gen = 0  # bumped when the job leaves the running set; stale heap entries are skipped


class _Loop:
    def __init__(self, cfg: BenchConfig, workload: Workload, progress: Callable[[int, int], None] | None):
        self.cfg = cfg
        self.workload = workload
        self.progress = progress
        cache, opts = build_cache(cfg, workload)
        self.backend = cache
        self.res = RunResult(backend=cfg.backend, options=opts)
        self.use_sessions = cfg.sessions and any(s.session_id for s in workload.requests)
        if self.use_sessions:
            from kvcore.session import StreamingSession

            self.cache = StreamingSession(cache)
        else:
            self.cache = cache
        self.r2t = cache.req_to_token_pool
        self.table = self.r2t.req_to_token
        self.alloc = cache.token_to_kv_pool_allocator
        self.ps = cache.page_size
        self.swa = bool(cache.supports_swa())
        self.chunk_cache = bool(cache.is_chunk_cache())
        self.window = int(getattr(cache, "sliding_window_size", cfg.window)) if self.swa else 0
        self.dev = torch.device(getattr(self.alloc, "device", "cpu") or "cpu")
        self._init_kv()
        if self.swa:
            self.caps = {"full": self.alloc.size_full, "swa": self.alloc.size_swa}
        else:
            self.caps = {"full": int(self.alloc.size)}
        self._check_fits()
        # scheduler state
        self.step = 0
        self.seq = 0
        self.waiting: list[_Job] = []
        self.running: list[_Job] = []
        self.G = 0  # decode rounds so far
        self.finish_heap: list[tuple[int, int, int, _Job]] = []  # (end_g, seq, gen, job)
        self.window_heap: list[tuple[int, int, int, _Job]] = []  # (G at which to free, seq, gen, job)
        self.sum_end = 0  # sum of end_g over running jobs
        self._blocked_job: _Job | None = None
        self._blocked_room = 0
        self._dirty = True
        self._rows_t = self._off_t = self._off_cpu = None
        self.chunked: _Job | None = None
        self.later: list[tuple[int, int, RequestSpec]] = []  # follow-up turns: (ready step, order, spec)
        self.next_turn: dict[str, list[RequestSpec]] = {}
        self.idle_sessions: OrderedDict[str, None] = OrderedDict()
        self.finished = 0
        self.new_token_ratio = 0.7
        self.peak = {p: 0 for p in self.caps}
        self.peak_occ = {p: 0 for p in self.caps}
        self.tl: dict[str, list] = {"step": [], "hit_rate": []}
        for p in self.caps:
            self.tl[f"{p}_used"] = []
            self.tl[f"{p}_live"] = []
        self._cum_prompt = 0
        self._cum_cached = 0
        self.bt = 0.0  # backend seconds

    # ------------------------------------------------------------------ setup
    def _init_kv(self) -> None:
        self.kv_pool = None
        if not _write_kv(self.cfg):
            return
        pool = getattr(self.backend, "kv_pool", None)
        if pool is None:
            from kvcore.pools import MHATokenToKVPool

            full = getattr(self.alloc, "full_attn_allocator", self.alloc)
            pool = MHATokenToKVPool(full.size, self.ps, torch.float16, self.cfg.kv_heads, self.cfg.kv_head_dim,
                                    self.cfg.kv_layers, self.dev)
        self.kv_pool = pool
        self.kv_layers = int(getattr(pool, "layer_num", self.cfg.kv_layers))
        heads = int(getattr(pool, "head_num", self.cfg.kv_heads))
        dim = int(getattr(pool, "head_dim", self.cfg.kv_head_dim))
        dtype = getattr(pool, "dtype", torch.float16)
        rows = max(self.cfg.chunk_size, self.cfg.max_num_reqs)
        g = torch.Generator(device="cpu").manual_seed(0)
        self.kv_src = torch.randn((rows, heads, dim), generator=g).to(dtype=dtype, device=self.dev)
        self.kv_token_bytes = 2 * self.kv_layers * heads * dim * self.kv_src.element_size()

    def _check_fits(self) -> None:
        biggest = max(self.workload.requests, key=lambda r: r.total_len)
        need = ceil_align(biggest.total_len, self.ps)
        cap = self.caps["full"]
        if need > cap:
            raise ValueError(
                f"request {biggest.rid!r} needs {need} token slots but backend {self.cfg.backend!r} has {cap}; "
                f"raise --size"
            )
        if self.swa:
            need_swa = min(need, ceil_align(self.cfg.chunk_size, self.ps) + self.window + self.cfg.swa_interval + 2 * self.ps)
            if need_swa > self.caps["swa"]:
                raise ValueError(
                    f"the window pool ({self.caps['swa']} slots) cannot hold one prefill chunk plus the window "
                    f"({need_swa} slots); raise --swa-size or lower --chunk-size"
                )

    # ------------------------------------------------------------- helpers
    def _sizes(self) -> tuple[int, int, int, int]:
        """(full available, full evictable, swa available, swa evictable)."""
        c, a = self.backend, self.alloc
        if self.swa:
            return a.full_available_size(), c.full_evictable_size(), a.swa_available_size(), c.swa_evictable_size()
        av = a.available_size()
        return av, c.evictable_size(), av, 0

    def _ensure(self, need: int, need_swa: int) -> bool:
        """Make ``need`` full (and ``need_swa`` window) slots available, evicting if short."""
        pc = time.perf_counter
        t = pc()
        if self.swa:
            fa, sa = self.alloc.full_available_size(), self.alloc.swa_available_size()
            short, short_swa = need - fa, need_swa - sa
            if short > 0 or short_swa > 0:
                r = self.backend.evict(max(short, 0), swa_num_tokens=max(short_swa, 0))
                self._count_evict(r)
                fa, sa = self.alloc.full_available_size(), self.alloc.swa_available_size()
            ok = fa >= need and sa >= need_swa
        else:
            av = self.alloc.available_size()
            if av < need:
                self._count_evict(self.backend.evict(need - av))
                av = self.alloc.available_size()
            ok = av >= need
        self.bt += pc() - t
        return ok

    def _count_evict(self, r) -> None:
        self.res.evict_calls += 1
        if r is not None:
            self.res.evictions += int(getattr(r, "num_tokens_evicted", 0) or 0)
            self.res.swa_evictions += int(getattr(r, "swa_num_tokens_evicted", 0) or 0)

    def _kv_write(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if self.kv_pool is None or n == 0:
            return
        t = time.perf_counter()
        k = self.kv_src
        while n > k.shape[0]:
            k = torch.cat((k, k))
        for layer in range(self.kv_layers):
            self.kv_pool.set_kv_buffer(layer, slots, k[:n], k[:n])
        self.res.kv_write_s += time.perf_counter() - t
        self.res.kv_bytes_written += n * self.kv_token_bytes

    def _release_idle_session(self, keep: str | None = None) -> bool:
        for sid in self.idle_sessions:
            if sid != keep:
                del self.idle_sessions[sid]
                t = time.perf_counter()
                self.cache.release_session(sid)
                self.bt += time.perf_counter() - t
                self.res.session_releases += 1
                return True
        return False

    # ------------------------------------------------------------ prefill
    def _extend(self, job: _Job, n: int) -> bool:
        """Allocate and fill ``n`` more prompt positions of ``job``; False when memory is short."""
        req = job.req
        kv = req.kv
        start = kv.kv_allocated_len
        end = start + n
        ps = self.ps
        pc = time.perf_counter
        if self.swa and self.chunk_cache and start > 0:
            t = pc()
            self._free_window(req, start)
            self.bt += pc() - t
        need = ceil_align(end, ps) - ceil_align(start, ps) if ps > 1 else n
        if not self._ensure(need, need):
            return False
        row = kv.req_pool_idx
        t = pc()
        if ps == 1:
            slots = self.alloc.alloc(n)
        else:
            last = int(self.table[row, start - 1]) if start else -1
            slots = self.alloc.alloc_extend([start], [start], [end], [end], [last], n)
        self.bt += pc() - t
        if slots is None:
            return False
        t = pc()
        self.r2t.write((row, slice(start, end)), slots)
        self.bt += pc() - t
        kv.kv_allocated_len = kv.kv_committed_len = end
        self._kv_write(slots)
        if end < len(req.origin_input_ids):
            t = pc()
            cache_unfinished_req(req, self.cache, chunked=True)
            self.bt += pc() - t
            self.chunked = job
        else:
            # Like SGLang's scheduler: a prompt that finished prefill goes into the tree
            # now, so requests arriving while it decodes can share it.
            t = pc()
            cache_unfinished_req(req, self.cache)
            self.bt += pc() - t
            self.chunked = None
            self._join(job)
        return True

    # ----------------------------------------------------- lazy decode state
    def _join(self, job: _Job) -> None:
        kv = job.req.kv
        g = self.G
        job.off = kv.kv_allocated_len - g
        job.end_g = g + len(job.spec.output) - len(job.req.output_ids)
        self.running.append(job)
        self.sum_end += job.end_g
        heapq.heappush(self.finish_heap, (job.end_g, job.seq, job.gen, job))
        if self.swa:
            self._push_window(job)
        self._dirty = True

    def _push_window(self, job: _Job, after: bool = False) -> None:
        # Free once len - (window + interval) >= cursor, i.e. at G >= cursor + limit - off.
        at = job.req.kv.swa_evicted_seqlen + self.window + self.cfg.swa_interval - job.off
        heapq.heappush(self.window_heap, (max(at, self.G + 1 if after else self.G), job.seq, job.gen, job))

    def _leave(self, job: _Job) -> None:
        self._sync(job)
        self.running.remove(job)
        self.sum_end -= job.end_g
        job.gen += 1
        self._dirty = True

    def _sync(self, job: _Job, outputs: bool = True) -> None:
        """Write the decode rounds so far into the record (and, unless told not to, the output ids)."""
        req = job.req
        length = job.off + self.G
        kv = req.kv
        kv.kv_allocated_len = kv.kv_committed_len = length
        # Copying the outputs costs O(length): the window path, which needs only the lengths, skips it.
        if outputs and len(req.output_ids) != length - len(req.origin_input_ids):
            req.output_ids = job.spec.output[: length - len(req.origin_input_ids)]

    def _tensors(self):
        if self._dirty:
            running = self.running
            self._rows_t = torch.tensor([j.req.kv.req_pool_idx for j in running], dtype=torch.int64, device=self.dev)
            self._off_cpu = torch.tensor([j.off for j in running], dtype=torch.int64)
            self._off_t = self._off_cpu.to(self.dev)
            self._dirty = False
        return self._rows_t, self._off_t, self._off_cpu

    def _free_window(self, req: Req, pre_len: int) -> None:
        free_window_slots(self.backend, [req], [pre_len])

    def _reserve(self) -> tuple[int, int]:
        """Slots kept back for the running requests' decoding (SGLang's new-token ratio)."""
        full = self.sum_end - len(self.running) * self.G
        swa = min(full, len(self.running) * (self.window + self.cfg.swa_interval))
        if self.chunked is not None:
            kv = self.chunked.req.kv
            left = len(self.chunked.req.origin_input_ids) - kv.kv_allocated_len
            full += left
            swa += left
        r = self.new_token_ratio
        return int(full * r), int(swa * r) if self.swa else 0

    def _admit(self, job: _Job, budget: int, rows_only: bool) -> str:
        """Try to admit ``job`` with up to ``budget`` prompt tokens: 'ok', 'rows' or 'mem'."""
        req = job.req
        sid = req.session_id
        session_live = self.use_sessions and sid is not None and sid in self.idle_sessions
        if rows_only and not session_live:
            return "rows"
        # A waiting request never owns anything; a session restore shares the slot's record.
        req.kv = ReqKvInfo()
        req.last_node = None
        req.lock = None
        prompt = req.origin_input_ids
        key = RadixKey(prompt[: len(prompt) - 1])
        pc = time.perf_counter
        t = pc()
        cache = self.cache
        m = cache.match_prefix(key, req) if self.use_sessions and sid is not None else cache.match_prefix(key)
        node = m.last_device_node
        lock = cache.inc_lock_ref(node)
        restored = req.kv.is_held
        prefix_len = int(m.device_indices.numel())
        first = min(budget, len(prompt) - prefix_len)
        need = ceil_align(prefix_len + first, self.ps) - ceil_align(prefix_len, self.ps) if self.ps > 1 else first
        fa, fe, sa, se = self._sizes()
        self.bt += pc() - t
        res_full, res_swa = self._reserve()
        if need > fa + fe - res_full or (self.swa and need > sa + se - res_swa):
            t = pc()
            cache.dec_lock_ref(node, lock)
            self.bt += pc() - t
            return "mem"
        t = pc()
        rows = self.r2t.alloc([req])
        self.bt += pc() - t
        if rows is None:
            t = pc()
            cache.dec_lock_ref(node, lock)
            self.bt += pc() - t
            return "rows"
        req.prefix_indices = m.device_indices
        req.last_node = node
        req.lock = lock
        kv = req.kv
        if restored:
            self.idle_sessions.pop(sid, None)
        else:
            kv.cache_protected_len = prefix_len
            if prefix_len:
                t = pc()
                self.r2t.write((kv.req_pool_idx, slice(0, prefix_len)), m.device_indices)
                self.bt += pc() - t
        kv.kv_committed_len = kv.kv_allocated_len = prefix_len
        if job.prefix_len < 0:
            # Hit rate counts the first admission: a retracted request re-matching its own
            # chunks is recompute saved, not reuse across requests.
            job.prefix_len = prefix_len
        job.admitted = True
        if not self._extend(job, first):
            self._unadmit(job)
            return "mem"
        self._admit_used = first
        return "ok"

    def _unadmit(self, job: _Job) -> None:
        """Undo an admission (or retract): release the KV without caching it, reset the request."""
        req = job.req
        sid = req.session_id
        t = time.perf_counter()
        if self.use_sessions and sid is not None and sid in self.cache.slots and req.kv is self.cache.slots[sid].kv:
            self.cache.release_session(sid)
            self.idle_sessions.pop(sid, None)
        else:
            release_kv_cache(req, self.backend, is_insert=False)
        self.bt += time.perf_counter() - t
        req.kv = ReqKvInfo()
        req.output_ids = []
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)
        req.last_node = None
        req.lock = None
        job.admitted = False
        if self.chunked is job:
            self.chunked = None

    def _prefill(self) -> int:
        budget = self.cfg.chunk_size
        used = 0
        job = self.chunked
        if job is not None:
            kv = job.req.kv
            n = min(budget, len(job.req.origin_input_ids) - kv.kv_allocated_len)
            if not self._extend(job, n):
                return 0
            budget -= n
            used += n
        rows_only = False
        i = 0
        while budget > 0 and self.chunked is None and i < len(self.waiting):
            if len(self.running) >= self.cfg.max_num_reqs:
                break
            job = self.waiting[i]
            if job is self._blocked_job and self._headroom() <= self._blocked_room:
                break  # nothing was freed since this request failed to fit: skip the re-match
            state = self._admit(job, budget, rows_only)
            if state == "mem" and self._release_idle_session(keep=job.spec.session_id):
                continue  # retry with the memory the session held
            if state == "ok":
                del self.waiting[i]
                n = self._admit_used
                budget -= n
                used += n
            elif state == "rows":
                rows_only = True  # only requests whose session holds a row can still go in
                i += 1
            else:
                self._blocked_job = job
                self._blocked_room = self._headroom()
                break
        return used

    def _headroom(self) -> int:
        fa, fe, sa, se = self._sizes()
        rf, rs = self._reserve()
        room = fa + fe - rf
        return min(room, sa + se - rs) if self.swa else room

    # ------------------------------------------------------------- decode
    def _retract_newest(self) -> bool:
        cands = self.running + ([self.chunked] if self.chunked is not None else [])
        if not cands:
            return False
        job = max(cands, key=lambda j: j.seq)
        if job is self.chunked:
            self.chunked = None
        else:
            self._leave(job)
        self._unadmit(job)
        self.waiting.insert(0, job)
        self.res.retractions += 1
        self.new_token_ratio = 0.7
        return True

    def _decode(self) -> int:
        if not self.running:
            return 0
        pc = time.perf_counter
        ps = self.ps
        if self.swa and self.window_heap and self.window_heap[0][0] <= self.G:
            heap = self.window_heap
            due = []
            while heap and heap[0][0] <= self.G:
                _, _, gen, job = heapq.heappop(heap)
                if gen == job.gen:
                    self._sync(job, outputs=False)
                    due.append(job)
            # One allocator free for the whole batch, as a scheduler would do it.
            reqs = [job.req for job in due]
            t = pc()
            free_window_slots(self.backend, reqs)
            self.bt += pc() - t
            # What a decoding request holds at most: what it keeps now plus the tokens
            # it decodes before its next window free.
            held = 0
            for job in due:
                kv = job.req.kv
                held = max(held, kv.kv_allocated_len - max(kv.cache_protected_len, kv.swa_evicted_seqlen))
                self._push_window(job, after=True)
            if due and held + self.cfg.swa_interval > self.res.window_per_request_peak:
                self.res.window_per_request_peak = held + self.cfg.swa_interval
        while True:
            n = len(self.running)
            if n == 0:
                return 0
            rows_t, off_t, off_cpu = self._tensors()
            if ps == 1:
                need = n
            else:
                need = ps * int(((off_cpu + self.G) % ps == 0).sum())
            if self._ensure(need, need):
                break
            if self._release_idle_session():
                continue
            self._retract_newest()
        pos_t = off_t + self.G
        t = pc()
        if ps == 1:
            slots = self.alloc.alloc(n)
        else:
            last = self.table[rows_t, pos_t - 1].to(torch.int64)
            slots = self.alloc.alloc_decode(pos_t + 1, off_cpu + (self.G + 1), last)
        assert slots is not None, "allocation failed after _ensure said it fits"
        self.r2t.write((rows_t, pos_t), slots.to(torch.int32))
        self.bt += pc() - t
        self._kv_write(slots)
        self.G += 1
        self._sample()
        heap = self.finish_heap
        if heap and heap[0][0] <= self.G:
            done = []
            while heap and heap[0][0] <= self.G:
                _, _, gen, job = heapq.heappop(heap)
                if gen == job.gen:
                    done.append(job)
            if done:
                self._finish(done)
        return n

    def _finish(self, done: list[_Job]) -> None:
        pc = time.perf_counter
        for job in done:
            self._leave(job)
            req = job.req
            spec = job.spec
            t = pc()
            release_kv_cache(req, self.cache)
            self.bt += pc() - t
            sid = spec.session_id
            if sid is not None:
                nxt = self.next_turn.get(sid)
                if nxt:
                    follow = nxt.pop(0)
                    heapq.heappush(self.later, (self.step + follow.think, self._order(), follow))
                if self.use_sessions:
                    if spec.last_turn:
                        t = pc()
                        self.cache.release_session(sid)
                        self.bt += pc() - t
                    else:
                        self.idle_sessions[sid] = None
                        self.idle_sessions.move_to_end(sid)
            self.finished += 1
            self._cum_prompt += len(spec.prompt)
            self._cum_cached += job.prefix_len
            self.res.cached_tokens += job.prefix_len

    def _order(self) -> int:
        self.seq += 1
        return self.seq

    # ------------------------------------------------------------ sampling
    def _sample(self) -> None:
        fa, fe, sa, se = self._sizes()
        caps = self.caps
        used = caps["full"] - fa
        live = used - fe
        tl = self.tl
        tl["step"].append(self.step)
        tl["hit_rate"].append(self._cum_cached / self._cum_prompt if self._cum_prompt else 0.0)
        tl["full_used"].append(used)
        tl["full_live"].append(live)
        if used > self.peak_occ["full"]:
            self.peak_occ["full"] = used
        if live > self.peak["full"]:
            self.peak["full"] = live
        if self.swa:
            used = caps["swa"] - sa
            live = used - se
            tl["swa_used"].append(used)
            tl["swa_live"].append(live)
            if used > self.peak_occ["swa"]:
                self.peak_occ["swa"] = used
            if live > self.peak["swa"]:
                self.peak["swa"] = live

    def _owners(self) -> list:
        for j in self.running:
            self._sync(j)
        owners = [j.req for j in self.running]
        if self.chunked is not None:
            owners.append(self.chunked.req)
        return owners

    def _check(self) -> None:
        from kvcore.invariants import InvariantChecker

        t = time.perf_counter()
        self.res.checks += 1
        try:
            InvariantChecker(self.cache).check(owners=self._owners())
        except InvariantViolation as exc:
            self.res.invariant_violations += 1
            if len(self.res.violations) < 5:
                self.res.violations.append(f"step {self.step}: {exc}")
        self.res.check_s += time.perf_counter() - t

    # ------------------------------------------------------------- the run
    def run(self) -> RunResult:
        from kvcore.devices import synchronize

        specs = self.workload.requests
        firsts = []
        for s in specs:
            if s.session_id is not None and s.turn > 0:
                self.next_turn.setdefault(s.session_id, []).append(s)
            else:
                firsts.append(s)
        for turns in self.next_turn.values():
            turns.sort(key=lambda s: s.turn)
        total = len(specs)
        nxt = 0
        step_us = self.res.step_us
        pc = time.perf_counter
        sync = self.dev.type != "cpu"
        check_every = self.cfg.check_every
        idle_rounds = 0
        t_start = pc()
        while self.finished < total:
            step = self.step
            t0 = pc()
            while nxt < len(firsts) and firsts[nxt].arrival <= step:
                self.waiting.append(_Job(firsts[nxt], self._order()))
                nxt += 1
            while self.later and self.later[0][0] <= step:
                self.waiting.append(_Job(heapq.heappop(self.later)[2], self._order()))
            if not self.waiting and not self.running and self.chunked is None:
                # Idle: jump to the next arrival without counting a step.
                upcoming = [firsts[nxt].arrival] if nxt < len(firsts) else []
                if self.later:
                    upcoming.append(self.later[0][0])
                self.step = max(step + 1, min(upcoming))
                continue
            before = self.finished
            work = self._prefill()
            work += self._decode()
            if sync:
                synchronize(self.dev)
            step_us.append((pc() - t0) * 1e6)
            self.new_token_ratio = max(0.1, self.new_token_ratio - 0.001)
            if work == 0 and self.finished == before:
                idle_rounds += 1
                if not self._release_idle_session() and idle_rounds > 2:
                    head = self.waiting[0].spec if self.waiting else None
                    what = f"request {head.rid!r} ({len(head.prompt)} prompt tokens)" if head else "the loop"
                    raise BenchStalled(
                        f"{self.cfg.backend}: {what} cannot be admitted: the pools "
                        f"({', '.join(f'{k} {v}' for k, v in self.caps.items())} slots, {self.cfg.max_num_reqs} rows) "
                        "are too small; raise --size (or --swa-size, --max-num-reqs)"
                    )
            else:
                idle_rounds = 0
            if check_every and step % check_every == 0:
                self._check()
            if self.progress is not None and step % 64 == 0:
                self.progress(self.finished, total)
            self.step = step + 1
        wall = pc() - t_start - self.res.check_s
        if self.progress is not None:
            self.progress(self.finished, total)
        return self._final(wall)

    def _final(self, wall: float) -> RunResult:
        res = self.res
        for sid in list(self.idle_sessions):
            self.cache.release_session(sid)
        self.idle_sessions.clear()
        res.wall_s = wall
        res.backend_s = self.bt
        res.steps = len(res.step_us)
        res.prompt_tokens = self.workload.prompt_tokens
        res.output_tokens = self.workload.output_tokens
        sizes = self.backend.cached_sizes()
        leaked = 0
        for pool, cap in self.caps.items():
            if pool == "swa":
                avail = self.alloc.swa_available_size()
            elif self.swa:
                avail = self.alloc.full_available_size()
            else:
                avail = self.alloc.available_size()
            ev, prot = sizes.get(pool, (0, 0))
            leaked += cap - avail - ev - prot
            res.pools[pool] = {"capacity": cap, "peak": self.peak[pool], "peak_occupied": self.peak_occ[pool]}
        res.leaked_slots = leaked
        res.leaked_rows = self.r2t.size - self.r2t.available_size()
        self.running = []
        self.chunked = None
        self._check()
        res.timeline = self.tl
        inf = InfiniteCache(self.ps)
        hits = 0
        for s in self.workload.requests:
            hits += inf.match(s.prompt, len(s.prompt) - 1)
            inf.insert(s.prompt + s.output)
        res.infinite_cached_tokens = hits
        return res


def run_workload(cfg: BenchConfig, workload: Workload, progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run ``workload`` through backend ``cfg.backend`` and return the measurements."""
    return _Loop(cfg, workload, progress).run()

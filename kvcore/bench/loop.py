"""The serving loop: a seeded continuous-batching scheduler over a backend's real pools.

Each step (1) moves arrived requests to the waiting queue, (2) spends a prefill
token budget: first on the request whose prefill was chunked, then admitting
waiting requests in order while memory and rows allow, (3) decodes one token for
every running request in one batched allocation (after freeing out-of-window
slots when the backend has a windowed pool), and (4) finishes requests that
reached their output length.  The engine protocol itself (match, lock, row,
slots, ``cache_unfinished_req``, release, retract, sessions) is
:class:`kvcore.engine.Engine`'s; this module keeps only the scheduling policy:
budgets, the memory reserve, when to free the window, whom to retract, which
idle session to release.  Allocation that falls short evicts (``make_room``);
when that cannot help, the least recently used idle session is released, then
the newest running request is retracted and goes back to the front of the
queue.  Everything the engine does is timed as backend time (K/V writes apart);
the rest is loop overhead.  Counters and samples live in
:mod:`kvcore.bench.metrics`, the K/V writer in :mod:`kvcore.bench.kvwriter`.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvcore.bench.infinite import BlockInfiniteCache, InfiniteCache
from kvcore.bench.lifecycle import PdDecode, resume_retracted, retract_job
from kvcore.bench.metrics import Metrics, RunResult
from kvcore.bench.spec import RequestSpec, Workload, token_list
from kvcore.bench.timer import Stopwatch
from kvcore.capabilities import WindowLockRelease, sparse, window_lock_release, windowed
from kvcore.engine import Engine
from kvcore.errors import InvariantViolation, KvcoreError
from kvcore.record import Req, ceil_align
from kvcore.session import SessionNode

if TYPE_CHECKING:
    from kvcore.bench.kvwriter import KVWriter
    from kvcore.cache import BasePrefixCache
    from kvcore.pools.views import PoolView

__all__ = [
    "BenchConfig", "BenchSetupError", "BenchStalled", "Job", "ServingLoop", "RunResult", "run_workload",
    "build_cache", "cache_options",
]


class BenchStalled(KvcoreError, RuntimeError):
    """The loop cannot make progress: the pools are too small for a request."""


class BenchSetupError(KvcoreError, ValueError):
    """The options cannot run this workload on this backend (found when the loop is built); names the option."""


@dataclass
class BenchConfig:
    backend: str
    device: str = "cpu"
    size: int = 65536
    page_size: int = 1
    max_num_reqs: int = 128
    chunk_size: int = 2048
    window: int | None = None  # None: the model's window (with a model), else 256
    swa_size: int | None = None
    swa_interval: int = 128  # SGLang's SGLANG_SWA_EVICTION_INTERVAL default
    sessions: bool = True
    check_every: int = 0
    write_kv: bool | None = None  # None: on for cuda/npu, off for cpu
    kv_layers: int = 4
    kv_heads: int = 8
    kv_head_dim: int = 128
    eviction_policy: str | None = None
    topk_locality: float = 0.5  # sparse decode: share of each step's top-k that is the most recent tokens
    # Memory-budget sizing (kvcore.bench.sizing): with a model, size/swa_size/window come from it and kv_budget.
    model: str | None = None
    kv_budget: int | None = None  # bytes
    swa_full_tokens_ratio: float = 0.8
    release_window_lock: bool = False  # SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW
    retract_mode: str = "recompute"  # or "offload": a host copy of the KV, resumed without recompute
    pre_alloc_size: int = 0  # pd-decode: rows for pre-allocated requests on top of max_num_reqs
    transfer_steps: int = 4  # pd-decode: steps a KV transfer from the prefill server takes
    # More create_cache options (--backend-opt), validated by the backend's config model.
    backend_options: dict[str, Any] = field(default_factory=dict)
    host_size: int = 0  # tiers (kvcore.bench.tiers): host-tier token slots
    store: str | None = None  # tiers: a KV store URL
    host_write_policy: str = "write_through"  # tiers: when pages go to the host tier and the store


def config_fields(backend: str) -> set[str]:
    """The option names ``backend``'s config model takes."""
    from kvcore.plugins import get_backend

    return set(get_backend(backend).config.model_fields)


def cache_options(cfg: BenchConfig, max_context_len: int) -> dict:
    """The create_cache options for ``cfg``: bench options go only to backends whose config has the field."""
    fields = config_fields(cfg.backend)
    size, swa_size, window = cfg.size, cfg.swa_size, cfg.window
    if cfg.model is not None:
        from kvcore.bench.sizing import DEFAULT_KV_BUDGET, get_model, size_pools

        model = get_model(cfg.model)
        sizes = size_pools(model, cfg.kv_budget or DEFAULT_KV_BUDGET, hybrid="swa_size" in fields,
                           page_size=cfg.page_size, swa_full_tokens_ratio=cfg.swa_full_tokens_ratio)
        size, swa_size, window = sizes.full, sizes.swa, model.window if cfg.window is None else cfg.window
    elif window is None:
        window = 256
    opts: dict[str, Any] = dict(
        size=size,
        page_size=cfg.page_size,
        max_num_reqs=cfg.max_num_reqs,
        max_context_len=ceil_align(max(max_context_len, 1), cfg.page_size),
        device=cfg.device,
    )
    if "sliding_window_size" in fields:
        opts["sliding_window_size"] = window
    if "swa_size" in fields:
        opts["swa_size"] = swa_size if swa_size is not None else size
    if cfg.eviction_policy is not None and "eviction_policy" in fields:
        opts["eviction_policy"] = cfg.eviction_policy
    if cfg.pre_alloc_size:
        opts["pre_alloc_size"] = cfg.pre_alloc_size
    from kvcore.bench.tiers import tier_options

    opts.update(tier_options(cfg.backend, fields, cfg.host_size, cfg.store, cfg.host_write_policy))
    if _write_kv(cfg):
        opts["kv_buffer"] = {"num_layers": cfg.kv_layers, "num_heads": cfg.kv_heads, "head_dim": cfg.kv_head_dim}
    opts.update(cfg.backend_options)
    return opts


def _write_kv(cfg: BenchConfig) -> bool:
    # Tiers move the K/V bytes of pages, so there must be real bytes to move.
    tiers = bool(cfg.host_size or cfg.store)
    return cfg.write_kv if cfg.write_kv is not None else tiers or not str(cfg.device).startswith("cpu")


def build_cache(cfg: BenchConfig, workload: Workload) -> tuple[BasePrefixCache, dict]:
    from kvcore.factory import create_cache

    opts = cache_options(cfg, workload.max_total_len)
    cache = create_cache(cfg.backend, **opts)
    return cache, opts


def _fill_len(req: Req) -> int:
    """Positions a prefill computes: the prompt, plus the outputs so far after a recompute retraction."""
    return len(req.origin_input_ids) + len(req.output_ids)


class Job:
    """A request in the loop.  While decoding, its length is ``round_offset + decode_round`` (the loop's
    decode rounds so far), so per-token bookkeeping is written into the record lazily (``_sync``) before
    anyone reads it; it finishes at decode round ``end_round``."""

    __slots__ = ("spec", "_req", "seq", "prefix_len", "admitted", "round_offset", "end_round", "gen", "computed",
                 "row")

    def __init__(self, spec: RequestSpec, seq: int):
        self.spec = spec
        self._req: Req | None = None
        self.seq = seq
        self.prefix_len = -1
        self.admitted = False
        self.round_offset = 0
        self.end_round = 0
        self.gen = 0  # bumped when the job leaves the running set; stale heap entries are skipped
        self.computed = 0  # positions whose KV was computed so far (prefilled again after a recompute retraction)
        self.row = 0  # the record's req_to_token row while it decodes (set by join; the batch tensors read it)

    @property
    def req(self) -> Req:
        """The request record, made when the scheduler first tries to admit the job: a streamed (trace)
        request makes its tokens then, so a queue of waiting requests holds none."""
        req = self._req
        if req is None:
            spec = self.spec
            spec.materialise()
            req = self._req = Req(spec.rid, token_list(spec.prompt), session_id=spec.session_id)
        return req


class ServingLoop:
    """The scheduler of one run.  :mod:`kvcore.bench.lifecycle`'s policies (offload resume, pd-decode)
    use only its public part: ``engine``, ``engine_time``, ``result``, ``page_size``, ``step``,
    ``waiting``, ``retract_mode``, and ``fits``, ``has_free_row``, ``has_running_place``, ``join``."""

    def __init__(self, cfg: BenchConfig, workload: Workload):
        self.cfg = cfg
        self.workload = workload
        cache, opts = build_cache(cfg, workload)
        self.backend = cache
        self.cache: BasePrefixCache
        self.use_sessions = cfg.sessions and any(s.session_id for s in workload.requests)
        if self.use_sessions:
            from kvcore.session import StreamingSession

            self.cache = StreamingSession(cache)
        else:
            self.cache = cache
        self.page_size = cache.page_size
        self.retract_mode = cfg.retract_mode
        self.metrics = Metrics(cfg.backend, opts, cache)
        self.result = self.metrics.result
        # The pools a new token takes a slot in (the row indexes them); a windowed one also
        # gives slots back as the request slides past its window.
        token_pools = [v for v in cache.pools() if v.record_slots is None]
        # (name, allocator, windowed) per token pool: rooms() runs for every admission.
        self._room_pools = [(v.name, v.allocator, v.windowed) for v in token_pools]
        # The window frees the scheduler calls (None without a window): what the cache declares.
        self.window_frees = windowed(self.cache)
        self.windowed = self.window_frees is not None
        self.window = int(opts.get("sliding_window_size", 0)) if self.windowed else 0
        if self.windowed:
            self.result.window_per_request_peak = 0
            self.result.window_size = self.window
        self.dev = torch.device(cache.token_to_kv_pool_allocator.device or "cpu")
        self.kv_writer = self._make_kv_writer(cache)
        from kvcore.bench.tiers import BenchTiers

        self.tiers = BenchTiers.attach(cache)
        self.engine = Engine(self.cache, kv_writer=self.kv_writer, release_idle_sessions=False,
                             on_evict=self.metrics.count_evict)
        # --workload pd-decode: requests arrive as KV transfers (kvcore.bench.lifecycle).
        self.pd = PdDecode(self, cfg.transfer_steps) if workload.params.get("pd_decode") else None
        # A sparse-attention backend reads a top-k selection of the context each decode step.
        self.sparse = sparse(cache)
        if self.sparse is not None:
            from kvcore.bench.workloads import TopKSelector

            self.selector = TopKSelector(self.sparse.sparse_top_k(), cfg.topk_locality, seed=workload.seed)
        self.req_to_token_pool = cache.req_to_token_pool
        self.lock_release = self._window_lock_release(self.cache)
        self._check_fits(token_pools)
        # scheduler state
        self.step = 0
        self.seq = 0
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.chunked: Job | None = None
        self.later: list[tuple[int, int, RequestSpec]] = []  # follow-up turns: (ready step, order, spec)
        self.next_turn: dict[str, list[RequestSpec]] = {}
        self.finished = 0
        self.new_token_ratio = 0.7
        self._blocked: tuple[Job, int] | None = None  # the job that last did not fit, and the headroom then
        # lazy decode state: every running job advances one position per decode round
        self.decode_round = 0
        self.finish_heap: list[tuple[int, int, int, Job]] = []  # (end_round, seq, gen, job)
        self.window_heap: list[tuple[int, int, int, Job]] = []  # (round at which to free, seq, gen, job)
        self.lock_heap: list[tuple[int, int, int, Job]] = []  # (round at which to release, seq, gen, job)
        self.sum_end_round = 0  # sum of end_round over running jobs
        self._batch = _BatchTensors(self.dev)
        self.engine_time = Stopwatch()  # time inside the engine (the backend and its pools)
        self.check_time = Stopwatch()  # invariant checks (not part of the run's wall time)

    def _make_kv_writer(self, cache: Any) -> KVWriter | None:
        if not _write_kv(self.cfg):
            return None
        from kvcore.bench.kvwriter import make_kv_writer

        cfg = self.cfg
        return make_kv_writer(cache, self.dev, rows=max(cfg.chunk_size, cfg.max_num_reqs),
                              layers=cfg.kv_layers, heads=cfg.kv_heads, head_dim=cfg.kv_head_dim)

    def _window_lock_release(self, cache: Any) -> WindowLockRelease | None:
        """SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW: once a request decoded past the window, its
        prefix's window lock goes back (dec_swa_lock_only).  A backend without a window has none to release."""
        if not (self.cfg.release_window_lock and self.windowed):
            return None
        release = window_lock_release(cache)  # declared by the backend, never probed by calling
        if release is None:
            raise BenchSetupError(
                f"--release-window-lock: backend {type(cache).__name__} cannot release a window lock early "
                "(it does not declare Capability.WINDOW_LOCK_RELEASE)")
        return release

    # ------------------------------------------------------ the policies' interface
    def fits(self, need: int) -> bool:
        """Whether every token pool has room for ``need`` more slots, after the running requests' reserve."""
        return not any(need > room for room in self.rooms())

    def has_free_row(self) -> bool:
        return self.req_to_token_pool.available_size() > 0

    def has_running_place(self) -> bool:
        return len(self.running) < self.cfg.max_num_reqs

    # ------------------------------------------------------------------ setup
    def _check_fits(self, token_pools: list[PoolView]) -> None:
        biggest = max(self.workload.requests, key=lambda r: r.total_len)
        ps = self.page_size
        need = ceil_align(biggest.total_len, ps)
        for v in token_pools:
            cap = v.capacity
            if not v.windowed:
                if need > cap:
                    raise BenchSetupError(
                        f"request {biggest.rid!r} needs {need} token slots but backend {self.cfg.backend!r} has {cap}"
                        f"{'' if v is token_pools[0] else f' in pool {v.name!r}'}; raise --size"
                    )
                continue
            need_w = min(need, ceil_align(self.cfg.chunk_size, ps) + self.window + self.cfg.swa_interval + 2 * ps)
            if need_w > cap:
                raise BenchSetupError(
                    f"the window pool {v.name!r} ({cap} slots) cannot hold one prefill chunk plus the window "
                    f"({need_w} slots); raise --swa-size or lower --chunk-size"
                )

    # ------------------------------------------------------------- memory
    def rooms(self) -> list[int]:
        """Per token pool: available + evictable slots minus what the running requests will still decode."""
        sizes = self.backend.cached_sizes()
        full, window = self._reserve()
        return [
            alloc.available_size() + sizes.get(name, (0, 0))[0] - (window if windowed else full)
            for name, alloc, windowed in self._room_pools
        ]

    def _reserve(self) -> tuple[int, int]:
        """Slots kept back for the running requests' decoding (SGLang's new-token ratio): (others, windowed)."""
        full = self.sum_end_round - len(self.running) * self.decode_round
        window = min(full, len(self.running) * (self.window + self.cfg.swa_interval))
        if self.chunked is not None:
            left = _fill_len(self.chunked.req) - self.chunked.req.kv.kv_allocated_len
            full += left
            window += left
        r = self.new_token_ratio
        return int(full * r), int(window * r) if self.windowed else 0

    def _headroom(self) -> int:
        return min(self.rooms())

    def _release_idle_session(self, keep: str | None = None) -> bool:
        with self.engine_time:
            released = self.engine.release_idle_session(keep)
        if released:
            self.result.session_releases += 1
        return released

    # ------------------------------------------------------------ prefill
    def _extend(self, job: Job, n: int) -> bool:
        """Prefill ``n`` more positions of ``job``'s ``fill_ids``; False when memory is short.

        ``fill_ids`` is the prompt, or, after a recompute retraction, the prompt
        and the outputs so far (SGLang re-prefills both in one extend).
        """
        req = job.req
        start = req.kv.kv_allocated_len
        end = start + n
        with self.engine_time:
            # A prompt that finished prefill goes into the tree now (as SGLang's scheduler does),
            # so requests arriving while it decodes can share it.
            ok = self.engine.extend(req, end)
        if not ok:
            return False
        if end > start and start < job.computed:
            self.result.retract_recomputed_tokens += min(end, job.computed) - start
        job.computed = max(job.computed, end)
        if end < _fill_len(req):
            self.chunked = job
        else:
            self.chunked = None
            self.join(job)
        return True

    def _admit(self, job: Job, budget: int, rows_only: bool) -> tuple[str, int]:
        """Try to admit ``job`` with up to ``budget`` prompt tokens: ('ok', tokens prefilled), ('rows', 0)
        or ('mem', 0)."""
        req = job.req
        engine = self.engine
        sid = req.session_id
        if rows_only and not (sid is not None and sid in self.engine.idle_sessions):
            return "rows", 0
        if req.kv.retraction_backup is not None:
            # --retract-mode offload: back without recompute, so nothing of the budget is prefilled
            return resume_retracted(self, job), 0
        # A waiting request holds nothing (a retracted one keeps its record: reset_for_retract kept its floor).
        req.last_node = None
        req.lock = None
        with self.engine_time:
            m = engine.match(req)  # on fill_ids: a recompute-retracted request matches prompt + outputs
            prefix_len = m.prefix_len
            rooms = self.rooms()
        first = min(budget, _fill_len(req) - prefix_len)
        ps = self.page_size
        need = ceil_align(prefix_len + first, ps) - ceil_align(prefix_len, ps) if ps > 1 else first
        if any(need > room for room in rooms):
            with self.engine_time:
                engine.cancel(m)
            return "mem", 0
        with self.engine_time:
            admitted = engine.admit(req, matched=m)
        if not admitted:
            return "rows", 0
        if job.prefix_len < 0:
            # Hit rate counts the first admission: a retracted request re-matching its own
            # chunks is recompute saved, not reuse across requests.
            job.prefix_len = prefix_len
        job.admitted = True
        if not self._extend(job, first):
            self._unadmit(job)
            return "mem", 0
        return "ok", first

    def _unadmit(self, job: Job) -> None:
        """Undo an admission (or retract): everything back, nothing cached, the request reset for recompute."""
        retract_job(self, job)  # --retract-mode: recompute (prompt + outputs prefilled again) or offload
        job.admitted = False
        if self.chunked is job:
            self.chunked = None

    def _prefill(self) -> int:
        if self.pd is not None:
            return self.pd.prefill()
        budget = self.cfg.chunk_size
        used = 0
        job = self.chunked
        if job is not None:
            n = min(budget, _fill_len(job.req) - job.req.kv.kv_allocated_len)
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
            blocked = self._blocked
            if blocked is not None and job is blocked[0] and self._headroom() <= blocked[1]:
                break  # nothing was freed since this request failed to fit: skip the re-match
            state, n = self._admit(job, budget, rows_only)
            if state == "mem" and self._release_idle_session(keep=job.spec.session_id):
                continue  # retry with the memory the session held
            if state == "ok":
                del self.waiting[i]
                budget -= n
                used += n
            elif state == "rows":
                rows_only = True  # only requests whose session holds a row can still go in
                i += 1
            else:
                self._blocked = (job, self._headroom())
                break
        return used

    # ----------------------------------------------------- lazy decode state
    def join(self, job: Job) -> None:
        """``job`` (prefilled, pre-built or resumed) decodes from the next round on."""
        kv = job.req.kv
        g = self.decode_round
        row = kv.req_pool_idx
        assert row is not None, f"request {job.spec.rid!r} joins the decode batch without a row"
        job.row = row
        job.round_offset = kv.kv_allocated_len - g
        job.end_round = g + job.spec.output_len - len(job.req.output_ids)
        self.running.append(job)
        self.sum_end_round += job.end_round
        heapq.heappush(self.finish_heap, (job.end_round, job.seq, job.gen, job))
        if self.windowed:
            self._push_window(job)
        if self.lock_release is not None:
            heapq.heappush(self.lock_heap, (g + self.window, job.seq, job.gen, job))
        self._batch.stale = True

    def _push_window(self, job: Job, after: bool = False) -> None:
        # Free once len - (window + interval) >= cursor, i.e. at decode round >= cursor + limit - round_offset.
        at = job.req.kv.swa_evicted_seqlen + self.window + self.cfg.swa_interval - job.round_offset
        now = self.decode_round
        heapq.heappush(self.window_heap, (max(at, now + 1 if after else now), job.seq, job.gen, job))

    def _leave(self, job: Job) -> None:
        self._sync(job)
        job.computed = max(job.computed, job.req.kv.kv_allocated_len)
        self.running.remove(job)
        self.sum_end_round -= job.end_round
        job.gen += 1
        self._batch.stale = True

    def _sync(self, job: Job, outputs: bool = True) -> None:
        """Write the decode rounds so far into the record (and, unless told not to, the output ids)."""
        req = job.req
        length = job.round_offset + self.decode_round
        kv = req.kv
        kv.kv_allocated_len = kv.kv_committed_len = length
        # Copying the outputs costs O(length): the window path, which needs only the lengths, skips it.
        if outputs and len(req.output_ids) != length - len(req.origin_input_ids):
            req.output_ids = token_list(job.spec.output[: length - len(req.origin_input_ids)])

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
        self.result.retractions += 1
        self.new_token_ratio = 0.7
        return True

    def _free_window(self) -> None:
        """Window free for every running request that slid ``swa_interval`` tokens past its window."""
        heap = self.window_heap
        due = []
        while heap and heap[0][0] <= self.decode_round:
            _, _, gen, job = heapq.heappop(heap)
            if gen == job.gen:
                self._sync(job, outputs=False)
                due.append(job)
        # One allocator free for the whole batch, as a scheduler would do it.
        with self.engine_time:
            assert self.window_frees is not None
            self.window_frees.free_window_slots([job.req for job in due])
        # What a decoding request holds at most: what it keeps now plus the tokens
        # it decodes before its next window free.
        held = 0
        for job in due:
            kv = job.req.kv
            held = max(held, kv.kv_allocated_len - max(kv.cache_protected_len, kv.swa_evicted_seqlen))
            self._push_window(job, after=True)
        if due:
            self.metrics.window_held(held + self.cfg.swa_interval)

    def _release_window_locks(self) -> None:
        """Give back the window part of the prefix lock of every request that decoded ``window`` tokens."""
        heap = self.lock_heap
        release = self.lock_release
        assert release is not None
        while heap and heap[0][0] <= self.decode_round:
            _, _, gen, job = heapq.heappop(heap)
            req = job.req
            # A turn running on a session's KV holds no tree lock (its node is the session's stand-in).
            if gen != job.gen or req.lock is None or req.last_node is None or isinstance(req.last_node, SessionNode):
                continue
            with self.engine_time:
                release.dec_swa_lock_only(req.last_node, req.lock)
            self.result.window_lock_releases += 1

    def _decode(self) -> int:
        if not self.running:
            return 0
        if self.windowed and self.window_heap and self.window_heap[0][0] <= self.decode_round:
            self._free_window()
        if self.lock_heap and self.lock_heap[0][0] <= self.decode_round:
            self._release_window_locks()
        engine = self.engine
        paged = self.page_size > 1
        while True:
            n = len(self.running)
            if n == 0:
                return 0
            rows_t, off_t, off_cpu = self._batch.tensors(self.running)
            # A sparse backend maps the new tokens first (on_decode_step); their K/V is written after.
            writer = engine.kv_writer
            if self.sparse is not None:
                engine.kv_writer = None
            # The CPU lengths matter only above page size 1 (which pages are full): one tensor op a step less.
            cpu_lens = off_cpu + self.decode_round if paged else None
            with self.engine_time:
                slots = engine.alloc_decode(rows_t, off_t + self.decode_round, cpu_lens)
            engine.kv_writer = writer
            if slots is not None:
                break
            if not self._release_idle_session():
                self._retract_newest()
        self.decode_round += 1
        if n > self.result.running_peak:
            self.result.running_peak = n
        if self.sparse is not None:
            self._sparse_step(slots)
        self.metrics.sample(self.step)
        heap = self.finish_heap
        if heap and heap[0][0] <= self.decode_round:
            done = []
            while heap and heap[0][0] <= self.decode_round:
                _, _, gen, job = heapq.heappop(heap)
                if gen == job.gen:
                    done.append(job)
            if done:
                self._finish(done)
        return n

    def _sparse_step(self, slots: torch.Tensor) -> None:
        """The step's top-k selection to the backend, then the K/V of the new tokens."""
        for job in self.running:
            self._sync(job, outputs=False)
        reqs = [job.req for job in self.running]
        selections = self.selector([req.kv.kv_allocated_len for req in reqs])
        assert self.sparse is not None
        with self.engine_time:
            self.sparse.on_decode_step(reqs, selections)
            if self.engine.kv_writer is not None:
                self.engine.kv_writer(slots)

    def _finish(self, done: list[Job]) -> None:
        engine = self.engine
        for job in done:
            self._leave(job)
            spec = job.spec
            with self.engine_time:
                engine.finish(job.req)  # a non-final turn on a session leaves the session idle
            sid = spec.session_id
            if sid is not None:
                nxt = self.next_turn.get(sid)
                if nxt:
                    follow = nxt.pop(0)
                    heapq.heappush(self.later, (self.step + follow.think, self._order(), follow))
                if self.use_sessions and spec.last_turn:
                    with self.engine_time:
                        engine.end_session(sid)
            self.finished += 1
            self.metrics.request_done(spec.prompt_len, job.prefix_len)
            spec.release()  # a streamed request's tokens go with it (the tree keeps what it cached)

    def _order(self) -> int:
        self.seq += 1
        return self.seq

    # ------------------------------------------------------------ checks
    def _owners(self) -> list:
        for j in self.running:
            self._sync(j)
        owners = [j.req for j in self.running]
        if self.chunked is not None:
            owners.append(self.chunked.req)
        if self.pd is not None:
            owners += self.pd.owners()
        return owners

    def _check(self) -> None:
        result = self.result
        result.checks += 1
        with self.check_time:
            try:
                self.engine.check(self._owners())
            except InvariantViolation as exc:
                result.invariant_violations += 1
                if len(result.violations) < 5:
                    result.violations.append(f"step {self.step}: {exc}")
        result.check_s = self.check_time.seconds

    # ------------------------------------------------------------- the run
    def run(self, progress: Callable[[int, int], None] | None = None) -> RunResult:
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
        step_us = self.result.step_us
        pc = time.perf_counter
        sync = self.dev.type != "cpu"
        check_every = self.cfg.check_every
        idle_rounds = 0
        if progress is not None:
            progress(0, total)
        t_start = pc()
        while self.finished < total:
            step = self.step
            t0 = pc()
            while nxt < len(firsts) and firsts[nxt].arrival <= step:
                self.waiting.append(Job(firsts[nxt], self._order()))
                nxt += 1
            while self.later and self.later[0][0] <= step:
                self.waiting.append(Job(heapq.heappop(self.later)[2], self._order()))
            if not self.waiting and not self.running and self.chunked is None and not (self.pd and self.pd.in_flight):
                # Idle: jump to the next arrival without counting a step.
                upcoming = [firsts[nxt].arrival] if nxt < len(firsts) else []
                if self.later:
                    upcoming.append(self.later[0][0])
                self.step = max(step + 1, min(upcoming))
                continue
            before = self.finished
            work = self._prefill()
            work += self._decode()
            if self.tiers is not None:
                self.tiers.after_step()  # store writes at the end of the step, never on the match path
            if sync:
                synchronize(self.dev)
            step_us.append((pc() - t0) * 1e6)
            self.new_token_ratio = max(0.1, self.new_token_ratio - 0.001)
            if work == 0 and self.finished == before:
                idle_rounds += 1
                if not self._release_idle_session() and idle_rounds > 2:
                    head = self.waiting[0].spec if self.waiting else None
                    what = f"request {head.rid!r} ({head.prompt_len} prompt tokens)" if head else "the loop"
                    caps = ", ".join(f"{k} {v}" for k, v in self.metrics.capacities.items())
                    raise BenchStalled(
                        f"{self.cfg.backend}: {what} cannot be admitted: the pools "
                        f"({caps} slots, {self.cfg.max_num_reqs} rows) "
                        "are too small; raise --size (or --swa-size, --max-num-reqs)"
                    )
            else:
                idle_rounds = 0
            if check_every and step % check_every == 0:
                self._check()
            if progress is not None and step % 64 == 0:
                progress(self.finished, total)
            self.step = step + 1
        wall = pc() - t_start - self.result.check_s
        if progress is not None:
            progress(self.finished, total)
        return self._final(wall)

    def _final(self, wall: float) -> RunResult:
        result = self.result
        for sid in list(self.engine.idle_sessions):
            self.engine.end_session(sid)
        result.wall_s = wall
        writer = self.kv_writer
        if writer is not None:
            result.kv_write_s = writer.seconds
            result.kv_bytes_written = writer.bytes_written
        # K/V writes happen inside engine calls.
        result.backend_s = max(0.0, self.engine_time.seconds - result.kv_write_s)
        result.steps = len(result.step_us)
        result.prompt_tokens = self.workload.prompt_tokens
        result.output_tokens = self.workload.output_tokens
        result.leaked_slots = self.metrics.final_pools()
        result.leaked_rows = self.req_to_token_pool.num_rows - self.req_to_token_pool.available_size()
        result.backend_stats = dict(self.backend.stats())
        if self.tiers is not None:
            result.tiers = self.tiers.finish()
        self.running = []
        self.chunked = None
        self._check()
        result.timeline = self.metrics.tl
        result.infinite_cached_tokens = infinite_cache_hits(self.workload, self.page_size)
        return result


class _BatchTensors:
    """The running batch's rows and round offsets as tensors, rebuilt only after the batch changed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stale = True
        self._rows: torch.Tensor | None = None
        self._offsets: torch.Tensor | None = None
        self._offsets_cpu: torch.Tensor | None = None

    def tensors(self, running: list[Job]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows on the device, round offsets on the device, round offsets on the CPU)."""
        if self.stale or self._rows is None or self._offsets is None or self._offsets_cpu is None:
            # array('q') then a tensor over its buffer: a third of torch.tensor(list)'s cost, and the batch
            # is rebuilt after every join and leave.  (The tensor keeps the array alive.)
            offsets_cpu = torch.frombuffer(array("q", [j.round_offset for j in running]), dtype=torch.int64)
            rows_cpu = torch.frombuffer(array("q", [j.row for j in running]), dtype=torch.int64)
            self._rows = rows_cpu.to(self.device)
            self._offsets_cpu = offsets_cpu
            self._offsets = offsets_cpu.to(self.device)
            self.stale = False
        return self._rows, self._offsets, self._offsets_cpu


def infinite_cache_hits(workload: Workload, page_size: int) -> int:
    """Prompt tokens a never-evicting cache would match over ``workload`` in arrival order."""
    hits = 0
    if any(s.recipe is not None for s in workload.requests):
        blocks = BlockInfiniteCache(page_size)
        for s in workload.requests:
            if s.recipe is None:
                raise ValueError(f"request {s.rid!r}: a workload mixes streamed and generated requests")
            hits += blocks.match_and_insert(s.recipe.prompt_blocks(), s.prompt_len - 1)
        return hits
    inf = InfiniteCache(page_size)
    for s in workload.requests:
        prompt = list(s.prompt)
        hits += inf.match(prompt, len(prompt) - 1)
        inf.insert(prompt + list(s.output))
    return hits


def run_workload(cfg: BenchConfig, workload: Workload, progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run ``workload`` through backend ``cfg.backend`` and return the measurements."""
    return ServingLoop(cfg, workload).run(progress)

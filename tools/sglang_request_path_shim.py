"""SGLang 0.5.19's own request path on a CPU, for the kvcore-sglang differentials (real SGLang, installed).

Unlike the other ``sglang_*_shim`` modules this one loads nothing from source: it needs
the real SGLang of ``.venv-sglang`` (``./dev sglang-venv``), and only
``plugins/sglang/tests`` import it.  It holds what those differentials share:

* CPU stand-ins for what cannot run without a GPU, and nothing else:
  SGLang's paged allocation kernels ``alloc_extend_kernel`` and ``alloc_decode_kernel``
  (Triton) are replaced by SGLang's own CPU reference ``alloc_extend_naive`` and a loop
  that does what ``alloc_decode_kernel`` does (:func:`install_cpu_kernels`);
  ``write_cache_indices`` (Triton or sgl_kernel) by slice assignments into the row, as
  that kernel writes; the model forward by sampled tokens from the seeded RNG.
* :class:`World`: SGLang's pools, one tree cache on them (SGLang's own or the one
  ``create_tree_cache`` builds for a ``--radix-cache-backend`` name) and the scheduler
  steps, each through SGLang's own functions (``Req.init_next_round_input``,
  ``alloc_req_slots``, ``alloc_token_slots``, ``alloc_paged_token_slots_extend`` /
  ``_decode``, ``maybe_cache_unfinished_req``, ``release_kv_cache``, ``release_req``).
  :class:`SWAWorld` adds SGLang's ``SWATokenToKVPoolAllocator`` and the window steps
  (``free_swa_out_of_window_slots`` in a free group, ``dec_swa_lock_only``).
* :func:`run_stream`: one seeded random stream through two worlds, everything compared
  after every step.
"""

from __future__ import annotations

import random
import types
from array import array
from typing import Any

import torch
from kvcore_sglang.v0_5_19 import KvcoreTreeCache, owner_of
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, release_req
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocator import paged
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator, alloc_extend_naive
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots, maybe_cache_unfinished_req, release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context, get_server_args, mamba_track_grid
from sglang.srt.sampling.sampling_params import SamplingParams

import kvcore
from tools.sglang_decode_step import alloc_decode_slots, commit_decode

__all__ = ["MambaWorld", "SWAWorld", "World", "install_cpu_kernels", "run_stream", "tree_dump", "window_state"]


# ---------------------------------------------------------------------------- CPU stand-ins for the Triton kernels


class _Launch:
    """``kernel[grid](...)`` for a CPU function that does the whole grid at once."""

    def __init__(self, fn: Any):
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return self.fn


def _alloc_extend_cpu(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any,
                      bs_upper: Any, page_size: int) -> None:
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)


def _alloc_decode_cpu(seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any, bs_upper: Any,
                      page_size: int) -> None:
    # alloc_decode_kernel: a request whose new token opens a page takes the next free page, in batch order.
    taken = 0
    for i in range(len(seq_lens)):
        seq_len = int(seq_lens[i])
        if (seq_len - 1) % page_size == 0:
            out_indices[i] = free_pages[taken] * page_size
            taken += 1
        else:
            out_indices[i] = last_loc[i] + 1


def install_cpu_kernels(monkeypatch: Any) -> None:
    """Replace SGLang's two Triton allocation kernels by their CPU equivalents (pytest's ``monkeypatch``)."""
    monkeypatch.setattr(paged, "alloc_extend_kernel", _Launch(_alloc_extend_cpu))
    monkeypatch.setattr(paged, "alloc_decode_kernel", _Launch(_alloc_decode_cpu))


# ------------------------------------------------------------------ one world: SGLang's pools, a cache, requests


#: The components of SGLang's UnifiedRadixCache per cache_kind (what its registry builds for each model kind).
UNIFIED_COMPONENTS = {
    "unified": (ComponentType.FULL,),
    "unified-swa": (ComponentType.FULL, ComponentType.SWA),
    "unified-mamba": (ComponentType.FULL, ComponentType.MAMBA),
}


class World:
    """SGLang's pools, one tree cache on them, and the scheduler steps a test drives."""

    is_hybrid_swa = False
    is_hybrid_ssm = False

    def __init__(self, cache_kind: str, *, size: int, page_size: int, rows: int, width: int,
                 kvcore_name: str | None = None, **params: Any):
        self.page_size = page_size
        self.size = size
        self.r2t = self.make_req_to_token_pool(rows, width)
        self.alloc = self.make_allocator(size, page_size, params)
        init = CacheInitParams(disable=params.pop("disable", False), req_to_token_pool=self.r2t,
                               token_to_kv_pool_allocator=self.alloc, page_size=page_size, **params)
        if kvcore_name is None:
            self.cache = self.sglang_cache(cache_kind, init)
        else:
            load_plugins()
            with get_context().override_server_args(radix_cache_backend=kvcore_name) as server_args:
                self.publish(server_args)
                ctx = TreeCacheBuildContext(
                    server_args=server_args, params=init, is_hybrid_swa=self.is_hybrid_swa,
                    is_hybrid_ssm=self.is_hybrid_ssm,
                    enable_hierarchical_cache=False, disable_radix_cache=False, effective_chunked_prefill_size=None,
                    tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
                )
                self.cache = create_tree_cache(ctx)
            assert isinstance(self.cache, KvcoreTreeCache)
        self.reqs: dict[str, Req] = {}

    def make_req_to_token_pool(self, rows: int, width: int) -> Any:
        return ReqToTokenPool(rows, width, "cpu", False)

    def publish(self, server_args: Any) -> None:
        """What this model kind adds to the ServerArgs the cache is built under (nothing here)."""

    def make_allocator(self, size: int, page_size: int, params: dict) -> Any:
        if page_size == 1:
            return TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)

    # SGLang's own caches of this model kind, by cache_kind; "unified*" kinds are in UNIFIED_COMPONENTS.
    sglang_caches: dict[str, Any] = {"radix": RadixCache, "chunk": ChunkCache}

    def sglang_cache(self, cache_kind: str, init: Any) -> Any:
        components = UNIFIED_COMPONENTS.get(cache_kind)
        if components is not None:
            # SGLang's default tree, with the components its registry gives this model kind
            # (registry._create_unified_radix_cache).
            init.tree_components = components
            return UnifiedRadixCache(init)
        return self.sglang_caches[cache_kind](init)

    # -- what the scheduler's budget sees
    def room(self) -> int:
        """Tokens an allocation can get, evicting as it must (PrefillAdder's free + evictable)."""
        return self.alloc.available_size() + self.cache.evictable_size()

    def admit_room(self) -> int:
        """What admitting a whole prompt may take (PrefillAdder's budget)."""
        return self.room()

    def free_now(self) -> int:
        return self.alloc.available_size()

    # -- the scheduler's steps, through SGLang's own functions
    def new_req(self, rid: str, ids: list[int], extra_key: Any, cache_salt: str | None = None) -> None:
        self.reqs[rid] = Req(rid, "", array("q", ids), SamplingParams(), extra_key=extra_key, cache_salt=cache_salt)

    def admit(self, rid: str) -> tuple:
        """Match (Req.init_next_round_input) and lock, as PrefillAdder does; returns the matched slots and the
        lock's delta (SGLang's caches each answer it their way)."""
        req = self.reqs[rid]
        req.init_next_round_input(self.cache)
        result = self.cache.inc_lock_ref(req.last_node)
        if self.is_hybrid_swa:  # PrefillAdder._req_inc_lock_ref
            req.swa_uuid_for_lock = result.swa_uuid_for_lock
        # It drops the skip set of this lock too (a stale one from an earlier scheduling must not be replayed).
        req.skip_lock_node_ids = {}
        return req.prefix_indices.tolist(), result.delta

    def extend(self, rid: str, chunk: int) -> tuple:
        """One prefill chunk: row, slots (evicting for them), row write; caches the chunk when more follow."""
        req = self.reqs[rid]
        start = len(req.prefix_indices)
        end = min(len(req.full_untruncated_fill_ids), start + chunk)
        req.set_extend_range(start, end)
        allocation.alloc_req_slots(self.r2t, [req], self.cache)
        row = self.r2t.req_to_token[req.kv.req_pool_idx]
        n = end - start
        if self.page_size == 1:
            out = allocation.alloc_token_slots(self.cache, n)
        else:
            last = row[start - 1 : start].to(torch.int64) if start else torch.full((1,), -1, dtype=torch.int64)
            out = allocation.alloc_paged_token_slots_extend(
                self.cache, torch.tensor([start]), torch.tensor([start]), torch.tensor([end]), torch.tensor([end]),
                last, n,
            )
        # write_cache_indices: the prefix slots, then the new ones.
        row[:start] = req.prefix_indices.to(torch.int32)
        row[start:end] = out.to(torch.int32)
        self.forward([req], [req.full_untruncated_fill_ids[start:end]], prefill=True)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        more = end < len(req.full_untruncated_fill_ids)
        maybe_cache_unfinished_req(req, self.cache, chunked=more)
        return start, end, out.tolist()

    def decode(self, rids: list[str], tokens: list[int]) -> list:
        reqs = [self.reqs[r] for r in rids]
        slots = alloc_decode_slots(self.cache, self.r2t, self.page_size, reqs)
        self.forward(reqs, [[tok] for tok in tokens], prefill=False)
        return commit_decode(self.r2t, reqs, slots, tokens)

    def forward(self, reqs: list[Req], tokens: list, *, prefill: bool) -> None:
        """The model's forward over these tokens: nothing the cache reads (a model with states adds them)."""

    def sample_first(self, rid: str, token: int) -> None:
        self.reqs[rid].output_ids.append(token)

    def finish(self, rid: str, is_insert: bool = True) -> None:
        req = self.reqs.pop(rid)
        if req.kv.holds_kv:
            release_kv_cache(req, self.cache, is_insert=is_insert)
        elif req.last_node is not None:
            # Admitted (matched and locked) but no chunk ran yet: only the lock is given back.
            self.cache.dec_lock_ref(req.last_node, DecLockRefParams(swa_uuid_for_lock=req.swa_uuid_for_lock))

    def retract(self, rid: str, remaining: int) -> None:
        release_req(req=self.reqs[rid], remaing_req_count=remaining, req_to_token_pool=self.r2t,
                    token_to_kv_pool_allocator=self.alloc, tree_cache=self.cache, hisparse_coordinator=None,
                    offload_kv=False)

    def evict(self, n: int) -> Any:
        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    def probe(self, ids: list[int], extra_key: Any, cache_salt: str | None = None) -> list[int]:
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), extra_key, cache_salt=cache_salt)))
        return m.device_indices.tolist()

    def dfs_order(self, rids: list[str]) -> list[int]:
        """The DFS-weight schedule policy's order of these requests (it walks root_node's children)."""
        return self.cache.dfs_weight_order([self.reqs[r].last_node for r in rids])

    # -- what the two worlds must agree on
    def req_state(self, r: Req) -> tuple:
        kv = r.kv
        held = kv.req_pool_idx is not None
        row = self.r2t.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].tolist() if held else []
        return (kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len, kv.kv_allocated_len, row,
                r.prefix_indices.tolist(), list(r.output_ids))

    def pool_state(self) -> dict:
        a = self.alloc
        return {"free_pages": a.free_pages.tolist(), "release_pages": a.release_pages.tolist(),
                "available": a.available_size()}

    def state(self) -> dict:
        cache = self.cache
        return {
            **self.pool_state(),
            "rows": list(self.r2t.free_slots),
            # A hybrid model's tree answers per pool (its pool_state holds them); SGLang's raise here.
            "evictable": None if self.is_hybrid_swa or self.is_hybrid_ssm else cache.evictable_size(),
            "protected": None if self.is_hybrid_swa or self.is_hybrid_ssm else cache.protected_size(),
            "total": None if cache.is_chunk_cache() else cache.total_size(),
            "tree": None if cache.is_chunk_cache() else self.dump_tree(),
            "reqs": {rid: self.req_state(r) for rid, r in sorted(self.reqs.items())},
            "events": [repr(e) for e in cache.take_events()],
        }

    def dump_tree(self) -> list:
        return tree_dump(self.cache.root_node)

    def uncached(self) -> tuple[int, int]:
        """Running requests' slots the tree does not hold: (full, window), as the scheduler's busy check counts."""
        ps = self.page_size
        full = swa = 0
        for r in self.reqs.values():
            if r.kv.holds_kv:
                allocated = -(-r.kv.kv_allocated_len // ps) * ps
                full += allocated - r.kv.cache_protected_len
                swa += allocated - max(r.kv.cache_protected_len, r.kv.swa_evicted_seqlen)
        return full, swa

    def check_memory(self) -> None:
        """SGLang's own pool check (the scheduler's, busy form: running requests' slots counted as uncached)."""
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", self.alloc.available_size(), self.cache.evictable_size(), self.cache.protected_size(), 0,
            self.size, self.uncached()[0],
        )
        assert not leak, msg
        self.check_kvcore()

    def check_kvcore(self) -> None:
        if isinstance(self.cache, KvcoreTreeCache):
            kvcore.InvariantChecker(self.cache.kvcore_cache).check(owners=[owner_of(r) for r in self.reqs.values()])

    def idle(self) -> bool:
        """Nothing runs: the pools hold only the tree (SGLang's idle check, exactly)."""
        return self.alloc.available_size() + self.cache.evictable_size() == self.size


class SWAWorld(World):
    """A hybrid sliding-window model: SGLang's ``SWATokenToKVPoolAllocator`` (full + window pools).

    Under it SGLang's own ``SWAKVPool``, one full and one window layer of one head of
    width 1, so its buffers are a few bytes.  The window steps are the scheduler's
    (``ScheduleBatch.maybe_evict_swa``): ``free_swa_out_of_window_slots`` for decoding
    requests in one free group, ``dec_swa_lock_only`` once a request decoded past the window.
    """

    is_hybrid_swa = True

    def __init__(self, cache_kind: str, *, swa_size: int, window: int, **kw: Any):
        self.swa_size = swa_size
        self.window = window
        super().__init__(cache_kind, sliding_window_size=window, **kw)

    def make_allocator(self, size: int, page_size: int, params: dict) -> Any:
        pool = SWAKVPool(size=size, size_swa=self.swa_size, page_size=page_size, dtype=torch.float16, head_num=1,
                         head_dim=1, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
        return SWATokenToKVPoolAllocator(size, self.swa_size, page_size, torch.float16, "cpu", pool, False)

    # SGLang's own cache here is its UnifiedRadixCache with FULL + SWA (cache_kind "unified-swa").

    def room(self) -> int:
        a, c = self.alloc, self.cache
        return min(a.full_available_size() + c.full_evictable_size(), a.swa_available_size() + c.swa_evictable_size())

    def admit_room(self) -> int:
        # The whole prompt needs full slots; of the window pool only each chunk's (chunks are cached
        # as they run, and window eviction frees what left the window).
        return self.alloc.full_available_size() + self.cache.full_evictable_size()

    def free_now(self) -> int:
        return min(self.alloc.full_available_size(), self.alloc.swa_available_size())

    def free_window(self, rids: list[str], interval: int) -> None:
        """``maybe_evict_swa`` for a decode batch: free what left each window, in one free group."""
        self.alloc.free_group_begin()
        for rid in rids:
            req = self.reqs[rid]
            seqlen = len(req.origin_input_ids) + len(req.output_ids)
            if req.kv.holds_kv and seqlen - 1 - self.window >= req.kv.swa_evicted_seqlen + interval:
                free_swa_out_of_window_slots(
                    req, seqlen - 1, sliding_window_size=self.cache.sliding_window_size, page_size=self.page_size,
                    req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                    is_chunk_cache=self.cache.is_chunk_cache(), retain_floor=self.cache.swa_retain_floor(req),
                )
        self.alloc.free_group_end()

    def release_window_lock(self, rid: str) -> None:
        """What the scheduler does with SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW once a request is past it."""
        req = self.reqs[rid]
        self.cache.dec_swa_lock_only(req.last_node, req.swa_uuid_for_lock, skip_lock_node_ids=req.skip_lock_node_ids)
        req.swa_prefix_lock_released = True

    def evict(self, n: int, swa_n: int = 0) -> Any:
        """The full pool's gain and the window count of an eviction.

        kvcore's count must be the gain; an SGLang count short of its gain is tallied in
        :attr:`undercounts` (its ``UnifiedRadixCache`` shows none; the streams check that).
        """
        before = self.alloc.full_available_size()
        done = self.cache.evict(EvictParams(num_tokens=n, swa_num_tokens=swa_n))
        gain = self.alloc.full_available_size() - before
        if done.num_tokens_evicted != gain:
            assert done.num_tokens_evicted < gain, (done, gain)
            self.undercounts = getattr(self, "undercounts", 0) + 1
        assert not isinstance(self.cache, KvcoreTreeCache) or done.num_tokens_evicted == gain, (done, gain)
        return gain, done.swa_num_tokens_evicted

    def req_state(self, r: Req) -> tuple:
        return (*super().req_state(r), r.kv.swa_evicted_seqlen, r.swa_prefix_lock_released,
                r.swa_uuid_for_lock is None, len(r.skip_lock_node_ids.get(ComponentType.SWA, ())))

    def pool_state(self) -> dict:
        a, c = self.alloc, self.cache
        return {
            "free_pages": a.full_attn_allocator.free_pages.tolist(),
            "release_pages": a.full_attn_allocator.release_pages.tolist(),
            "swa_free_pages": a.swa_attn_allocator.free_pages.tolist(),
            "swa_release_pages": a.swa_attn_allocator.release_pages.tolist(),
            "mapping": a.full_to_swa_index_mapping.tolist(),
            "available": (a.full_available_size(), a.swa_available_size()),
            "sizes": (c.full_evictable_size(), c.full_protected_size(), c.swa_evictable_size(),
                      c.swa_protected_size()),
        }

    def state(self) -> dict:
        out = super().state()
        # SGLang's UnifiedRadixCache answers the plain sizes with the full pool's.
        out["evictable"], out["protected"] = self.cache.evictable_size(), self.cache.protected_size()
        out["total"] = self.cache.total_size()
        return out

    def check_memory(self) -> None:
        a, c = self.alloc, self.cache
        full_uncached, swa_uncached = self.uncached()
        for leak, msg in (
            SchedulerInvariantChecker._check_pool_invariant(
                "full", a.full_available_size(), c.full_evictable_size(), c.full_protected_size(), 0, self.size,
                full_uncached),
            SchedulerInvariantChecker._check_pool_invariant(
                "swa", a.swa_available_size(), c.swa_evictable_size(), c.swa_protected_size(), 0, self.swa_size,
                swa_uncached),
        ):
            assert not leak, msg
        self.check_kvcore()

    def idle(self) -> bool:
        a, c = self.alloc, self.cache
        return (a.full_available_size() + c.full_evictable_size() == self.size
                and a.swa_available_size() + c.swa_evictable_size() == self.swa_size)


class MambaWorld(World):
    """A hybrid SSM model: SGLang's ``HybridReqToTokenPool`` (rows, a ``MambaPool`` of two small layers, its slots).

    The forward is the scheduler's and the model runner's part for the states:
    ``ScheduleBatch._collect_deferred_mamba_cow_and_clear`` (SGLang's own, on the batch's
    requests), the copy-on-write and clear it asks for on SGLang's pool, then a
    deterministic write into each request's state from its tokens, so that a state copied
    from the wrong node shows in the comparison.  ``mamba_cache_chunk_size`` is published
    in the ServerArgs, as a model's config would give it.
    """

    is_hybrid_ssm = True

    def __init__(self, cache_kind: str, *, mamba_size: int, chunk_size: int, extra_buffer: bool = False, **kw: Any):
        self.mamba_size = mamba_size
        self.chunk_size = chunk_size
        self.extra_buffer = extra_buffer
        self.admitted: set[str] = set()
        self.publish(get_server_args())
        super().__init__(cache_kind, enable_mamba_extra_buffer=extra_buffer, **kw)

    def publish(self, server_args: Any) -> None:
        server_args._mamba_cache_chunk_size = self.chunk_size

    @staticmethod
    def state_shape() -> Any:
        """The model shape SGLang's ``MambaPool`` reads: one small conv and one temporal state per layer."""
        return types.SimpleNamespace(
            shape=types.SimpleNamespace(conv=[(6, 3)], temporal=(2, 4, 4), disable_conv_window_dedup=True),
            dtype=types.SimpleNamespace(conv=torch.float32, temporal=torch.float32), is_kda=False,
        )

    def make_req_to_token_pool(self, rows: int, width: int) -> Any:
        return HybridReqToTokenPool(
            size=rows, mamba_size=self.mamba_size, mamba_spec_state_size=self.mamba_size, max_context_len=width,
            device="cpu", enable_memory_saver=False, cache_params=self.state_shape(), mamba_layer_ids=[0, 1],
            enable_mamba_extra_buffer=self.extra_buffer, enable_overlap_schedule=True,
        )

    # SGLang's own cache here is its UnifiedRadixCache with FULL + MAMBA (cache_kind "unified-mamba").

    def room(self) -> int:
        return self.alloc.available_size() + self.cache.full_evictable_size()

    def admit(self, rid: str) -> tuple:
        self.admitted.add(rid)
        return super().admit(rid)

    def match_waiting(self, rid: str) -> tuple:
        """The scheduler's match of a waiting request it then leaves waiting (no lock; a state slot may stay)."""
        req = self.reqs[rid]
        req.init_next_round_input(self.cache)
        return req.prefix_indices.tolist(), req.mamba_branching_seqlen

    def forward(self, reqs: list[Req], tokens: list, *, prefill: bool) -> None:
        batch = types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(mamba_chunk_size=self.chunk_size)),
            tree_cache=self.cache, req_to_token_pool=self.r2t,
        )
        ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, reqs)
        pool = self.r2t.mamba_pool
        if batch.mamba_cow_src_indices is not None:
            pool.copy_from(batch.mamba_cow_src_indices, batch.mamba_cow_dst_indices)
        if batch.mamba_clear_indices is not None:
            pool.clear_slots(batch.mamba_clear_indices)
        cache = pool.mamba_cache
        for req, toks in zip(reqs, tokens):
            # Extra-buffer strategy: where this forward's kernel writes a snapshot (the scheduler's decision).
            track = self.track_slot(batch, req, prefill) if self.extra_buffer else None
            idx = req.kv.mamba_pool_idx.reshape(1).to(torch.int64)
            cache.temporal[:, idx] = cache.temporal[:, idx] * 0.5 + float(sum(toks) % 97)
            cache.conv[0][:, idx] += len(toks)
            if track is not None:
                pool.copy_from(idx, torch.tensor([track]))

    def track_slot(self, batch: Any, req: Req, prefill: bool) -> int | None:
        """The ping-pong slot this forward snapshots ``req``'s state into, or None; the record's fields set as SGLang's.

        Prefill: SGLang's own ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``.
        Decode: what its ``_mamba_prefix_cache_update`` does after a step that reaches the track
        grid (``mamba_track_grid``; no overlap lookahead, no speculative decoding here).
        """
        kv = req.kv
        if prefill:
            entry = ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(batch, req)
            return int(entry.track_index) if entry.track_mask else None
        seqlen = kv.kv_committed_len + 1
        if seqlen % mamba_track_grid(self.page_size):
            return None
        slot = int(kv.mamba_ping_pong_track_buffer[kv.mamba_next_track_idx])
        kv.mamba_last_track_seqlen = seqlen
        kv.mamba_last_track_idx = kv.mamba_next_track_idx
        kv.mamba_next_track_idx = self.r2t.get_mamba_ping_pong_other_idx(kv.mamba_next_track_idx)
        return slot

    def finish(self, rid: str, is_insert: bool = True) -> Any:
        req = self.reqs[rid]
        admitted = rid in self.admitted
        self.admitted.discard(rid)
        if req.kv.holds_kv:
            super().finish(rid, is_insert)
            return self.released(req)
        self.reqs.pop(rid)
        if admitted:
            self.cache.dec_lock_ref(req.last_node)
        # A state slot taken by a match before any KV: SGLang's release gives it back.
        release_kv_cache(req, self.cache, is_insert=is_insert)
        return self.released(req)

    @staticmethod
    def released(req: Req) -> tuple:
        """What a released request's record still holds (SGLang leaves a state slot it gave its tree there)."""
        kv = req.kv
        return (kv.holds_kv, kv.is_kv_released, None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx))

    def retract(self, rid: str, remaining: int) -> None:
        super().retract(rid, remaining)
        self.admitted.discard(rid)

    def evict(self, n: int, mamba_n: int = 0) -> Any:
        done = self.cache.evict(EvictParams(num_tokens=n, mamba_num=mamba_n))
        return done.num_tokens_evicted, done.mamba_num_evicted

    def req_state(self, r: Req) -> tuple:
        kv = r.kv
        idx = None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx)
        src = None if kv.mamba_cow_src_index is None else kv.mamba_cow_src_index.tolist()
        buf = kv.mamba_ping_pong_track_buffer
        return (*super().req_state(r), idx, src, kv.mamba_needs_clear, r.mamba_branching_seqlen,
                None if buf is None else buf.tolist(), kv.mamba_next_track_idx, kv.mamba_last_track_idx,
                kv.mamba_last_track_seqlen)

    def pool_state(self) -> dict:
        c = self.cache
        cache = self.r2t.mamba_pool.mamba_cache
        return {
            **super().pool_state(),
            "mamba_free": self.r2t.mamba_allocator.free_slots.tolist(),
            "sizes": (c.full_evictable_size(), c.full_protected_size(), c.mamba_evictable_size(),
                      c.mamba_protected_size()),
            "states": (cache.temporal.tolist(), cache.conv[0].tolist()),
        }

    def state(self) -> dict:
        out = super().state()
        # SGLang's UnifiedRadixCache answers the plain sizes with the full pool's.
        out["evictable"], out["protected"] = self.cache.evictable_size(), self.cache.protected_size()
        out["total"] = self.cache.total_size()
        return out

    def dump_tree(self) -> list:
        return mamba_tree_dump(self.cache.root_node)

    def uncached(self) -> tuple[int, int]:
        """(full slots, state slots) the requests hold: their own state slot and their ping-pong slots."""
        full, _ = super().uncached()
        states = 0
        for r in self.reqs.values():
            buf = r.kv.mamba_ping_pong_track_buffer
            states += int(r.kv.holds_mamba) + (0 if buf is None else int((buf != -1).sum()))
        return full, states

    def check_memory(self) -> None:
        c, r2t = self.cache, self.r2t
        full_uncached, states_held = self.uncached()
        for leak, msg in (
            SchedulerInvariantChecker._check_pool_invariant(
                "full", self.alloc.available_size(), c.full_evictable_size(), c.full_protected_size(), 0,
                self.size, full_uncached),
            SchedulerInvariantChecker._check_pool_invariant(
                "mamba", r2t.mamba_allocator.available_size(), c.mamba_evictable_size(), c.mamba_protected_size(),
                0, r2t.mamba_pool.size, states_held),
        ):
            assert not leak, msg
        if not c.disable and not any(r.kv.holds_kv or r.rid in self.admitted for r in self.reqs.values()):
            # SGLang's tree check is an idle one (no node locked).
            c.sanity_check()
        self.check_kvcore()

    def idle(self) -> bool:
        c, r2t = self.cache, self.r2t
        return (self.alloc.available_size() + c.full_evictable_size() == self.size
                and r2t.mamba_allocator.available_size() + c.mamba_evictable_size() == r2t.mamba_pool.size)


def mamba_tree_dump(root: Any) -> list:
    """Every node of a tree with a mamba component (SGLang's or kvcore's): (path, slots, full lock, state lock,
    state), sorted."""
    out = []
    stack = [((), root)]
    while stack:
        path, node = stack.pop()
        key = list(node.key.token_ids) if isinstance(node.key, RadixKey) else list(node.key)
        full = path + tuple(key)
        value, lock, state_lock, state = mamba_state(node)
        values = [] if value is None or isinstance(value, list) else value.tolist()
        out.append((full, values, None if node is root else lock, None if node is root else state_lock,
                    None if state is None else state.tolist()))
        for child in node.children.values():
            stack.append((full, child))
    return sorted(out, key=repr)


def mamba_state(node: Any) -> tuple:
    """(full slots, full lock, state lock, state slot) of a node of a tree with a mamba component.

    SGLang's unified node keeps them in its FULL and MAMBA component data; kvcore's unified
    node in ``value``, ``lock_ref``, ``mamba_lock_ref`` and ``mamba_value``.
    """
    data = getattr(node, "component_data", None)
    if data is not None:
        full, state = data[ComponentType.FULL], data[ComponentType.MAMBA]
        return full.value, full.lock_ref, state.lock_ref, state.value
    return node.value, node.lock_ref, node.mamba_lock_ref, node.mamba_value


def window_state(node: Any) -> tuple | None:
    """(full lock, window lock, tombstone) of a node of a windowed tree; None for a full-only tree's node.

    SGLang's unified node keeps them in its FULL and SWA component data; kvcore's unified
    node in ``lock_ref``, ``swa_lock_ref`` and ``swa_value``.
    """
    data = getattr(node, "component_data", None)
    if data is not None:
        if ComponentType.SWA not in node.component_types:
            return None
        swa = data[ComponentType.SWA]
        return data[ComponentType.FULL].lock_ref, swa.lock_ref, swa.value is None
    if hasattr(node, "swa_value"):
        return node.lock_ref, node.swa_lock_ref, node.swa_value is None
    return None


def tree_dump(root: Any) -> list:
    """Every node as (path of token ids, its slots, lock_ref[, window lock, tombstone]), sorted: the same for both.

    SGLang's unified nodes keep the full value and lock in their FULL component's data;
    nodes with a swa component (SGLang's and kvcore's) add the window lock and the tombstone mark.
    """
    out = []
    stack = [((), root)]
    while stack:
        path, node = stack.pop()
        key = list(node.key.token_ids) if isinstance(node.key, RadixKey) else list(node.key)
        data = getattr(node, "component_data", None)
        holder = node if data is None else data[ComponentType.FULL]
        value = [] if holder.value is None or isinstance(holder.value, list) else holder.value.tolist()
        full = path + tuple(key)
        # The root is never evicted: SGLang's unified root holds no lock where its RadixCache root holds one.
        window = window_state(node)
        lock = None if node is root else holder.lock_ref if window is None else window[0]
        row: tuple = (full, value, lock)
        if window is not None:
            row += (None, None) if node is root else window[1:]
        out.append(row)
        for child in node.children.values():
            stack.append((full, child))
    return sorted(out)


# ---------------------------------------------------------------------------- the random streams


def run_stream(seed: int, *, cache_kind: str, kvcore_name: str, page_size: int, steps: int,
               chunks: tuple[int, ...] = (8, 16, 1000), world: type[World] = World, size: int = 112,
               world_options: dict | None = None, finish_weight: float = 2, salts: bool = False,
               solo: bool = False, **params: Any) -> dict:
    """One seeded stream through SGLang's cache and the kvcore one; returns how often each step ran.

    ``finish_weight`` against decode's 5: lower makes requests decode longer (past a window).
    ``salts``: requests and probes also carry a ``cache_salt`` (two salts, or none).
    ``solo``: the kvcore world alone (a cache that does not promise SGLang's answers, such as
    another distribution's backend): SGLang's pool checks and kvcore's invariant checker after
    every step, no comparison.
    """
    rng = random.Random(seed)
    # Small pools: allocation often has to evict (evict_from_tree_cache) and admission to retract.
    kw = dict(size=size, page_size=page_size, rows=8, width=256, **(world_options or {}), **params)
    ours = world(cache_kind, kvcore_name=kvcore_name, **kw)
    ref = ours if solo else world(cache_kind, **kw)
    worlds = (ours,) if solo else (ref, ours)
    windowed = isinstance(ref, SWAWorld)
    stateful = isinstance(ref, MambaWorld)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 48))] for _ in range(6)]
    waiting: list[str] = []   # admitted next
    prefilling: dict[str, int] = {}   # rid -> chunk size
    running: list[str] = []
    counts = dict.fromkeys(["admit", "chunk", "decode", "finish", "abort", "retract", "evict", "probe", "pressure",
                            "alloc_evict", "window_free", "window_lock", "match_waiting"], 0)
    next_id = 0

    def both(method: str, *args: Any) -> Any:
        answers = [getattr(w, method)(*args) for w in worlds]
        assert answers[0] == answers[-1], f"seed {seed}: {method}{args}: SGLang {answers[0]} kvcore {answers[1]}"
        return answers[0]

    def need_tokens(n_new: int) -> int:
        return n_new + (len(running) + 1) * page_size

    for step in range(steps):
        live = len(prefilling) + len(running)
        # One of the steps possible now, by weight (no fall-through to whatever comes last).
        weights = {
            "new": 3 if len(waiting) < 4 else 0,
            "admit": 3 if waiting and live < 6 else 0,
            "chunk": 4 if prefilling else 0,
            "decode": 5 if running else 0,
            "finish": finish_weight if running else 0,
            "abort": 0.6 if live else 0,
            "evict": 0.4,
            "probe": 0.8,
            # Last, so that streams of the other worlds draw exactly as before.
            "match_waiting": 0.8 if stateful and waiting else 0,
        }
        op = rng.choices(list(weights), weights=list(weights.values()))[0]
        if op == "new":
            base = rng.choice(prompts)
            ids = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 24))]
            while stateful and page_size > 1 and len(ids) <= page_size:
                # Prompts past one page with pages: kept from the streams against SGLang 0.5.19's former
                # MambaRadixCache (it failed on an admission key ending inside a child's first page), so
                # the streams draw as before.
                ids.append(rng.randrange(1, 40))
            rid = f"r{next_id}"
            next_id += 1
            extra = rng.choice([None, None, None, "lora-a"])
            salt = rng.choice([None, None, "salt-1", "salt-2"]) if salts else None
            for w in worlds:
                w.new_req(rid, ids, extra, salt)
            waiting.append(rid)
        elif op == "admit":
            rid = waiting[0]
            req = ref.reqs[rid]
            # PrefillAdder's budget: what the whole prompt needs must fit in free + evictable.
            want = len(req.origin_input_ids) + len(req.output_ids)
            if need_tokens(want) > ref.admit_room():
                counts["pressure"] += 1
                if running:
                    victim = running.pop(rng.randrange(len(running)))
                    both("retract", victim, len(running))
                    waiting.append(victim)
                    counts["retract"] += 1
                continue
            waiting.pop(0)
            both("admit", rid)
            prefilling[rid] = rng.choice(chunks)
            counts["admit"] += 1
        elif op == "chunk":
            rid = rng.choice(sorted(prefilling))
            req = ref.reqs[rid]
            start = len(req.prefix_indices)
            end = min(len(req.full_untruncated_fill_ids), start + prefilling[rid])
            if need_tokens(end - start) > ref.room():
                counts["pressure"] += 1
                continue
            # What evict_from_tree_cache asks for before this allocation (SGLang over-estimates a page when paged).
            counts["alloc_evict"] += (end - start) + (page_size if page_size > 1 else 0) > ref.free_now()
            both("extend", rid, prefilling[rid])
            counts["chunk"] += 1
            if end == len(req.full_untruncated_fill_ids):
                del prefilling[rid]
                both("sample_first", rid, rng.randrange(1, 40))
                running.append(rid)
        elif op == "decode":
            batch = rng.sample(running, rng.randrange(1, len(running) + 1))
            if need_tokens(len(batch)) > ref.room():
                counts["pressure"] += 1
                victim = running.pop(rng.randrange(len(running)))
                both("retract", victim, len(running))
                waiting.append(victim)
                counts["retract"] += 1
                continue
            if windowed:
                # maybe_evict_swa runs before the decode batch's allocation.
                before = ref.alloc.swa_available_size()
                both("free_window", sorted(batch), page_size)
                counts["window_free"] += ref.alloc.swa_available_size() > before
                for rid in sorted(batch):
                    r = ref.reqs[rid]
                    if (r.last_node is not None and r.swa_uuid_for_lock is not None
                            and not r.swa_prefix_lock_released and len(r.output_ids) >= ref.window
                            and rng.random() < 0.5):
                        both("release_window_lock", rid)
                        counts["window_lock"] += 1
            counts["alloc_evict"] += len(batch) * page_size > ref.free_now()
            both("decode", sorted(batch), [rng.randrange(1, 40) for _ in batch])
            counts["decode"] += 1
        elif op == "finish":
            rid = running.pop(rng.randrange(len(running)))
            both("finish", rid)
            counts["finish"] += 1
        elif op == "abort":
            pool = sorted(prefilling) + running
            rid = rng.choice(pool)
            prefilling.pop(rid, None)
            if rid in running:
                running.remove(rid)
            # An aborted request: SGLang releases it without inserting (nothing was admitted twice).
            both("finish", rid, False)
            counts["abort"] += 1
        elif op == "evict":
            n = rng.randrange(0, 3 * page_size * 4)
            if windowed:
                both("evict", n, rng.choice([0, 0, rng.randrange(0, 3 * page_size * 4)]))
            elif stateful:
                both("evict", n, rng.choice([0, 0, rng.randrange(0, 4)]))
            else:
                both("evict", n)
            counts["evict"] += 1
        elif op == "match_waiting":
            both("match_waiting", rng.choice(waiting))
            counts["match_waiting"] += 1
        else:
            base = rng.choice(prompts)
            both("probe", base[: rng.randrange(0, len(base) + 1)], rng.choice([None, "lora-a"]),
                 rng.choice([None, "salt-1"]) if salts else None)
            counts["probe"] += 1
            locked = sorted(r for r in ref.reqs if ref.reqs[r].last_node is not None)
            if locked and not ref.cache.is_chunk_cache() and not windowed:
                both("dfs_order", locked)
        s0, s1 = (ours.state(), {}) if solo else (ref.state(), ours.state())
        for field in s1:
            assert s0[field] == s1[field], (
                f"seed {seed} step {step} ({op}): {field} differs\nSGLang: {s0[field]}\nkvcore: {s1[field]}"
            )
        for w in worlds:
            w.check_memory()
    # Drain: everything finishes, the pools hold only the tree, and SGLang's idle check holds exactly.
    for rid in sorted(prefilling) + running + (waiting if stateful else []):
        both("finish", rid, False)
    for w in worlds:
        w.check_memory()
        assert w.idle()
    assert solo or ref.state() == ours.state()
    counts["sglang_undercounts"] = getattr(ref, "undercounts", 0)
    return counts

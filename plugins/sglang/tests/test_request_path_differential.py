"""Differential through SGLang 0.5.19's own request path: SGLang's cache against the kvcore one from the registry.

Two worlds, each with its own SGLang pools (``ReqToTokenPool``, ``TokenToKVPoolAllocator``
or ``PagedTokenToKVPoolAllocator``) and SGLang ``Req`` objects: one runs SGLang's
``RadixCache`` (or ``ChunkCache``), the other the cache ``create_tree_cache`` builds for
``--radix-cache-backend kvcore-radix`` (``kvcore-chunk``).  Seeded random streams
(admit, chunked prefill, decode, finish, abort, retract, explicit eviction and eviction
under memory pressure) go through SGLang's own code in both: ``Req.init_next_round_input``
(the match), ``alloc_req_slots``, ``alloc_token_slots``, ``alloc_paged_token_slots_extend``,
``alloc_paged_token_slots_decode`` (which evict through ``evict_from_tree_cache``),
``maybe_cache_unfinished_req``, ``release_kv_cache`` and ``release_req`` (retraction).
After every step both worlds must agree on every answer (matched slots, lock and evict
results), every size, the exact free lists, every request record and row, the tree and
the KV events; SGLang's own pool check (``SchedulerInvariantChecker._check_pool_invariant``:
available + evictable + protected + session_held + uncached == total) must hold in both,
and kvcore's ``InvariantChecker`` in the kvcore world.

Stubbed because they cannot run on a CPU-only machine (and nothing else):

* SGLang's paged allocation kernels ``alloc_extend_kernel`` and ``alloc_decode_kernel``
  (Triton; they need a GPU): replaced by SGLang's own CPU reference
  ``alloc_extend_naive`` and a loop that does what ``alloc_decode_kernel`` does.
* ``write_cache_indices`` (Triton or sgl_kernel): the driver writes the prefix and the
  new slots into the req_to_token row with slice assignments, as that kernel does.
* The model forward: no K/V is computed; sampled tokens come from the seeded RNG.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from kvcore_sglang.v0_5_19 import KvcoreTreeCache, owner_of
from sglang.srt.managers.schedule_batch import Req, release_req
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocator import paged
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator, alloc_extend_naive
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams

import kvcore

# ---------------------------------------------------------------------------- CPU stand-ins for the Triton kernels


class _Launch:
    """``kernel[grid](...)`` for a CPU function that does the whole grid at once."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _alloc_extend_cpu(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)


def _alloc_decode_cpu(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    # alloc_decode_kernel: a request whose new token opens a page takes the next free page, in batch order.
    taken = 0
    for i in range(len(seq_lens)):
        seq_len = int(seq_lens[i])
        if (seq_len - 1) % page_size == 0:
            out_indices[i] = free_pages[taken] * page_size
            taken += 1
        else:
            out_indices[i] = last_loc[i] + 1


@pytest.fixture(autouse=True)
def _server_args():
    # A scheduler process runs with its ServerArgs published; SGLang's request path reads them.
    with get_context().override_server_args():
        yield


@pytest.fixture(autouse=True)
def _cpu_kernels(monkeypatch):
    monkeypatch.setattr(paged, "alloc_extend_kernel", _Launch(_alloc_extend_cpu))
    monkeypatch.setattr(paged, "alloc_decode_kernel", _Launch(_alloc_decode_cpu))


# ------------------------------------------------------------------ one world: SGLang's pools, a cache, requests


class World:
    """SGLang's pools, one tree cache on them, and the scheduler steps this test drives."""

    def __init__(self, cache_kind: str, *, size: int, page_size: int, rows: int, width: int, kvcore_name=None,
                 **params):
        self.page_size = page_size
        self.size = size
        self.r2t = ReqToTokenPool(rows, width, "cpu", False)
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)
        init = CacheInitParams(disable=params.pop("disable", False), req_to_token_pool=self.r2t,
                               token_to_kv_pool_allocator=self.alloc, page_size=page_size, **params)
        if kvcore_name is None:
            if cache_kind == "unified":
                init.tree_components = (ComponentType.FULL,)
                self.cache = UnifiedRadixCache(init)
            else:
                self.cache = RadixCache(init) if cache_kind == "radix" else ChunkCache(init)
        else:
            load_plugins()
            with get_context().override_server_args(radix_cache_backend=kvcore_name) as server_args:
                ctx = TreeCacheBuildContext(
                    server_args=server_args, params=init, is_hybrid_swa=False, is_hybrid_ssm=False,
                    enable_hierarchical_cache=False, disable_radix_cache=False, effective_chunked_prefill_size=None,
                    tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
                )
                self.cache = create_tree_cache(ctx)
            assert isinstance(self.cache, KvcoreTreeCache)
        self.reqs: dict[str, Req] = {}

    # -- the scheduler's steps, through SGLang's own functions
    def new_req(self, rid: str, ids: list[int], extra_key) -> None:
        self.reqs[rid] = Req(rid, "", array("q", ids), SamplingParams(), extra_key=extra_key)

    def admit(self, rid: str):
        """Match (Req.init_next_round_input) and lock, as PrefillAdder does; returns the matched slots."""
        req = self.reqs[rid]
        req.init_next_round_input(self.cache)
        self.cache.inc_lock_ref(req.last_node)
        return req.prefix_indices.tolist()

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
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        more = end < len(req.full_untruncated_fill_ids)
        maybe_cache_unfinished_req(req, self.cache, chunked=more)
        return start, end, out.tolist()

    def decode(self, rids: list[str], tokens: list[int]) -> list:
        reqs = [self.reqs[r] for r in rids]
        if self.page_size == 1:
            out = allocation.alloc_token_slots(self.cache, len(reqs))
        else:
            seq = torch.tensor([r.kv.kv_committed_len + 1 for r in reqs])
            last = torch.stack([self.r2t.req_to_token[r.kv.req_pool_idx, r.kv.kv_committed_len - 1] for r in reqs])
            out = allocation.alloc_paged_token_slots_decode(self.cache, seq, seq.clone(), last.to(torch.int64))
        for req, slot, tok in zip(reqs, out.tolist(), tokens):
            self.r2t.req_to_token[req.kv.req_pool_idx, req.kv.kv_committed_len] = slot
            req.kv.kv_allocated_len += 1
            req.kv.kv_committed_len += 1
            req.output_ids.append(tok)
        return out.tolist()

    def sample_first(self, rid: str, token: int) -> None:
        self.reqs[rid].output_ids.append(token)

    def finish(self, rid: str, is_insert: bool = True) -> None:
        req = self.reqs.pop(rid)
        if req.kv.holds_kv:
            release_kv_cache(req, self.cache, is_insert=is_insert)
        elif req.last_node is not None:
            # Admitted (matched and locked) but no chunk ran yet: only the lock is given back.
            self.cache.dec_lock_ref(req.last_node)

    def retract(self, rid: str, remaining: int) -> None:
        release_req(req=self.reqs[rid], remaing_req_count=remaining, req_to_token_pool=self.r2t,
                    token_to_kv_pool_allocator=self.alloc, tree_cache=self.cache, hisparse_coordinator=None,
                    offload_kv=False)

    def evict(self, n: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    def probe(self, ids: list[int], extra_key) -> tuple:
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), extra_key)))
        return m.device_indices.tolist()

    def dfs_order(self, rids: list[str]) -> list[int]:
        """The DFS-weight schedule policy's order of these requests (it walks root_node's children)."""
        return self.cache.dfs_weight_order([self.reqs[r].last_node for r in rids])

    # -- what the two worlds must agree on
    def state(self) -> dict:
        a = self.alloc
        cache = self.cache
        reqs = {}
        for rid, r in sorted(self.reqs.items()):
            kv = r.kv
            held = kv.req_pool_idx is not None
            row = self.r2t.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].tolist() if held else []
            reqs[rid] = (kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len, kv.kv_allocated_len, row,
                         r.prefix_indices.tolist(), list(r.output_ids))
        return {
            "free_pages": a.free_pages.tolist(),
            "release_pages": a.release_pages.tolist(),
            "available": a.available_size(),
            "rows": list(self.r2t.free_slots),
            "evictable": cache.evictable_size(),
            "protected": cache.protected_size(),
            "total": None if cache.is_chunk_cache() else full_total(cache),
            "tree": None if cache.is_chunk_cache() else tree_dump(cache.root_node),
            "reqs": reqs,
            "events": [repr(e) for e in cache.take_events()],
        }

    def check_memory(self) -> None:
        """SGLang's own pool check (the scheduler's, busy form: running requests' slots counted as uncached)."""
        ps = self.page_size
        uncached = 0
        for r in self.reqs.values():
            if r.kv.holds_kv:
                allocated = -(-r.kv.kv_allocated_len // ps) * ps
                uncached += allocated - r.kv.cache_protected_len
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", self.alloc.available_size(), self.cache.evictable_size(), self.cache.protected_size(), 0,
            self.size, uncached,
        )
        assert not leak, msg
        if isinstance(self.cache, KvcoreTreeCache):
            kvcore.InvariantChecker(self.cache.kvcore_cache).check(owners=[owner_of(r) for r in self.reqs.values()])


def full_total(cache) -> int:
    total = cache.total_size()
    # SGLang's UnifiedRadixCache answers (full, swa) tokens.
    return total[0] if isinstance(total, tuple) else total


def tree_dump(root) -> list:
    """Every node as (path of token ids, its slots, lock_ref), children in key order: the same for both trees."""
    out = []
    stack = [((), root)]
    while stack:
        path, node = stack.pop()
        key = list(node.key.token_ids) if isinstance(node.key, RadixKey) else list(node.key)
        data = getattr(node, "component_data", None)
        # SGLang's unified nodes keep the full value and lock in their FULL component's data.
        holder = node if data is None else data[ComponentType.FULL]
        value = [] if holder.value is None or isinstance(holder.value, list) else holder.value.tolist()
        full = path + tuple(key)
        # The root is never evicted: SGLang's unified root holds no lock where its RadixCache root holds one.
        out.append((full, value, holder.lock_ref if node is not root else None))
        for child in node.children.values():
            stack.append((full, child))
    return sorted(out)


# ---------------------------------------------------------------------------- the random streams


def run_stream(seed: int, *, cache_kind: str, kvcore_name: str, page_size: int, steps: int,
               chunks: tuple[int, ...] = (8, 16, 1000), **params) -> dict:
    rng = random.Random(seed)
    # Small pools: allocation often has to evict (evict_from_tree_cache) and admission to retract.
    size = 112
    kw = dict(size=size, page_size=page_size, rows=8, width=256, **params)
    ref = World(cache_kind, **kw)
    ours = World(cache_kind, kvcore_name=kvcore_name, **kw)
    worlds = (ref, ours)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 48))] for _ in range(6)]
    waiting: list[str] = []   # admitted next
    prefilling: dict[str, int] = {}   # rid -> chunk size
    running: list[str] = []
    counts = dict.fromkeys(["admit", "chunk", "decode", "finish", "abort", "retract", "evict", "probe", "pressure",
                                 "alloc_evict"], 0)
    next_id = 0

    def both(method: str, *args):
        answers = [getattr(w, method)(*args) for w in worlds]
        assert answers[0] == answers[1], f"seed {seed}: {method}{args}: SGLang {answers[0]} kvcore {answers[1]}"
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
            "finish": 2 if running else 0,
            "abort": 0.6 if live else 0,
            "evict": 0.4,
            "probe": 0.8,
        }
        op = rng.choices(list(weights), weights=list(weights.values()))[0]
        if op == "new":
            base = rng.choice(prompts)
            ids = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 24))]
            rid = f"r{next_id}"
            next_id += 1
            extra = rng.choice([None, None, None, "lora-a"])
            for w in worlds:
                w.new_req(rid, ids, extra)
            waiting.append(rid)
        elif op == "admit":
            rid = waiting[0]
            req = ref.reqs[rid]
            # PrefillAdder's budget: what the whole prompt needs must fit in free + evictable.
            want = len(req.origin_input_ids) + len(req.output_ids)
            if need_tokens(want) > ref.alloc.available_size() + ref.cache.evictable_size():
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
            if need_tokens(end - start) > ref.alloc.available_size() + ref.cache.evictable_size():
                counts["pressure"] += 1
                continue
            # What evict_from_tree_cache asks for before this allocation (SGLang over-estimates a page when paged).
            counts["alloc_evict"] += (end - start) + (page_size if page_size > 1 else 0) > ref.alloc.available_size()
            both("extend", rid, prefilling[rid])
            counts["chunk"] += 1
            if end == len(req.full_untruncated_fill_ids):
                del prefilling[rid]
                both("sample_first", rid, rng.randrange(1, 40))
                running.append(rid)
        elif op == "decode":
            batch = rng.sample(running, rng.randrange(1, len(running) + 1))
            if need_tokens(len(batch)) > ref.alloc.available_size() + ref.cache.evictable_size():
                counts["pressure"] += 1
                victim = running.pop(rng.randrange(len(running)))
                both("retract", victim, len(running))
                waiting.append(victim)
                counts["retract"] += 1
                continue
            counts["alloc_evict"] += len(batch) * page_size > ref.alloc.available_size()
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
            both("evict", rng.randrange(0, 3 * page_size * 4))
            counts["evict"] += 1
        else:
            base = rng.choice(prompts)
            both("probe", base[: rng.randrange(0, len(base) + 1)], rng.choice([None, "lora-a"]))
            counts["probe"] += 1
            locked = sorted(r for r in ref.reqs if ref.reqs[r].last_node is not None)
            if locked and not ref.cache.is_chunk_cache():
                both("dfs_order", locked)
        s0, s1 = ref.state(), ours.state()
        for field in s0:
            assert s0[field] == s1[field], (
                f"seed {seed} step {step}: {field} differs\nSGLang: {s0[field]}\nkvcore: {s1[field]}"
            )
        for w in worlds:
            w.check_memory()
    # Drain: everything finishes, the pools hold only the tree, and SGLang's idle check holds exactly.
    for rid in sorted(prefilling) + running:
        both("finish", rid, False)
    for w in worlds:
        w.check_memory()
        assert w.alloc.available_size() + w.cache.evictable_size() == w.size
    assert ref.state() == ours.state()
    return counts


SEEDS = range(4)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_kvcore_radix_matches_sglang_radix_cache(seed, page_size):
    counts = run_stream(seed, cache_kind="radix", kvcore_name="kvcore-radix", page_size=page_size, steps=250,
                        enable_kv_cache_events=seed % 2 == 0)
    # The stream really did each thing (else the comparison proves little).
    for what in ("admit", "chunk", "decode", "finish", "abort", "retract", "evict", "probe", "alloc_evict"):
        assert counts[what] > 0, counts


@pytest.mark.parametrize("policy", ["lfu", "fifo", "priority"])
def test_kvcore_radix_matches_sglang_other_eviction_policies(policy):
    run_stream(7, cache_kind="radix", kvcore_name="kvcore-radix", page_size=1, steps=200, eviction_policy=policy)


@pytest.mark.parametrize("name", ["radix", "unified"])
def test_disabled_tree_matches_sglang(name):
    """``disable`` (SGLang's --disable-radix-cache with a registered backend): nothing is matched or kept.

    Whole prompts only: a disabled RadixCache (SGLang's and so kvcore's) keeps no prefix between
    chunks, since SGLang serves chunked prefill with --disable-radix-cache from a ChunkCache.
    """
    run_stream(5, cache_kind=name, kvcore_name=f"kvcore-{name}", page_size=4, steps=120, chunks=(1000,),
               disable=True)


def test_kvcore_radix_disable_finished_insert():
    run_stream(3, cache_kind="radix", kvcore_name="kvcore-radix", page_size=4, steps=150,
               disable_finished_insert=True)


# Found by this test, left to kvcore-unified (plugins/unified/kvcore_unified/tree.py, evict): with pages, it gives an
# eviction's slots back in one sorted ``free``, where SGLang's UnifiedRadixCache gives each evicted node back with
# ``free_segment`` in eviction order (as kvcore's radix does); every answer and size agrees, the free-list order does
# not, so later allocations get other slots.  Strict: it fails once that is fixed, and this mark must go.
_UNIFIED_PAGED_ORDER = pytest.mark.xfail(
    strict=True, reason="kvcore-unified frees a paged eviction in one sorted free(), SGLang per node (free_segment)")


@pytest.mark.parametrize("page_size", [1, pytest.param(4, marks=_UNIFIED_PAGED_ORDER)])
@pytest.mark.parametrize("seed", SEEDS)
def test_kvcore_unified_matches_sglang_unified_radix_cache(seed, page_size):
    counts = run_stream(seed, cache_kind="unified", kvcore_name="kvcore-unified", page_size=page_size, steps=250,
                        enable_kv_cache_events=seed % 2 == 0)
    for what in ("admit", "chunk", "decode", "finish", "retract", "evict", "alloc_evict"):
        assert counts[what] > 0, counts


@pytest.mark.parametrize("page_size", [1, 4])
def test_kvcore_chunk_matches_sglang_chunk_cache(page_size):
    run_stream(11, cache_kind="chunk", kvcore_name="kvcore-chunk", page_size=page_size, steps=200)

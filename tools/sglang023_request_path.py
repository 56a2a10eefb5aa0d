"""SGLang 0.5.23's own request path on a CPU, for the kvcore-sglang differentials on 0.5.23 (real SGLang, installed).

Needs the real SGLang 0.5.23 of ``.venv-sglang-0.5.23`` (``./dev sglang-venv 0.5.23``); only
``plugins/sglang/tests/test_v0_5_23_*.py`` import it.  The scheduler steps are SGLang
0.5.23's own functions: ``Req.init_next_round_input`` (``common.match_kv_cache``), the
admission's ``tree_cache.lock``, ``allocation._prefix_kv_indices`` (``prefix_device_indices``
for a new request), ``alloc_req_slots``, ``alloc_token_slots`` /
``alloc_paged_token_slots_extend`` / ``_decode`` (evicting through
``evict_from_tree_cache``), ``common.checkpoint_kv_cache`` after every prefill chunk,
``common.release_kv_cache`` (``checkpoint=True`` at a finish, ``False`` at an abort) and
``schedule_batch.release_req`` (retraction).  What it stands in for: the model forward (a
sampled token from the seeded RNG) and ``write_cache_indices`` (slice assignments into the row,
as that kernel writes); SGLang 0.5.23's allocators take their torch paths on a CPU, so no
kernel is replaced.

:func:`run_stream` drives one seeded random stream through SGLang's cache and the kvcore
cache built through SGLang's registry and compares, after every step, every answer, the
free lists, the sizes, every request's record and row, the tree (slots, locks, hit counts,
priorities), the DFS-weight order and the KV events; SGLang's pool check holds in both
worlds, kvcore's ``InvariantChecker`` in the kvcore one.
"""

from __future__ import annotations

import random
import types
from array import array
from typing import Any

import torch
from kvcore_sglang.v0_5_23 import KvcoreTreeCache, owner_of
from sglang.srt.disaggregation.kv_events import BlockRemoved
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, release_req
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams

import kvcore
from tools.sglang_decode_step import alloc_decode_slots, commit_decode

__all__ = ["SGLANG_CACHES", "World", "run_stream", "tree_rows"]


def _unified_full(init: Any) -> Any:
    """SGLang 0.5.23's default tree on a full-attention model: ``UnifiedRadixCache`` with its one component full.

    Its tree core is the one ``init.tree_core_backend`` names (:func:`run_stream`'s ``tree_core``;
    None: ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, ``rust`` by default, falling back to ``python``).
    """
    init.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(init)


#: SGLang 0.5.23's own cache per kvcore name it is compared with (kvcore-chunk: what SGLang builds for
#: ``--disable-radix-cache`` on a full-attention model, the registry's default disabled).
SGLANG_CACHES = {"kvcore-radix": RadixCache, "kvcore-unified": _unified_full, "kvcore-chunk": _unified_full}


class World:
    """SGLang 0.5.23's pools, one cache on them (SGLang's own, or the one its registry builds for a kvcore name)."""

    def __init__(self, name: str, *, own: bool, size: int, page_size: int, rows: int, width: int,
                 disable: bool = False, tree_core: str | None = None, **params: Any):
        self.name = name
        self.size = size
        self.page_size = page_size
        self.r2t = ReqToTokenPool(rows, width, "cpu", False)
        if page_size == 1:
            self.alloc: Any = TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)
        disable = disable or name == "kvcore-chunk"
        init = CacheInitParams(disable=disable, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                               page_size=page_size, **params)
        # SGLang's Rust tree core keeps no Python nodes (its tree is compared as the KV-canary walk's rows), and
        # publishes one BlockRemoved per evicted node where its Python core and kvcore publish one per eviction
        # (the same blocks in the same order): consecutive removals are compared merged.
        self.rust_core = tree_core == "rust"
        if own:
            init.tree_core_backend = tree_core
            self.cache = SGLANG_CACHES[name](init)
            core = getattr(self.cache, "_tree_core_backend", None)
            assert tree_core is None or core == tree_core, f"asked for the {tree_core} tree core, got {core}"
        else:
            load_plugins()
            with get_context().override_server_args(radix_cache_backend=name) as server_args:
                self.cache = create_tree_cache(TreeCacheBuildContext(
                    server_args=server_args, params=init, is_hybrid_swa=False, is_hybrid_ssm=False,
                    enable_hierarchical_cache=False, disable_radix_cache=disable, tp_worker=None,
                    model_config=None, tp_size=1, tp_rank=0, tp_group=None,
                ))
            assert isinstance(self.cache, KvcoreTreeCache), self.cache
        # What the scheduler's allocation functions read of a batch.
        self.batch = types.SimpleNamespace(req_to_token_pool=self.r2t, tree_cache=self.cache)
        self.reqs: dict[str, Req] = {}

    # -- the scheduler's steps
    def new_req(self, rid: str, ids: list[int], extra_key: str | None, cache_salt: str | None) -> None:
        self.reqs[rid] = Req(rid, "", array("q", ids), SamplingParams(), extra_key=extra_key, cache_salt=cache_salt)

    def match(self, rid: str) -> tuple:
        """The scheduler's match of a request (waiting, or about to be admitted): its prefix and the slots."""
        req = self.reqs[rid]
        req.init_next_round_input(self.cache)
        slots = self.cache.prefix_device_indices(req).tolist() if req.prefix_len else []
        return req.prefix_len, slots

    def admit(self, rid: str, chunk: int) -> tuple:
        """PrefillAdder's admission (match, lock on the match) and the request's first chunk, as one batch runs it."""
        found = self.match(rid)
        req = self.reqs[rid]
        req.lock = self.cache.lock(req.last_node)
        return found, self.extend(rid, chunk)

    def extend(self, rid: str, chunk: int) -> tuple:
        """One prefill chunk (``alloc_for_extend`` for one request), then the scheduler's checkpoint."""
        req = self.reqs[rid]
        start = req.prefix_len
        end = min(len(req.full_untruncated_fill_ids), start + chunk)
        req.extend_end = end
        prefix = allocation._prefix_kv_indices(self.batch, req)
        allocation.alloc_req_slots(self.r2t, [req], self.cache)
        row = self.r2t.req_to_token[req.kv.req_pool_idx]
        row[:start] = prefix.to(torch.int32)
        n = end - start
        if self.page_size == 1:
            out = allocation.alloc_token_slots(self.cache, n)
        else:
            last = row[start - 1 : start].to(torch.int64) if start else torch.full((1,), -1, dtype=torch.int64)
            lens = torch.tensor([start]), torch.tensor([end])
            out = allocation.alloc_paged_token_slots_extend(self.cache, lens[0], lens[0], lens[1], lens[1], last, n)
        row[start:end] = out.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        return start, end, out.tolist()

    def after_chunk(self, rid: str, token: int | None) -> None:
        """After a chunk's forward: the last chunk samples a token; either way the scheduler checkpoints."""
        req = self.reqs[rid]
        if token is not None:
            req.output_ids.append(token)
        checkpoint_kv_cache(req, self.cache)

    def decode(self, rids: list[str], tokens: list[int]) -> list:
        reqs = [self.reqs[r] for r in rids]
        return commit_decode(self.r2t, reqs, alloc_decode_slots(self.cache, self.r2t, self.page_size, reqs), tokens)

    def finish(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)

    def abort(self, rid: str) -> None:
        release_kv_cache(self.reqs.pop(rid), self.cache, checkpoint=False)

    def retract(self, rid: str, remaining: int) -> None:
        release_req(req=self.reqs[rid], remaing_req_count=remaining, req_to_token_pool=self.r2t,
                    token_to_kv_pool_allocator=self.alloc, tree_cache=self.cache, hisparse_coordinator=None,
                    offload_kv=False)

    def evict(self, n: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    def probe(self, ids: list[int], extra_key: str | None, cache_salt: str | None, touch: bool) -> Any:
        key = RadixKey(array("q", ids), extra_key, cache_salt=cache_salt)
        if touch:
            return self.cache.touch_prefix(key)
        found = self.cache.match_prefix(MatchPrefixParams(key=key))
        return found.device_prefix_len, self.cache.path_device_indices(found.last_device_node).tolist()

    def dfs_order(self, rids: list[str]) -> list[int]:
        return self.cache.dfs_weight_order([self.reqs[r].last_node for r in rids])

    # -- what the two worlds must agree on
    def state(self) -> dict:
        cache = self.cache
        total = cache.total_size()
        sharing = cache.supports_prefix_sharing()
        return {
            "free_pages": self.alloc.get_all_free_pages().tolist(),
            "available": self.alloc.available_size(),
            "rows": list(self.r2t.free_slots),
            "evictable": cache.evictable_size(),
            "protected": cache.protected_size(),
            # SGLang's UnifiedRadixCache answers (full, swa) tokens.
            "total": total[0] if isinstance(total, tuple) else total,
            "sharing": sharing,
            "tree": (canary_rows(cache) if self.rust_core else tree_rows(cache.root_node)) if sharing else None,
            "reqs": {rid: self.req_state(r) for rid, r in sorted(self.reqs.items())},
            "events": [repr(e) for e in (merged_removals if self.rust_core else list)(cache.take_events())],
        }

    def req_state(self, r: Req) -> tuple:
        kv = r.kv
        row = self.r2t.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].tolist() if kv.holds_kv else []
        return (kv.req_pool_idx, kv.cache_protected_len, kv.cache_inserted_len, kv.kv_committed_len,
                kv.kv_allocated_len, dict(kv.component_evicted_seqlens), row, r.prefix_len, r.lock is None,
                list(r.output_ids))

    def check_memory(self) -> None:
        ps = self.page_size
        uncached = sum(-(-r.kv.kv_allocated_len // ps) * ps - r.kv.cache_protected_len
                       for r in self.reqs.values() if r.kv.holds_kv)
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full", self.alloc.available_size(), self.cache.evictable_size(), self.cache.protected_size(), 0,
            self.size, uncached)
        assert not leak, msg
        if isinstance(self.cache, KvcoreTreeCache):
            kvcore.InvariantChecker(self.cache.kvcore_cache).check(owners=[owner_of(r) for r in self.reqs.values()])

    def idle(self) -> bool:
        return self.alloc.available_size() + self.cache.evictable_size() == self.size


def tree_rows(root: Any) -> list:
    """Every node of a radix tree, SGLang's or kvcore's: (path, slots, lock, hit count, priority), sorted.

    SGLang's unified tree core keeps a node's slots and lock in its full component's data.
    """
    rows = []
    stack = [((), root)]
    while stack:
        path, node = stack.pop()
        key = node.key.token_ids if isinstance(node.key, RadixKey) else node.key
        full = path + tuple(key or ())
        data = node.component_data[ComponentType.FULL] if hasattr(node, "component_data") else node
        value = [] if data.value is None or isinstance(data.value, list) else data.value.tolist()
        if node is not root:
            rows.append((full, value, data.lock_ref, node.hit_count, node.priority))
        stack.extend((full, child) for child in node.children.values())
    return sorted(rows)


def merged_removals(events: list) -> list:
    """KV events with each run of consecutive ``BlockRemoved`` merged into one (their blocks in order)."""
    out: list = []
    for e in events:
        if isinstance(e, BlockRemoved) and out and isinstance(out[-1], BlockRemoved) and out[-1].medium == e.medium:
            out[-1] = BlockRemoved(block_hashes=[*out[-1].block_hashes, *e.block_hashes], medium=e.medium)
        else:
            out.append(e)
    return out


def canary_rows(cache: Any) -> tuple:
    """The tree as SGLang's KV-canary walk flattens it: (slot, position, slot before it) of every node's slots,
    sorted, then the same rows of the unlocked nodes only.  kvcore's tree is walked here the same way."""
    if not isinstance(cache, KvcoreTreeCache):
        core = cache.tree_core
        walks = [core.walk_for_kv_canary(unlocked_only=u, swa_resident_only=False) for u in (False, True)]
        return tuple(sorted(zip(w.slot_indices.tolist(), w.positions.tolist(), w.prev_slot_indices.tolist()))
                     for w in walks)
    everything: list = []
    unlocked: list = []
    stack = [(cache.root_node, 0, -1)]
    while stack:
        node, depth, before = stack.pop()
        slots = [] if node is cache.root_node else node.value.tolist()
        for j, slot in enumerate(slots):
            row = (slot, depth + j, before if j == 0 else slots[j - 1])
            everything.append(row)
            if node.lock_ref == 0:
                unlocked.append(row)
        last = slots[-1] if slots else before
        stack.extend((child, depth + len(slots), last) for child in node.children.values())
    return sorted(everything), sorted(unlocked)


def run_stream(seed: int, *, name: str, page_size: int, steps: int, size: int = 112,
               chunks: tuple[int, ...] = (8, 16, 1000), salts: bool = False, **params: Any) -> dict:
    """One seeded stream through SGLang 0.5.23's cache and kvcore's (``name``); returns how often each step ran."""
    rng = random.Random(seed)
    kw = dict(size=size, page_size=page_size, rows=8, width=256, **params)
    ref, ours = World(name, own=True, **kw), World(name, own=False, **kw)
    prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 48))] for _ in range(6)]
    waiting: list[str] = []
    prefilling: dict[str, int] = {}
    running: list[str] = []
    counts: dict[str, int] = {}
    next_id = 0

    def both(method: str, *args: Any) -> Any:
        a, b = getattr(ref, method)(*args), getattr(ours, method)(*args)
        assert a == b, f"seed {seed}: {method}{args}: SGLang {a} kvcore {b}"
        return a

    def room() -> int:
        return ref.alloc.available_size() + ref.cache.evictable_size()

    def need(n_new: int) -> int:
        return n_new + (len(running) + 1) * page_size

    def retract_one() -> None:
        victim = running.pop(rng.randrange(len(running)))
        both("retract", victim, len(running))
        waiting.append(victim)
        counts["retract"] = counts.get("retract", 0) + 1

    for step in range(steps):
        live = len(prefilling) + len(running)
        weights = {
            "new": 3 if len(waiting) < 4 else 0, "admit": 3 if waiting and live < 6 else 0,
            "chunk": 4 if prefilling else 0, "decode": 5 if running else 0, "finish": 2 if running else 0,
            "abort": 0.6 if live else 0, "evict": 0.4, "probe": 0.8, "match_waiting": 0.5 if waiting else 0,
        }
        op = rng.choices(list(weights), weights=list(weights.values()))[0]
        if op == "new":
            base = rng.choice(prompts)
            ids = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 24))]
            rid = f"r{next_id}"
            next_id += 1
            extra = rng.choice([None, None, None, "lora-a"])
            salt = rng.choice([None, None, "salt-1", "salt-2"]) if salts else None
            for w in (ref, ours):
                w.new_req(rid, ids, extra, salt)
            waiting.append(rid)
        elif op == "admit":
            rid = waiting[0]
            req = ref.reqs[rid]
            chunk = rng.choice(chunks)
            if need(len(req.origin_input_ids) + len(req.output_ids)) > room():
                counts["pressure"] = counts.get("pressure", 0) + 1
                if running:
                    retract_one()
                continue
            waiting.pop(0)
            both("admit", rid, chunk)
            done = req.extend_end == len(req.full_untruncated_fill_ids)
            both("after_chunk", rid, rng.randrange(1, 40) if done else None)
            (running.append(rid) if done else prefilling.__setitem__(rid, chunk))
        elif op == "chunk":
            rid = rng.choice(sorted(prefilling))
            req = ref.reqs[rid]
            n = min(len(req.full_untruncated_fill_ids) - req.prefix_len, prefilling[rid])
            if need(n) > room():
                counts["pressure"] = counts.get("pressure", 0) + 1
                continue
            both("extend", rid, prefilling[rid])
            done = req.extend_end == len(req.full_untruncated_fill_ids)
            both("after_chunk", rid, rng.randrange(1, 40) if done else None)
            if done:
                del prefilling[rid]
                running.append(rid)
        elif op == "decode":
            batch = sorted(rng.sample(running, rng.randrange(1, len(running) + 1)))
            if need(len(batch)) > room():
                counts["pressure"] = counts.get("pressure", 0) + 1
                retract_one()
                continue
            both("decode", batch, [rng.randrange(1, 40) for _ in batch])
        elif op == "finish":
            both("finish", running.pop(rng.randrange(len(running))))
        elif op == "abort":
            rid = rng.choice(sorted(prefilling) + running)
            prefilling.pop(rid, None)
            if rid in running:
                running.remove(rid)
            both("abort", rid)
        elif op == "evict":
            both("evict", rng.randrange(0, 3 * page_size * 4))
        elif op == "match_waiting":
            both("match", rng.choice(waiting))
        else:
            base = rng.choice(prompts)
            both("probe", base[: rng.randrange(0, len(base) + 1)], rng.choice([None, "lora-a"]),
                 rng.choice([None, "salt-1"]) if salts else None, rng.random() < 0.3)
            locked = sorted(r for r in ref.reqs if ref.reqs[r].lock is not None)
            if locked and ref.cache.supports_prefix_sharing():
                both("dfs_order", locked)
        counts[op] = counts.get(op, 0) + 1
        s0, s1 = ref.state(), ours.state()
        for field in s0:
            assert s0[field] == s1[field], (
                f"seed {seed} step {step} ({op}): {field} differs\nSGLang: {s0[field]}\nkvcore: {s1[field]}")
        ref.check_memory()
        ours.check_memory()
    for rid in sorted(prefilling) + running:
        both("abort", rid)
    for w in (ref, ours):
        w.check_memory()
        assert w.idle(), w.name
    assert ref.state() == ours.state()
    return counts

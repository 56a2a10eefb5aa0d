"""``mamba`` (the one tree, components full + mamba) against SGLang 0.5.23's ``UnifiedRadixCache`` (FULL, MAMBA).

Built with ``split_recency="keep"`` (0.5.23's split rule; see ``test_v0_5_23_swa_tree_differential.py``).
Seeded random direct operations (insert with a state slot, match, with the matched node sometimes
locked; unlock; evict of either pool) run through SGLang 0.5.23's own tree, on its Python tree core
and on its Rust one, and through kvcore's ``mamba``, at page size 1, side by side.  After every
operation every answer must agree (insert prefix lengths and ``mamba_exist``, matched lengths, slots
and branching points, evict counts), then both pools' free sizes and every component's
evictable/protected sizes; on the Python core also the whole tree (paths, slots, state slots, both
lock counts), the state LRU order and the evictable leaves by recency.  Slots and state slots are
compared through pairings made at allocation time (ours -> SGLang's).
"""

from __future__ import annotations

import random
import types
from array import array
from collections import Counter
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey as SKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context

from kvcore import InvariantChecker, RadixKey, create_cache
from tools.differential import ids, lru_order, path_tokens, tree_rows

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA
CHUNK = 2


def _state_shape() -> Any:
    """The model shape SGLang's ``MambaPool`` reads (a small one: a CPU holds every state)."""
    return types.SimpleNamespace(
        shape=types.SimpleNamespace(conv=[(6, 3)], temporal=(2, 4, 4), disable_conv_window_dedup=True),
        dtype=types.SimpleNamespace(conv=torch.float32, temporal=torch.float32),
        is_kda=False,
    )


@pytest.fixture(autouse=True)
def scheduler_context():
    # The mamba component reads its chunk size from the published server args (a model config otherwise).
    with get_context().override_server_args() as server_args:
        server_args._mamba_cache_chunk_size = CHUNK
        yield


class Diff:
    def __init__(self, *, seed: int, size: int, mamba_size: int, core: str):
        self.rng = random.Random(f"mamba-0.5.23-{core}-{size}-{mamba_size}-{seed}")
        self.size, self.python_core = size, core == "python"
        self.ours = create_cache("mamba", size=size, max_num_reqs=4, max_context_len=256, mamba_size=mamba_size,
                                 mamba_cache_chunk_size=CHUNK, split_recency="keep")
        self.oa, self.om = self.ours.token_to_kv_pool_allocator, self.ours.mamba_pool
        self.pool = HybridReqToTokenPool(size=4, mamba_size=mamba_size, mamba_spec_state_size=mamba_size,
                                         max_context_len=256, device="cpu", enable_memory_saver=False,
                                         cache_params=_state_shape(), mamba_layer_ids=[0, 1],
                                         enable_mamba_extra_buffer=False, enable_overlap_schedule=True)
        self.sa, self.sm = TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False), self.pool.mamba_allocator
        init = CacheInitParams(disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.sa,
                               page_size=1, tree_components=(FULL, MAMBA))
        init.tree_core_backend = core
        self.theirs = UnifiedRadixCache(init)
        self.pair = torch.full((size + 2,), -1, dtype=torch.int64)
        self.mpair = torch.full((mamba_size + 2,), -1, dtype=torch.int64)
        self.held: list[tuple[Any, Any, Any, Any]] = []
        self.log: list[str] = []
        self.ran: Counter[str] = Counter()
        self.checker = InvariantChecker(self.ours)

    # -- comparing
    def eq(self, what: str, ours: Any, theirs: Any) -> None:
        if ours != theirs:
            tail = "\n  ".join(self.log[-25:])
            pytest.fail(f"{what}: kvcore {ours!r} != SGLang 0.5.23 {theirs!r}\nlast operations:\n  {tail}")

    def mapped(self, slots: Any) -> list[int]:
        return [int(self.pair[int(s)]) for s in slots]

    def opath(self, node: Any) -> tuple:
        return path_tokens(node, self.ours.root_node)

    def spath(self, node: Any) -> tuple:
        return path_tokens(node, self.theirs.tree_core.root_node, lambda k: k.token_ids)

    def compare(self, what: str) -> None:
        o, t = self.ours, self.theirs
        self.eq(f"{what}: free sizes", (self.oa.available_size(), self.om.available_size()),
                (self.sa.available_size(), self.sm.available_size()))
        self.eq(f"{what}: sizes", (o.full_evictable_size(), o.full_protected_size(), o.mamba_evictable_size(),
                                   o.mamba_protected_size()),
                (t.full_evictable_size(), t.full_protected_size(), t.mamba_evictable_size(),
                 t.mamba_protected_size()))
        if self.python_core:
            def ours_row(n: Any) -> tuple:
                state = None if n.mamba_value is None else int(self.mpair[int(n.mamba_value[0])])
                return self.opath(n), n.lock_ref, n.mamba_lock_ref, state, tuple(self.mapped(n.value))

            def their_row(n: Any) -> tuple:
                f, m = n.component_data[FULL], n.component_data[MAMBA]
                state = None if m.value is None else int(m.value.reshape(-1)[0])
                return self.spath(n), f.lock_ref, m.lock_ref, state, ids(f.value)

            core = t.tree_core
            self.eq(f"{what}: trees", tree_rows(o.root_node, ours_row), tree_rows(core.root_node, their_row))
            lru = core.lru_lists[MAMBA]
            self.eq(f"{what}: state LRU order", [self.opath(n) for n in o.by_name["mamba"].lru],
                    [self.spath(n) for n in lru_order(lru.head, lru.tail, lambda n: n.lru_prev[lru._pt])])
            self.eq(f"{what}: evictable leaves by recency",
                    [self.opath(n) for n in sorted(o.leaves, key=lambda n: n.last_access_time)],
                    [self.spath(n) for n in sorted(core.evictable_device_leaves, key=lambda n: n.last_access_time)])
        self.checker.check()

    # -- operations
    def insert(self, key: list[int]) -> None:
        n = len(key)
        if self.oa.available_size() < n:
            self.evict(n, 0)
        if self.om.available_size() < 1:
            self.evict(0, 1)
        if self.oa.available_size() < n or self.om.available_size() < 1:
            return
        self.log.append(f"insert {key}")
        o, s = self.oa.alloc(n), self.sa.alloc(n)
        self.pair[o] = s
        om, sm = self.om.alloc(1), self.sm.alloc(1)
        self.mpair[om] = sm
        r = self.ours.insert(RadixKey(key), o, mamba_value=om)
        sr = self.theirs.insert(InsertParams(key=SKey(array("q", key)), value=s, mamba_value=sm))
        self.eq("insert", (r.prefix_len, r.mamba_exist), (sr.prefix_len, sr.mamba_exist))
        if r.mamba_exist:  # the caller's state slot was not taken
            self.om.free(om)
            self.sm.free(sm)
        self.ran["insert, a state kept already" if r.mamba_exist else "insert"] += 1
        self.compare("insert")

    def match(self, key: list[int], hold: bool) -> None:
        self.log.append(f"match {key} hold={hold}")
        m = self.ours.match_prefix(RadixKey(key))
        sm = self.theirs.match_prefix(MatchPrefixParams(key=SKey(array("q", key))))
        n = sm.device_prefix_len
        self.eq("match length", int(m.device_indices.numel()), n)
        self.eq("match slots", self.mapped(m.device_indices),
                self.theirs.path_device_indices(sm.last_device_node)[:n].tolist())
        self.eq("match branching", m.mamba_branching_seqlen, sm.mamba_branching_seqlen)
        if self.python_core:
            self.eq("match node", self.opath(m.last_device_node),
                    self.spath(self.theirs.tree_core.node_by_id(sm.last_device_node)))
        self.ran["match" if n else "miss"] += 1
        if hold and n:
            self.ran["lock"] += 1
            lock = self.ours.inc_lock_ref(m.last_device_node)
            self.held.append((m.last_device_node, lock, self.theirs.lock(sm.last_device_node), key))
        self.compare("match")

    def unlock(self, i: int) -> None:
        node, lock, tlock, key = self.held.pop(i)
        self.log.append(f"unlock {key}")
        self.ours.dec_lock_ref(node, lock)
        self.theirs.unlock(tlock)
        self.compare("unlock")

    def evict(self, n: int, states: int) -> None:
        self.log.append(f"evict({n}, mamba_num={states})")
        r = self.ours.evict(n, mamba_num=states)
        s = self.theirs.evict(EvictParams(num_tokens=n, mamba_num=states))
        self.compare("evict")
        self.eq("evict result", (r.num_tokens_evicted, r.mamba_num_evicted),
                (s.num_tokens_evicted, s.mamba_num_evicted))
        self.ran["full eviction"] += bool(r.num_tokens_evicted)
        self.ran["state eviction"] += bool(r.mamba_num_evicted)

    def run(self, ops: int) -> None:
        rng = self.rng
        stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
        for _ in range(ops):
            base = rng.choice(stems)
            # A state is kept where an insert ended: cut points repeat, so that matches reach them.
            key = base[: rng.choice([len(base), len(base) // 2 + 1, rng.randrange(1, len(base) + 1)])]
            if rng.random() < 0.3:
                key = key + [rng.randrange(6)]
            r = rng.random()
            if r < 0.35:
                self.insert(key)
            elif r < 0.7:
                self.match(key, hold=rng.random() < 0.5)
            elif r < 0.82 and self.held:
                self.unlock(rng.randrange(len(self.held)))
            else:
                self.evict(rng.choice([0, 0, 1, 3, 40]), rng.choice([0, 1, 2, 5]))
        while self.held:
            self.unlock(0)
        self.evict(self.size, 10**6)
        self.eq("drained", (self.oa.available_size(), self.ours.mamba_evictable_size()), (self.size, 0))


@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("size, mamba_size", [(96, 10), (160, 24)])
@pytest.mark.parametrize("seed", range(3))
def test_mamba_matches_sglang_0_5_23_unified_tree(core: str, size: int, mamba_size: int, seed: int) -> None:
    diff = Diff(seed=seed, size=size, mamba_size=mamba_size, core=core)
    diff.run(150)
    kinds = ("insert", "insert, a state kept already", "match", "miss", "lock", "full eviction", "state eviction")
    assert all(diff.ran[k] for k in kinds), diff.ran

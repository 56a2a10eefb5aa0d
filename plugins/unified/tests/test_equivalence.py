"""Where SGLang's unified tree (component full) and RadixCache agree (nothing evicted), `unified` answers as `radix`.

Seeded random inserts (fresh slots), matches, lock/unlock pairs and request runs
(admit, chunked prefill, finish) go to both caches; pools are large enough that
nothing is evicted.  Match answers (slots through a pairing made at allocation),
insert prefix lengths and the full pool's sizes must agree after every step.
(``swa`` and ``mamba`` are the same tree as ``unified`` with those components: the
SGLang differentials compare them with SGLang's UnifiedRadixCache.)
"""

from __future__ import annotations

import random

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey, Req, create_cache


class Pair:
    def __init__(self, legacy: str, components: tuple[str, ...], seed: int, page_size: int = 1, **opts):
        common = dict(size=2048 * page_size, page_size=page_size, max_num_reqs=8, max_context_len=256 * page_size)
        self.a = create_cache("unified", components=components, **common, **opts)
        self.b = create_cache(legacy, **common, **opts)
        self.legacy = legacy
        self.ps = page_size
        self.rng = random.Random(seed)
        self.pair = torch.full((4096 * page_size + 64,), -1, dtype=torch.int64)
        self.held: list = []
        self.live: list = []
        self.rid = 0
        self.steps = 0

    def avail(self, c) -> int:
        alloc = c.token_to_kv_pool_allocator
        return alloc.full_available_size() if hasattr(alloc, "full_available_size") else alloc.available_size()

    def compare(self, what: str) -> None:
        a, b = self.a, self.b
        assert (a.evictable_size(), a.protected_size()) == (b.evictable_size(), b.protected_size()), what
        assert self.avail(a) == self.avail(b), what
        if self.legacy == "swa":
            assert a.swa_evictable_size() + a.swa_protected_size() == b.swa_evictable_size() + b.swa_protected_size()
            alloc_a, alloc_b = a.token_to_kv_pool_allocator, b.token_to_kv_pool_allocator
            assert alloc_a.swa_available_size() == alloc_b.swa_available_size(), what
        self.steps += 1
        if self.steps % 10 == 0 or what == "end":
            InvariantChecker(a).check([r for r, _ in self.live])
            InvariantChecker(b).check([r for _, r in self.live])

    def fresh(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.a.token_to_kv_pool_allocator.alloc(n)
        y = self.b.token_to_kv_pool_allocator.alloc(n)
        self.pair[x] = y
        return x, y

    def match(self, key, extra) -> None:
        ma = self.a.match_prefix(RadixKey(key, extra))
        mb = self.b.match_prefix(RadixKey(key, extra))
        assert self.pair[ma.device_indices].tolist() == mb.device_indices.tolist(), (key, extra)
        if self.rng.random() < 0.3 and ma.device_indices.numel():
            self.held.append((ma.last_device_node, self.a.inc_lock_ref(ma.last_device_node),
                              mb.last_device_node, self.b.inc_lock_ref(mb.last_device_node)))

    def insert(self, key) -> None:
        n = len(key) // self.ps * self.ps
        if n == 0:
            return
        x, y = self.fresh(n)
        ra = self.a.insert(RadixKey(key[:n]), x)
        rb = self.b.insert(RadixKey(key[:n]), y)
        assert ra.prefix_len == rb.prefix_len
        if not rb.duplicates_freed:  # radix leaves the duplicates to the caller
            self.b.token_to_kv_pool_allocator.free(y[: rb.prefix_len])

    def admit_and_run(self, prompt) -> None:
        self.rid += 1
        reqs = []
        for c in (self.a, self.b):
            r = Req(f"r{self.rid}", list(prompt))
            m = c.match_request(r, RadixKey(prompt[:-1]))
            c.req_to_token_pool.alloc([r])
            n = m.prefix_len
            r.prefix_indices, r.last_node = m.device_indices, m.last_device_node
            r.lock = c.inc_lock_ref(r.last_node) if n else None
            c.req_to_token_pool.req_to_token[r.kv.req_pool_idx, :n] = m.device_indices.to(torch.int32)
            r.kv.cache_protected_len = r.kv.kv_committed_len = r.kv.kv_allocated_len = n
            reqs.append(r)
        ra, rb = reqs
        assert ra.kv.cache_protected_len == rb.kv.cache_protected_len
        total = len(prompt)
        chunk = self.rng.choice([1, 3, self.ps, 1000])
        ps = self.ps
        while ra.kv.kv_committed_len < total:
            end = min(total, ra.kv.kv_committed_len + chunk)
            start = ra.kv.kv_allocated_len
            stop = -(-end // ps) * ps  # whole pages
            x, y = self.fresh(stop - start) if stop > start else (None, None)
            for r, c, v in ((ra, self.a, x), (rb, self.b, y)):
                if v is not None:
                    c.req_to_token_pool.req_to_token[r.kv.req_pool_idx, start:stop] = v.to(torch.int32)
                    r.kv.kv_allocated_len = stop
                r.kv.kv_committed_len = end
                kvcore.cache_unfinished_req(r, c, chunked=end < total)
            assert self.pair[ra.prefix_indices].tolist() == rb.prefix_indices.tolist()
            self.live.append((ra, rb))
            self.compare("prefill")
            self.live.pop()
        insert = self.rng.random() < 0.85
        kvcore.release_kv_cache(ra, self.a, is_insert=insert)
        kvcore.release_kv_cache(rb, self.b, is_insert=insert)

    def run(self, ops: int) -> None:
        rng = self.rng
        bases = [[rng.randrange(4) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
        for _ in range(ops):
            base = rng.choice(bases)
            key = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, 4))]
            r = rng.random()
            if r < 0.35:
                self.match(key, "x" if rng.random() < 0.1 else None)
            elif r < 0.6:
                self.insert(key)
            elif r < 0.75 and self.held:
                na, la, nb, lb = self.held.pop(rng.randrange(len(self.held)))
                self.a.dec_lock_ref(na, la)
                self.b.dec_lock_ref(nb, lb)
            elif len(key) >= 2:
                self.admit_and_run(key)
            self.compare("op")
        while self.held:
            na, la, nb, lb = self.held.pop()
            self.a.dec_lock_ref(na, la)
            self.b.dec_lock_ref(nb, lb)
        self.compare("end")


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(2))
def test_unified_full_answers_as_radix(seed, page_size):
    Pair("radix", ("full",), seed, page_size).run(100)

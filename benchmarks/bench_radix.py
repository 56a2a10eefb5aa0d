#!/usr/bin/env python
"""Radix-tree bookkeeping throughput: kvcore-radix vs SGLang's RadixCache.

Trace: ``--requests`` requests of ``--req-len`` tokens, each starting with one of
``--num-prompts`` shared ``--prompt-len``-token system prompts (seeded RNG), the
rest random.  Each request does ``match_prefix`` and then ``insert`` of its whole
key (with a slot tensor as value, as an engine does).  Both caches run the same
trace in the same process; the matched lengths must agree exactly.

    python benchmarks/bench_radix.py --sglang-src /tmp/sgl/src --page-sizes 1 16
    python benchmarks/bench_radix.py --json
    python benchmarks/bench_radix.py --backend swa      # kvcore-swa's tree on the same trace

With ``--backend swa`` the trace runs through kvcore-swa's ``SWARadixCache`` on
real pools: every request's slots are allocated before the clock starts; each
request matches and inserts (the tree frees the duplicates itself, as SGLang's
SWA tree does); no SGLang comparison.

SGLang is imported from ``--sglang-src`` when given; modules it needs that are
missing here (metrics, kernels, KV-event transport) are replaced by stubs from
``tools/sglang_shim.py``; the radix tree code itself (``radix_cache.py``,
``base_prefix_cache.py``, ``evict_policy.py``, ``utils.py``) is SGLang's own.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import sys
import time
from array import array

import torch

# --------------------------------------------------------------------------- trace


def make_trace(seed: int, requests: int, req_len: int, num_prompts: int, prompt_len: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    trace = []
    for _ in range(requests):
        p = prompts[rng.randrange(num_prompts)]
        trace.append(p + [rng.randrange(vocab) for _ in range(req_len - prompt_len)])
    return trace


def make_values(trace, req_len: int):
    # Fake slot ids (distinct per request); neither cache frees anything in this trace.
    return [torch.arange(1 + i * req_len, 1 + (i + 1) * req_len, dtype=torch.int64) for i in range(len(trace))]


# --------------------------------------------------------------------------- ours


def run_ours(trace, values, page_size: int, policy: str, key_validation: str = "full", strict: bool = True):
    from kvcore.config import CacheInitParams
    from kvcore_radix import RadixCache, RadixConfig

    del values  # strict inserts refuse slots the pool never handed out: real slots come from the pool
    req_len = len(trace[0])
    size = -(-(len(trace) * req_len + page_size) // page_size) * page_size
    config = RadixConfig(size=size, page_size=page_size, max_num_reqs=1,
                         max_context_len=-(-req_len // page_size) * page_size, eviction_policy=policy,
                         key_validation=key_validation, strict=strict)
    cache = RadixCache(CacheInitParams.from_config(config))
    alloc = cache.token_to_kv_pool_allocator.alloc
    need = -(-req_len // page_size) * page_size
    slots = [alloc(need)[: len(ids)] for ids in trace]
    elapsed, matched = _timed(cache, trace, slots)
    return elapsed, matched, cache.total_size()


def _timed(cache, trace, values):
    """Time match + insert per request on ``cache``; returns (seconds, matched lengths)."""
    from kvcore.keys import RadixKey

    match, insert = cache.match_prefix, cache.insert
    matched = [0] * len(trace)
    gc.collect()
    t0 = time.perf_counter()
    for i, ids in enumerate(trace):
        # One key per request for both calls, as an engine holds it (SGLang's side does the same).
        key = RadixKey(ids)
        m = match(key)
        matched[i] = m.device_indices.shape[0]
        insert(key, values[i])
    return time.perf_counter() - t0, matched


def run_ours_swa(trace, values, page_size: int, policy: str, key_validation: str = "full", strict: bool = True,
                 window: int = 128):
    """kvcore-swa's tree: match + insert per request (the insert frees the duplicates)."""
    from kvcore.config import CacheInitParams
    from kvcore_swa import SWAConfig, SWARadixCache

    del values, key_validation  # real slots come from the pools; keys are always checked
    req_len = len(trace[0])
    size = -(-(len(trace) * req_len + page_size) // page_size) * page_size
    config = SWAConfig(size=size, swa_size=size, sliding_window_size=window, page_size=page_size,
                       max_num_reqs=1, max_context_len=-(-req_len // page_size) * page_size,
                       eviction_policy=policy, strict=strict)
    cache = SWARadixCache(CacheInitParams.from_config(config))
    alloc = cache.token_to_kv_pool_allocator.alloc
    need = -(-req_len // page_size) * page_size
    # Every request's slots up front: the loop times the tree (and the frees it does), not allocation.
    slots = [alloc(need)[: len(ids)] for ids in trace]
    elapsed, matched = _timed(cache, trace, slots)
    return elapsed, matched, cache.total_size()


# --------------------------------------------------------------------------- SGLang


def _stub_sglang(src: str) -> None:
    """Make ``sglang.srt.mem_cache.radix_cache`` importable without SGLang's heavy deps."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.sglang_shim import load_sglang

    load_sglang(src)


def import_sglang(src: str | None):
    """(module, how) or (None, why)."""
    if src is None:
        try:
            return importlib.import_module("sglang.srt.mem_cache.radix_cache"), "installed sglang"
        except Exception as exc:  # noqa: BLE001
            return None, f"sglang not importable ({type(exc).__name__}: {exc}); pass --sglang-src"
    if src not in sys.path:
        sys.path.insert(0, src)
    try:
        return importlib.import_module("sglang.srt.mem_cache.radix_cache"), f"{src} (as is)"
    except Exception:  # noqa: BLE001 - fall back to stubs
        pass
    try:
        _stub_sglang(src)
        return importlib.import_module("sglang.srt.mem_cache.radix_cache"), f"{src} (missing deps stubbed)"
    except Exception as exc:  # noqa: BLE001
        return None, f"could not import SGLang from {src}: {type(exc).__name__}: {exc}"


def run_sglang(mod, trace, values, page_size: int, policy: str, key_type: str):
    bpc = sys.modules["sglang.srt.mem_cache.base_prefix_cache"]
    MatchPrefixParams, InsertParams = bpc.MatchPrefixParams, bpc.InsertParams
    SKey = mod.RadixKey
    cache = mod.RadixCache.create_simulated(page_size=page_size)
    if policy != "lru":
        cache.eviction_strategy = sys.modules["sglang.srt.mem_cache.utils"].get_eviction_strategy(policy)
    keys = [array("q", ids) for ids in trace] if key_type == "array" else trace
    match, insert = cache.match_prefix, cache.insert
    matched = [0] * len(trace)
    gc.collect()
    t0 = time.perf_counter()
    for i, ids in enumerate(keys):
        key = SKey(ids)
        m = match(MatchPrefixParams(key=key))
        matched[i] = m.device_indices.shape[0]
        insert(InsertParams(key=key, value=values[i]))
    elapsed = time.perf_counter() - t0
    return elapsed, matched, cache.total_size()


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["radix", "swa"], default="radix",
                    help="kvcore backend to time (swa: no SGLang comparison)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--req-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--repeat", type=int, default=5, help="runs per cache; the best is reported")
    ap.add_argument("--sglang-src", default=None, help="SGLang source root (the folder holding sglang/)")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--sglang-key-type", choices=["list", "array"], default="list",
                    help="token container for SGLang's RadixKey (ours always gets lists)")
    ap.add_argument("--key-validation", choices=["full", "stored"], default="full",
                    help="kvcore-radix key checking: full (default) or stored (match skips the unmatched tail)")
    ap.add_argument("--no-strict", action="store_true",
                    help="build the kvcore cache with strict=False (no slot ownership checks on insert)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    trace = make_trace(args.seed, args.requests, args.req_len, args.num_prompts, args.prompt_len, args.vocab)
    values = make_values(trace, args.req_len)
    tokens = args.requests * args.req_len

    if args.backend == "swa":
        args.no_sglang = True
    run = run_ours_swa if args.backend == "swa" else run_ours
    sgl, how = (None, "disabled") if args.no_sglang else import_sglang(args.sglang_src)
    rows = []
    ok = True
    for ps in args.page_sizes:
        # Interleave the two caches and keep each one's best run: this box is shared and noisy.
        best = sbest = None
        for _ in range(args.repeat):
            r = run(trace, values, ps, args.policy, args.key_validation, not args.no_strict)
            best = r if best is None or r[0] < best[0] else best
            if sgl is not None:
                r = run_sglang(sgl, trace, values, ps, args.policy, args.sglang_key_type)
                sbest = r if sbest is None or r[0] < sbest[0] else sbest
        row = {
            "page_size": ps,
            "ours_req_per_s": args.requests / best[0],
            "ours_ns_per_token": best[0] * 1e9 / tokens,
            "ours_matched_tokens": sum(best[1]),
            "ours_cached_tokens": best[2],
        }
        if sbest is not None:
            same = sbest[1] == best[1] and sbest[2] == best[2]
            ok &= same
            row.update({
                "sglang_req_per_s": args.requests / sbest[0],
                "sglang_ns_per_token": sbest[0] * 1e9 / tokens,
                "sglang_matched_tokens": sum(sbest[1]),
                "speedup": sbest[0] / best[0],
                "matched_lengths_identical": same,
            })
        rows.append(row)

    result = {
        "backend": args.backend,
        "trace": {k: getattr(args, k) for k in ("requests", "req_len", "num_prompts", "prompt_len", "vocab", "seed",
                                                "policy", "key_validation", "no_strict")},
        "sglang": how,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"backend {args.backend}; trace: {args.requests} requests x {args.req_len} tokens, "
              f"{args.num_prompts} shared {args.prompt_len}-token prompts, seed {args.seed}, policy {args.policy}, "
              f"key_validation {args.key_validation}; SGLang: {how}")
        hdr = f"{'page':>5} {'ours req/s':>11} {'ours ns/tok':>12}"
        if sgl is not None:
            hdr += f" {'sglang req/s':>13} {'sglang ns/tok':>14} {'speedup':>8} {'same match':>10}"
        print(hdr)
        for r in rows:
            line = f"{r['page_size']:>5} {r['ours_req_per_s']:>11.0f} {r['ours_ns_per_token']:>12.1f}"
            if sgl is not None:
                line += (f" {r['sglang_req_per_s']:>13.0f} {r['sglang_ns_per_token']:>14.1f}"
                         f" {r['speedup']:>7.2f}x {str(r['matched_lengths_identical']):>10}")
            print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

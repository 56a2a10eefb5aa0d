#!/usr/bin/env python
"""Sliding-window radix-tree throughput: kvcore's swa (the one tree, components full + swa) vs SGLang's trees.

Two traces, both built by ``bench_radix.make_trace`` (``--requests`` requests of
``--req-len`` tokens, each starting with one of ``--num-prompts`` shared
``--prompt-len``-token prompts, the rest random):

* ``insert``: each request does ``match_prefix`` and then ``insert`` of its whole
  key with real slots from real pools (allocated, for both caches, before the clock
  starts); the tree frees the duplicates itself.  As ``bench_radix.py --backend swa``.
* ``finish``: requests run as an engine runs them, ``--batch`` at a time, on pools
  holding ``--pool-requests`` requests' worth of slots: admit (``match_prefix`` of
  the prompt less its last token, ``inc_lock_ref``, a req_to_token row, evict if the
  pools are short, allocate the rest), move the window cursor (the window slots
  that left the window are freed: ``free_swa_out_of_window_slots``), optionally give
  the window lock back early (``--swa-lock-release``: ``dec_swa_lock_only``), then
  ``cache_finished_req`` (inserts with the window-evicted part as tombstone) and
  free the row.  Windows shorter than the request leave tombstones behind; the
  small pools make both eviction phases run.  The clock runs over the whole loop
  (allocation included, the same work on both sides); ``cache-only`` leaves out the
  engine's part (request rows, slot allocation) and compares what the caches do.

SGLang's side is two trees (``--sglang-trees``): ``unified``, its ``UnifiedRadixCache``
with components full + swa, which is what kvcore's ``swa`` answers as, and ``legacy``, its
``SWARadixCache``, the tree SGLang ran hybrid-SWA models on before.  Every cache runs the
same trace in one process, interleaved, the best of ``--repeat`` runs kept.  Matched
lengths (every request's) and the trees' final sizes must agree exactly with the unified
tree's, or the exit status is 1; against the legacy tree they are only reported (``same``):
where its eviction and window locks answer otherwise (kvcore-swa's README, "Differences
from SGLang's legacy SWARadixCache") the figures may differ.

Key modes: ``fresh`` (default) builds a new RadixKey on a new token list for every
call, as an engine does from a request; ``reused`` gives ``match_prefix`` and
``insert`` the same key object (the ``insert`` trace only).

SGLang 0.5.19's own classes are loaded from ``--sglang-src`` (default
``$KVCORE_SGLANG_SRC``) through ``tools/sglang_unified_shim.py`` (which builds on
``tools/sglang_swa_shim.py``); without a source tree only kvcore's figures are printed.

    KVCORE_SGLANG_SRC=/tmp/kvcore-ci-sglang-0.5.19/src python benchmarks/bench_swa.py
    python benchmarks/bench_swa.py --traces finish --windows 128 --page-sizes 1 16 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from functools import partial

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_radix import make_trace  # noqa: E402

_clock = time.perf_counter  # --clock cpu: time.process_time (this process's CPU time: a busy box disturbs it less)


def _pages(n: int, ps: int) -> int:
    return -(-n // ps)


def _keys(trace, mode: str, extra_copy: bool):
    """Token lists for the calls: the same list (reused) or new lists (fresh), made before the clock."""
    if mode == "reused":
        return trace, trace
    return [list(t) for t in trace], ([list(t) for t in trace] if extra_copy else None)


# --------------------------------------------------------------------------- insert trace


def ours_insert(trace, ps: int, window: int, key_mode: str, strict: bool, spare: int = 0):
    import kvcore
    from kvcore.keys import RadixKey

    req_len = len(trace[0])
    need = _pages(req_len, ps) * ps
    size = (len(trace) + 1) * need + _pages(spare, ps) * ps
    cache = kvcore.create_cache("swa", size=size, swa_size=size, sliding_window_size=window, page_size=ps,
                                max_num_reqs=1, max_context_len=need, strict=strict)
    alloc = cache.token_to_kv_pool_allocator.alloc
    slots = [alloc(need)[: len(ids)] for ids in trace]
    mkeys, ikeys = _keys(trace, key_mode, True)
    match, insert = cache.match_prefix, cache.insert
    matched = [0] * len(trace)
    gc.collect()
    t0 = _clock()
    if key_mode == "reused":
        for i, ids in enumerate(mkeys):
            key = RadixKey(ids)
            matched[i] = match(key).device_indices.shape[0]
            insert(key, slots[i])
    else:
        for i, ids in enumerate(mkeys):
            matched[i] = match(RadixKey(ids)).device_indices.shape[0]
            insert(RadixKey(ikeys[i]), slots[i])
    elapsed = _clock() - t0
    return elapsed, matched, (cache.total_size(), cache.swa_total_size()), 0.0


def sglang_cache(sg, tree: str, alloc, rtp, ps: int, window: int):
    """SGLang's ``UnifiedRadixCache`` (full, swa) or its legacy ``SWARadixCache``."""
    if tree == "unified":
        return sg.make_unified_cache(("full", "swa"), alloc, rtp, ps, window=window)
    return sg.make_radix_cache(alloc, rtp, ps, window)


def sglang_insert(sg, tree: str, trace, ps: int, window: int, key_mode: str, spare: int = 0):
    req_len = len(trace[0])
    need = _pages(req_len, ps) * ps
    size = (len(trace) + 1) * need + _pages(spare, ps) * ps
    alloc = sg.make_swa_allocator(size, size, ps)
    cache = sglang_cache(sg, tree, alloc, sg.make_req_to_token_pool(1, need), ps, window)
    T = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    slots = []
    for ids in trace:
        s = alloc.alloc(need) if ps == 1 else alloc.alloc_extend(T(0), T(0), T(need), T(need), T(-1), need)
        slots.append(s[: len(ids)])
    mkeys, ikeys = _keys(trace, key_mode, True)
    SKey, MP, IP = sg.RadixKey, sg.MatchPrefixParams, sg.InsertParams
    match, insert = cache.match_prefix, cache.insert
    matched = [0] * len(trace)
    gc.collect()
    t0 = _clock()
    if key_mode == "reused":
        for i, ids in enumerate(mkeys):
            key = SKey(ids)
            matched[i] = match(MP(key=key)).device_indices.shape[0]
            insert(IP(key=key, value=slots[i]))
    else:
        for i, ids in enumerate(mkeys):
            matched[i] = match(MP(key=SKey(ids))).device_indices.shape[0]
            insert(IP(key=SKey(ikeys[i]), value=slots[i]))
    elapsed = _clock() - t0
    return elapsed, matched, tuple(cache.total_size()), 0.0


# --------------------------------------------------------------------------- finish trace


def _pool_size(trace, ps: int, pool_requests: int, batch: int) -> int:
    need = _pages(len(trace[0]), ps) * ps
    return max(pool_requests, batch + 1) * need


def ours_finish(trace, ps: int, window: int, batch: int, pool_requests: int, release: bool, strict: bool):
    import kvcore
    from kvcore.keys import RadixKey

    size = _pool_size(trace, ps, pool_requests, batch)
    req_len = len(trace[0])
    cache = kvcore.create_cache("swa", size=size, swa_size=size, sliding_window_size=window, page_size=ps,
                                max_num_reqs=batch, max_context_len=_pages(req_len, ps) * ps, strict=strict)
    alloc = cache.token_to_kv_pool_allocator
    rtp = cache.req_to_token_pool
    table = rtp.req_to_token
    prompts = [list(t) for t in trace]
    mkeys = [t[: len(t) - 1] for t in trace]
    matched = [0] * len(trace)
    setup = 0.0  # request rows and slot allocation: the engine's part, not the cache's
    gc.collect()
    t0 = _clock()
    for b0 in range(0, len(trace), batch):
        live = []
        for i in range(b0, min(b0 + batch, len(trace))):
            req = kvcore.Req(f"r{i}", prompts[i])
            m = cache.match_prefix(RadixKey(mkeys[i]))
            n = m.device_indices.shape[0]
            matched[i] = n
            req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
            req.lock = cache.inc_lock_ref(req.last_node)
            ts = _clock()
            rtp.alloc([req])
            kv = req.kv
            row = table[kv.req_pool_idx]
            if n:
                row[:n] = m.device_indices.to(row.dtype)
            kv.cache_protected_len = n
            end = len(prompts[i])
            want = (_pages(end, ps) - _pages(n, ps)) * ps if ps > 1 else end - n
            fa, sa = alloc.full_available_size(), alloc.swa_available_size()
            setup += _clock() - ts
            if fa < want or sa < want:
                cache.evict(max(0, want - fa), max(0, want - sa))
            ts = _clock()
            if ps == 1:
                o = alloc.alloc(end - n)
            else:
                o = alloc.alloc_extend([n], [n], [end], [end], [int(row[n - 1]) if n else -1], end - n)
            row[n:end] = o.to(row.dtype)
            kv.kv_allocated_len = kv.kv_committed_len = end
            setup += _clock() - ts
            live.append(req)
        # The decode moved every window to the end of its request.
        cache.free_window_slots(live, [len(r.origin_input_ids) for r in live])
        for req in live:
            if release and req.lock.stop is not None:
                cache.dec_swa_lock_only(req.last_node, req.lock)
            kvcore.release_kv_cache(req, cache)
    elapsed = _clock() - t0
    return elapsed, matched, (cache.total_size(), cache.swa_total_size()), setup


def sglang_finish(sg, tree: str, trace, ps: int, window: int, batch: int, pool_requests: int, release: bool):
    size = _pool_size(trace, ps, pool_requests, batch)
    req_len = len(trace[0])
    alloc = sg.make_swa_allocator(size, size, ps)
    rtp = sg.make_req_to_token_pool(batch, _pages(req_len, ps) * ps)
    cache = sglang_cache(sg, tree, alloc, rtp, ps, window)
    table = rtp.req_to_token
    SKey, MP, EP = sg.RadixKey, sg.MatchPrefixParams, sg.EvictParams
    free_window = sg.free_swa_out_of_window_slots
    T = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    prompts = [list(t) for t in trace]
    mkeys = [t[: len(t) - 1] for t in trace]
    matched = [0] * len(trace)
    setup = 0.0  # request rows and slot allocation: the engine's part, not the cache's
    gc.collect()
    t0 = _clock()
    for b0 in range(0, len(trace), batch):
        live = []
        for i in range(b0, min(b0 + batch, len(trace))):
            req = sg.SGReq(f"r{i}", prompts[i])
            m = cache.match_prefix(MP(key=SKey(mkeys[i])))
            n = m.device_indices.shape[0]
            matched[i] = n
            req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
            res = cache.inc_lock_ref(req.last_node)
            req.swa_uuid_for_lock, req.skip_lock_node_ids = res.swa_uuid_for_lock, res.skip_lock_node_ids
            ts = _clock()
            rtp.alloc([req])
            kv = req.kv
            row = table[kv.req_pool_idx]
            if n:
                row[:n] = m.device_indices.to(row.dtype)
            kv.cache_protected_len = n
            end = len(prompts[i])
            want = (_pages(end, ps) - _pages(n, ps)) * ps if ps > 1 else end - n
            fa, sa = alloc.full_available_size(), alloc.swa_available_size()
            setup += _clock() - ts
            if fa < want or sa < want:
                cache.evict(EP(num_tokens=max(0, want - fa), swa_num_tokens=max(0, want - sa)))
            ts = _clock()
            if ps == 1:
                o = alloc.alloc(end - n)
            else:
                o = alloc.alloc_extend(T(n), T(n), T(end), T(end), T(int(row[n - 1]) if n else -1), end - n)
            row[n:end] = o.to(row.dtype)
            kv.kv_allocated_len = kv.kv_committed_len = end
            setup += _clock() - ts
            live.append(req)
        for req in live:
            free_window(req, len(req.origin_input_ids), sliding_window_size=window, page_size=ps,
                        req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, is_chunk_cache=False,
                        retain_floor=cache.swa_retain_floor(req))
        for req in live:
            if release and req.swa_uuid_for_lock is not None:
                cache.dec_swa_lock_only(req.last_node, req.swa_uuid_for_lock, req.skip_lock_node_ids)
                req.swa_prefix_lock_released = True
            committed = req.kv.kv_committed_len
            cache.cache_finished_req(req, is_insert=True, kv_len_to_handle=committed)
            start, stop = _pages(committed, ps) * ps, req.kv.kv_allocated_len
            if start < stop:
                cache.free_kv_row(req.kv, [(start, stop)])
            rtp.free(req)
    elapsed = _clock() - t0
    return elapsed, matched, tuple(cache.total_size()), setup


# --------------------------------------------------------------------------- main


def load_sglang(src: str | None):
    """(namespace, how) or (None, why)."""
    if not src:
        return None, "no SGLang source (pass --sglang-src or set KVCORE_SGLANG_SRC)"
    if not os.path.isdir(os.path.join(src, "sglang")):
        return None, f"{src} holds no sglang/ folder"
    from tools.sglang_unified_shim import load_sglang_unified

    try:
        return load_sglang_unified(src), src
    except Exception as exc:  # noqa: BLE001
        return None, f"could not load SGLang from {src}: {type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", choices=["insert", "finish"], default=["insert", "finish"])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--req-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--windows", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--key-modes", nargs="+", choices=["fresh", "reused"], default=["fresh"],
                    help="insert trace: a new key per call (fresh) or one key for match and insert (reused)")
    ap.add_argument("--spare-tokens", type=int, default=0,
                    help="insert trace: pools hold this many free slots beyond the trace's needs (a server's pools "
                         "are mostly free; SGLang's free list grows with them, ours does not)")
    ap.add_argument("--batch", type=int, default=8, help="finish trace: requests live at once")
    ap.add_argument("--pool-requests", type=int, default=64,
                    help="finish trace: pool size in requests' worth of slots (smaller: more eviction)")
    ap.add_argument("--swa-lock-release", action="store_true",
                    help="finish trace: give each request's window lock back early (dec_swa_lock_only)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per cache; the best is reported")
    ap.add_argument("--sglang-src", default=os.environ.get("KVCORE_SGLANG_SRC"),
                    help="SGLang source root (the folder holding sglang/); default $KVCORE_SGLANG_SRC")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--sglang-trees", nargs="+", choices=["unified", "legacy"], default=["unified", "legacy"],
                    help="SGLang's trees to run: UnifiedRadixCache (full, swa; kvcore's swa must agree with it) and "
                         "the legacy SWARadixCache (agreement only reported)")
    ap.add_argument("--no-strict", action="store_true", help="kvcore cache with strict=False")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: perf_counter; cpu: process_time (steadier when other processes share the cores)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)

    trace = make_trace(args.seed, args.requests, args.req_len, args.num_prompts, args.prompt_len, args.vocab)
    tokens = args.requests * args.req_len
    sg, how = (None, "disabled") if args.no_sglang else load_sglang(args.sglang_src)
    strict = not args.no_strict

    cases = []
    for tr in args.traces:
        for ps in args.page_sizes:
            for w in args.windows:
                for km in (args.key_modes if tr == "insert" else ["fresh"]):
                    cases.append((tr, ps, w, km))

    trees = [] if sg is None else [t for t in ("unified", "legacy") if t in args.sglang_trees]
    rows = []
    ok = True
    for tr, ps, w, km in cases:
        if tr == "insert":
            runs = {"ours": partial(ours_insert, trace, ps, w, km, strict, args.spare_tokens)}
            runs.update({t: partial(sglang_insert, sg, t, trace, ps, w, km, args.spare_tokens) for t in trees})
        else:
            runs = {"ours": partial(ours_finish, trace, ps, w, args.batch, args.pool_requests, args.swa_lock_release,
                                    strict)}
            runs.update({t: partial(sglang_finish, sg, t, trace, ps, w, args.batch, args.pool_requests,
                                    args.swa_lock_release) for t in trees})
        best: dict = {}
        cache_t = dict.fromkeys(runs, float("inf"))  # best time less the engine's part (rows, allocation)
        for _ in range(args.repeat):  # interleaved: the box is shared and noisy
            for name, run in runs.items():
                r = run()
                best[name] = r if name not in best or r[0] < best[name][0] else best[name]
                cache_t[name] = min(cache_t[name], r[0] - r[3])
        mine = best["ours"]
        row = {"trace": tr, "page_size": ps, "window": w, "key_mode": km,
               "ours_req_per_s": args.requests / mine[0], "ours_ns_per_token": mine[0] * 1e9 / tokens,
               "ours_cache_ns_per_token": cache_t["ours"] * 1e9 / tokens,
               "ours_matched_tokens": sum(mine[1]), "ours_cached": list(mine[2])}
        for t in trees:
            # SGLang's legacy tree keeps the keys it had before its unified tree came (sglang_*, speedup, ...).
            pre, suf = ("sglang_unified_", "unified_") if t == "unified" else ("sglang_", "")
            theirs = best[t]
            same = theirs[1] == mine[1] and tuple(theirs[2]) == tuple(mine[2])
            if t == "unified":
                ok &= same
            row.update({f"{pre}req_per_s": args.requests / theirs[0],
                        f"{pre}ns_per_token": theirs[0] * 1e9 / tokens,
                        f"{pre}cache_ns_per_token": cache_t[t] * 1e9 / tokens,
                        f"{pre}matched_tokens": sum(theirs[1]), f"{pre}cached": list(theirs[2]),
                        f"{suf}speedup": theirs[0] / mine[0], f"{suf}cache_speedup": cache_t[t] / cache_t["ours"],
                        f"{suf}matched_lengths_identical": same})
        rows.append(row)

    result = {"trace": {k: getattr(args, k) for k in ("requests", "req_len", "num_prompts", "prompt_len", "vocab",
                                                     "seed", "spare_tokens", "batch", "pool_requests",
                                                     "swa_lock_release", "no_strict", "repeat", "clock")},
              "sglang": how, "sglang_trees": trees, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.requests} requests x {args.req_len} tokens, {args.num_prompts} shared {args.prompt_len}-token "
              f"prompts, seed {args.seed}; insert: {args.spare_tokens} spare tokens; "
              f"finish: batch {args.batch}, pools {args.pool_requests} requests, "
              f"swa_lock_release {args.swa_lock_release}; strict {strict}; clock {args.clock}; SGLang: {how}")
        if trees:
            print("SGLang trees: " + ", ".join({"unified": "uni = UnifiedRadixCache (full, swa)",
                                                 "legacy": "leg = legacy SWARadixCache"}[t] for t in trees)
                  + "; speedup = their time / ours")
        hdr = f"{'trace':>6} {'page':>4} {'window':>6} {'keys':>6} {'ours req/s':>10} {'ours ns/tok':>11}"
        for t in trees:
            n = "uni" if t == "unified" else "leg"
            hdr += f" {n + ' req/s':>9} {n + ' ns/tok':>10} {'speedup':>8} {'cache-only':>10} {'same':>5}"
        print(hdr)
        for r in rows:
            line = (f"{r['trace']:>6} {r['page_size']:>4} {r['window']:>6} {r['key_mode']:>6} "
                    f"{r['ours_req_per_s']:>10.0f} {r['ours_ns_per_token']:>11.1f}")
            for t in trees:
                pre, suf = ("sglang_unified_", "unified_") if t == "unified" else ("sglang_", "")
                line += (f" {r[pre + 'req_per_s']:>9.0f} {r[pre + 'ns_per_token']:>10.1f}"
                         f" {r[suf + 'speedup']:>7.2f}x {r[suf + 'cache_speedup']:>9.2f}x"
                         f" {str(r[suf + 'matched_lengths_identical']):>5}")
            print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

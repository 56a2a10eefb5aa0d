#!/usr/bin/env python
"""Replay of the Mooncake FAST'25 conversation trace: wall time, and where the backend's time goes.

Two parts, each optional:

* **wall** (``--no-full`` skips it): the whole trace through ``kvcore bench`` as a user runs it,
  ``python -m kvcore bench -b radix --no-reference --trace FILE --size 8388608 --json``, timed
  end to end (trace reading, the loop, the infinite-cache hit rate, the final checks), with the
  loop's own ``wall_s`` / ``backend_s`` and the hit rate from its JSON.
* **profile** (``--profile-requests N``, default 3000; 0 skips it): the first N requests of the
  same trace (or N from the K-th on, ``--profile-from K``: eviction starts only once the 8M
  slots fill, after about 3,000 requests) through the same loop (``kvcore.bench.plan.plan_bench`` from the same options,
  then ``ServingLoop.run``) under ``cProfile``.  Reported: the loop's backend time, the share of
  it spent in the protocol's steps (cumulative: ``cache_unfinished_req``, ``release_kv_cache``,
  the match, eviction, allocation) and the functions with the most time of their own (the
  scheduler's and the end-of-run checker's Python functions left out; C functions such as
  ``Tensor.nonzero`` that the checker calls once over all 8M slots still show).  cProfile
  inflates functions that make many small calls, so shares are indicative; compare runs of
  this script with each other.

The trace is ``--trace FILE``, or the synthetic conversation trace with the published
statistics (12,031 requests, 148.6M prompt tokens; the real trace is not available offline),
written once by ``python -m kvcore.bench.trace conversation`` (seed 0) into
``$KVCORE_BENCH_CACHE`` (default ``~/.cache/kvcore-bench``).

    python benchmarks/bench_trace.py                      # wall of the full trace + profile of 3000 requests
    python benchmarks/bench_trace.py --no-full --profile-requests 3000 --json out.json
    python benchmarks/bench_trace.py --profile-requests 0  # wall only
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from typing import Any

# Cumulative entries reported as shares of the backend time: (label, function name, path fragment).
STEPS = [
    ("cache_unfinished_req (per chunk and at prompt end)", "cache_unfinished_req", "kvcore/release.py"),
    ("release_kv_cache (finish)", "release_kv_cache", "kvcore/release.py"),
    ("match (admission)", "match_request", "kvcore/cache.py"),
    ("make_room (eviction)", "make_room", "kvcore/cache.py"),
    ("evict", "evict", "plugins/"),
    ("insert (tree)", "insert", "plugins/"),
    ("match_prefix (tree)", "match_prefix", "plugins/"),
    ("alloc (allocator)", "alloc", "kvcore/pools"),
    ("alloc_extend", "alloc_extend", "kvcore/pools"),
    ("alloc_decode", "alloc_decode", "kvcore/pools"),
    ("free (allocator)", "free", "kvcore/pools"),
]

# Not backend time: the scheduler itself, and the checker that runs after the loop.
OUTSIDE = ("kvcore/bench/", "kvcore/invariants.py", "cProfile", "pstats")


def default_trace() -> str:
    folder = os.environ.get("KVCORE_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvcore-bench")
    path = os.path.join(folder, "mooncake-conversation-seed0.jsonl")
    if not os.path.exists(path):
        from kvcore.bench.trace import generate_mooncake_like

        os.makedirs(folder, exist_ok=True)
        print(f"bench_trace: writing the synthetic conversation trace to {path}", file=sys.stderr)
        generate_mooncake_like(path + ".part", "conversation", seed=0)
        os.replace(path + ".part", path)
    return path


def bench_args(args: argparse.Namespace, trace: str) -> list[str]:
    return ["-b", args.backend, "--no-reference", "--trace", trace, "--size", str(args.size), *args.extra]


def full_run(args: argparse.Namespace, trace: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvcore", "bench", *bench_args(args, trace), "--json"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"bench_trace: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    rep = json.loads(proc.stdout)
    rep = rep[0] if isinstance(rep, list) else rep
    keys = ("num_requests", "prompt_tokens", "hit_rate", "wall_s", "backend_s", "steps", "evictions", "evict_calls",
            "retractions", "leaked_slots", "invariant_violations")
    return {"command": " ".join(["python", "-m", "kvcore", "bench", *bench_args(args, trace), "--json"]),
            "command_wall_s": wall, **{k: rep.get(k) for k in keys}}


def profile_run(args: argparse.Namespace, trace: str) -> dict[str, Any]:
    from kvcore.bench.loop import ServingLoop
    from kvcore.bench.options import BenchOptions
    from kvcore.bench.plan import plan_bench

    skip = args.profile_from
    opts = BenchOptions(backend=[args.backend], trace=trace, size=args.size, no_reference=True,
                        num_requests=skip + args.profile_requests)
    plan = plan_bench(opts)
    loop = ServingLoop(plan.bench_config(plan.run_names[0]), plan.workload)
    prof = cProfile.Profile()
    start = {"t": 0.0, "backend": 0.0, "on": False}

    def begin(done: int, _total: int) -> None:
        # The loop reports progress every 64 steps: the profile starts once `skip` requests finished.
        if not start["on"] and done >= skip:
            start.update(t=time.perf_counter(), backend=loop.engine_time.seconds, on=True)
            prof.enable()

    result = loop.run(begin)
    prof.disable()
    wall = time.perf_counter() - start["t"]
    stats = pstats.Stats(prof)
    backend = loop.engine_time.seconds - start["backend"]
    rows = stats.stats  # type: ignore[attr-defined]  # {(file, line, func): (cc, nc, tt, ct, callers)}

    def cum(name: str, where: str) -> tuple[float, int]:
        ct = nc = 0
        for (path, _line, func), (_cc, n, _tt, c, _callers) in rows.items():
            if func == name and where in path and "kvcore/bench" not in path:
                ct += c
                nc += n
        return ct, nc

    steps = []
    for label, name, where in STEPS:
        ct, nc = cum(name, where)
        if nc:
            steps.append({"step": label, "calls": nc, "cum_s": ct, "share_of_backend": ct / backend})
    # Own time outside the loop's own code and the end-of-run invariant check (neither is backend time).
    own = sorted(((tt, nc, path, line, func) for (path, line, func), (_cc, nc, tt, _ct, _c) in rows.items()
                  if not any(skip in path for skip in OUTSIDE)), reverse=True)[: args.top]
    top = [{"function": f"{_short(path)}:{line}({func})", "calls": nc, "own_s": tt, "share_of_backend": tt / backend}
           for tt, nc, path, line, func in own]
    if args.pstats:
        stats.dump_stats(args.pstats)
    return {"requests": args.profile_requests, "from_request": skip, "profiled_wall_s": wall,
            "profiled_backend_s": backend,
            "hit_rate": result.cached_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
            "evicted_slots": result.evictions,
            "steps": steps, "top_own_time": top}


def _short(path: str) -> str:
    for mark in ("/kvcore/", "/plugins/", "/torch/"):
        i = path.rfind(mark)
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=None, help="a Mooncake JSONL trace (default: the synthetic conversation trace)")
    ap.add_argument("--backend", default="radix")
    ap.add_argument("--size", type=int, default=8388608, help="token slots (default 8M)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-trace wall-time run")
    ap.add_argument("--profile-requests", type=int, default=3000, help="requests to profile (0: no profile)")
    ap.add_argument("--profile-from", type=int, default=0, metavar="K",
                    help="profile from the K-th finished request on (the first K run unprofiled; eviction starts "
                         "only once the slots fill)")
    ap.add_argument("--top", type=int, default=15, help="functions listed by own time")
    ap.add_argument("--pstats", default=None, metavar="FILE", help="also dump the raw profile (pstats format)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON to FILE")
    ap.add_argument("extra", nargs="*", help="more kvcore bench options, after --")
    args = ap.parse_args()
    trace = args.trace or default_trace()
    out: dict[str, Any] = {"trace": trace, "backend": args.backend, "size": args.size}
    if not args.no_full:
        out["full"] = full_run(args, trace)
        f = out["full"]
        print(f"full trace ({f['num_requests']:,} requests, {f['prompt_tokens']:,} prompt tokens): "
              f"command wall {f['command_wall_s']:.1f} s; loop wall {f['wall_s']:.1f} s, "
              f"backend {f['backend_s']:.1f} s; "
              f"hit rate {f['hit_rate']:.1%}; {f['evictions']:,} slots evicted\n  {f['command']}")
    if args.profile_requests:
        out["profile"] = p = profile_run(args, trace)
        print(f"\nprofile of {p['requests']:,} requests from request {p['from_request']:,} (cProfile on): "
              f"wall {p['profiled_wall_s']:.1f} s, backend {p['profiled_backend_s']:.1f} s")
        print(f"  {'step (cumulative)':<52} {'calls':>9} {'s':>8} {'of backend':>10}")
        for s in p["steps"]:
            print(f"  {s['step']:<52} {s['calls']:>9,} {s['cum_s']:>8.2f} {s['share_of_backend']:>10.1%}")
        head = "function (own time; not the loop, not the final check)"
        print(f"  {head:<72} {'calls':>9} {'s':>8} {'of backend':>10}")
        for s in p["top_own_time"]:
            print(f"  {s['function'][:72]:<72} {s['calls']:>9,} {s['own_s']:>8.2f} {s['share_of_backend']:>10.1%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()

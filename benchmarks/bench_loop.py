#!/usr/bin/env python
"""The ``kvcore bench`` serving loop's own speed: wall and backend seconds of a run, two checkouts alternating.

Each round runs the run ``kvcore bench --backend B --no-reference`` makes (plus options
after ``--`` as ``FIELD=VALUE`` of ``kvcore.bench.options.BenchOptions``, e.g.
``workload=multi-turn page_size=16``; the same ``plan_bench`` and ``ServingLoop``) in a fresh
process per checkout, the checkouts alternating (ABBA: which side runs first swaps every
round) so that a noisy machine hits both alike;
a process runs the loop ``--runs`` times and keeps its best.  Kept per run: the loop's
``wall_s`` and ``backend_s`` (the time inside the engine) and the process CPU time of
``ServingLoop.run`` (``cpu_s``: what a shared machine disturbs least).  Every other figure of
the report (hit rate, evictions, steps, the workload digest, ...) must be identical on both
sides: the run fails if it is not.  Reported: medians per side, the after/before ratios and
the median of the per-round ratios.

    python benchmarks/bench_loop.py --compare /old/checkout . --backends swa,radix --rounds 7
    python benchmarks/bench_loop.py --compare /old . --backends radix -- workload=multi-turn
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# Report keys that depend on timing; every other key must agree between the sides.
TIMED = {"cpu_s", "wall_s", "backend_s", "loop_overhead_s", "requests_per_s", "tokens_per_s", "step_p50_us",
         "step_p99_us", "step_mean_us", "step_us", "check_s", "kv_write_s", "timeline"}

KEYS = ("cpu_s", "wall_s", "backend_s")


def one_side(backend: str, runs: int, extra: list[str]) -> dict:
    """In this process (the kvcore on sys.path): the bench run ``runs`` times; the best by CPU time."""
    import time

    from kvcore.bench.loop import ServingLoop
    from kvcore.bench.options import BenchOptions
    from kvcore.bench.plan import plan_bench
    from kvcore.bench.report import make_report

    given: dict = {}
    for item in extra:  # FIELD=VALUE of BenchOptions, VALUE read as JSON when it parses
        key, eq, raw = item.partition("=")
        if not eq:
            raise SystemExit(f"bench_loop: {item!r}: expected FIELD=VALUE (a BenchOptions field)")
        try:
            given[key] = json.loads(raw)
        except ValueError:
            given[key] = raw
    plan = plan_bench(BenchOptions(backend=[backend], no_reference=True, **given))
    name = plan.run_names[0]
    best: dict | None = None
    for _ in range(runs):
        cfg = plan.bench_config(name)
        loop = ServingLoop(cfg, plan.workload)
        t = time.process_time()
        res = loop.run()
        cpu = time.process_time() - t
        rep = make_report(cfg, plan.workload, res)
        rep["cpu_s"] = cpu
        if best is None or cpu < best["cpu_s"]:
            best = rep
    assert best is not None
    return best


def run_side(root: str, backend: str, runs: int, extra: list[str]) -> dict:
    paths = [root] + [os.path.join(root, "plugins", p) for p in sorted(os.listdir(os.path.join(root, "plugins")))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    cmd = [sys.executable, os.path.abspath(__file__), "--side", backend, "--runs", str(runs), "--", *extra]
    res = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench_loop: {root}: {' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def fixed_part(rep: dict) -> dict:
    return {k: v for k, v in rep.items() if k not in TIMED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # one side's run, in the child process
    ap.add_argument("--backends", default="swa,radix")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; each runs both sides once")
    ap.add_argument("--runs", type=int, default=3, help="loop runs per process; the best (CPU time) is kept")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("extra", nargs="*", help="more bench options as FIELD=VALUE (BenchOptions fields), after --")
    args = ap.parse_args()
    if args.side is not None:
        print(json.dumps(one_side(args.side, args.runs, args.extra)))
        return
    if not args.compare:
        ap.error("--compare BEFORE AFTER is required")
    rows = []
    for backend in args.backends.split(","):
        got: dict[str, list[dict]] = {"before": [], "after": []}
        sides = [("before", args.compare[0]), ("after", args.compare[1])]
        for i in range(args.rounds):
            # ABBA: the side that runs first swaps every round, so an order effect cancels out.
            for side, root in sides if i % 2 == 0 else sides[::-1]:
                got[side].append(run_side(root, backend, args.runs, args.extra))
        ref = fixed_part(got["before"][0])
        same = all(fixed_part(r) == ref for side in got.values() for r in side)
        row = {"backend": backend, "rounds": args.rounds, "same_output": same}
        for key in KEYS:
            b = statistics.median(r[key] for r in got["before"])
            a = statistics.median(r[key] for r in got["after"])
            # Per-round ratios too: each round's two runs ran back to back.
            per_round = [ra[key] / rb[key] for rb, ra in zip(got["before"], got["after"])]
            row[key] = {"before": b, "after": a, "after_over_before": a / b,
                        "per_round_median": statistics.median(per_round)}
        rows.append(row)
        if not same:
            print(f"bench_loop: {backend}: the reports differ beyond timing between the sides", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'backend':<8} {'what':<10} {'before s':>9} {'after s':>9} {'after/before':>12} "
              f"{'per-round':>10} same output")
        for r in rows:
            for key in KEYS:
                v = r[key]
                print(f"{r['backend']:<8} {key:<10} {v['before']:>9.3f} {v['after']:>9.3f} "
                      f"{v['after_over_before']:>12.3f} {v['per_round_median']:>10.3f} {r['same_output']}")
    sys.exit(0 if all(r["same_output"] for r in rows) else 1)


if __name__ == "__main__":
    main()

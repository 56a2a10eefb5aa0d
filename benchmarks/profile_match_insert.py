#!/usr/bin/env python
"""Where match+insert time goes: kvcore's backends and SGLang's RadixCache, by kind of work, per request.

The trace and the loops are ``bench_radix.py``'s (``--requests`` requests of ``--req-len``
tokens over shared system prompts; ``match_prefix`` then ``insert`` of a fresh key per
call).  Each side runs once under ``cProfile``; its own time per function is grouped by
what the function is:

* ``torch``: torch's C calls (tensor slicing, ``cat``, ``to``, ``empty``, comparisons):
  what building the answer tensors and the slot values costs, on any side;
* ``key checks``: kvcore's token-id validation (``kvcore/keys.py``): the bad-input promise;
* ``slot checks``: kvcore's strict ownership claims (``kvcore/pools``);
* ``tree``: the tree walk, split and insert in Python (``plugins/*``, ``kvcore/tree``,
  SGLang's ``radix_cache.py``);
* ``builtins``: other C builtins (list slicing and compares, ``len``, dict lookups);
* ``other``: any other Python (dataclasses, the loop itself).

Printed: µs per request per group, for each side, and the ratios that bound a speedup:
SGLang's total against kvcore's ``torch`` + ``key checks`` (what kvcore cannot drop
without dropping its answer tensors or its bad-input checks); then the plain cost (timeit,
no profiler) of each step a request cannot skip in Python.  cProfile's own cost falls
mostly on Python calls, so the figures overstate Python-heavy groups; the groups' order and
the bound are what to read.

    python benchmarks/profile_match_insert.py --sglang-src /tmp/kvcore-ci-sglang-0.5.19/src
    python benchmarks/profile_match_insert.py --backends radix,unified --backend-opt unified:components='["full"]'
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_radix  # noqa: E402 - the trace and the loops are bench_radix's

GROUPS = ("torch", "key checks", "slot checks", "tree", "builtins", "other")
# The loop's own frames and what runs before its clock starts.
NOT_THE_CACHES = ("timed_loop", "<built-in method gc.collect>", "<method 'disable' of '_lsprof.Profiler' objects>")


def group_of(filename: str, name: str) -> str:
    """The kind of work of one profiled function (see the module docstring)."""
    path = filename.replace("\\", "/")
    if filename == "~":
        return "torch" if "torch" in name or "Tensor" in name else "builtins"
    if "/torch/" in path:
        return "torch"
    if path.endswith("kvcore/keys.py"):
        return "key checks"
    if "/kvcore/pools/" in path:
        return "slot checks"
    if "/plugins/" in path or "/kvcore/tree/" in path or path.endswith("mem_cache/radix_cache.py"):
        return "tree"
    return "other"


def profile(run: Any) -> dict[str, float]:
    """Seconds of own time per group in the timed loop of one call of ``run()`` (its set-up left out)."""
    prof = cProfile.Profile()
    loop = bench_radix.timed_loop

    def profiled_loop(*args: Any) -> Any:
        prof.enable()
        try:
            return loop(*args)
        finally:
            prof.disable()

    bench_radix.timed_loop = profiled_loop
    try:
        run()
    finally:
        bench_radix.timed_loop = loop
    totals = dict.fromkeys(GROUPS, 0.0)
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if name in NOT_THE_CACHES or "profile_match_insert" in filename:
            continue
        totals[group_of(filename, name)] += tottime
    return totals


def floor_costs(req_len: int, page_size: int) -> dict[str, float]:
    """µs per call (timeit, best of 5) of the steps a request's match+insert cannot skip in Python.

    Each side builds its key from a fresh copy of the ids (both pay it); kvcore checks every
    unmatched id once (``check_token_ids``: the bad-input promise, one C pass) and makes the
    answer and the leaf's tensors (torch calls of about a microsecond each).
    """
    import timeit

    import torch

    from kvcore.keys import check_token_ids

    ids = list(range(1, req_len + 1))
    half = req_len // 2
    value = torch.arange(req_len, dtype=torch.int64)
    parts = [value[:half], value[half:]]
    steps: dict[str, Any] = {
        f"copy of {req_len} ids (each key)": lambda: ids[:],
        f"check_token_ids of {req_len - half} new ids": lambda: check_token_ids(ids, half),
        f"list compare of {half} ids (one edge)": lambda: ids[:half] == ids[:half],
        "torch slice + clone (the leaf's slots)": lambda: value[half:].clone(),
        "torch.cat of two slices (the match's answer)": lambda: torch.cat(parts),
        "torch.empty(0) (an empty answer)": lambda: torch.empty((0,), dtype=torch.int64),
    }
    out = {}
    for name, fn in steps.items():
        runs = timeit.repeat(fn, number=2000, repeat=5)
        out[name] = min(runs) / 2000 * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="radix")
    ap.add_argument("--backend-opt", action="append", default=[], metavar="[BACKEND:]KEY=VALUE")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--req-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--key-mode", choices=bench_radix.KEY_MODES, default="fresh")
    ap.add_argument("--sglang-src", default=None, help="SGLang source root (the folder holding sglang/)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    options = bench_radix.parse_backend_opts(args.backend_opt, backends)
    trace = bench_radix.make_trace(0, args.requests, args.req_len, args.num_prompts, args.prompt_len, 32000)
    sources = bench_radix.key_source(trace, args.key_mode)
    sides: dict[str, dict[str, float]] = {}
    for backend in backends:
        sides[backend] = profile(lambda b=backend: bench_radix.run_kvcore(
            b, options[b], trace, sources, args.page_size, "lru", args.key_mode))
    mod, how = bench_radix.import_sglang(args.sglang_src)
    if mod is None:
        print(f"profile_match_insert: no SGLang peer: {how}", file=sys.stderr)
    else:
        values = bench_radix.make_values(trace, args.req_len)
        sides["sglang"] = profile(lambda: bench_radix.run_sglang(
            mod, trace, sources, values, args.page_size, "lru", args.key_mode))
    per_req = {side: {g: t / args.requests * 1e6 for g, t in groups.items()} for side, groups in sides.items()}
    if args.json:
        print(json.dumps({"us_per_request": per_req, "page_size": args.page_size, "key_mode": args.key_mode,
                          "floor_us_per_call": floor_costs(args.req_len, args.page_size)}, indent=1))
        return 0
    print(f"µs per request (cProfile own time), page {args.page_size}, keys {args.key_mode}, "
          f"{args.req_len} tokens per request")
    print(f"{'group':12s}" + "".join(f"{side:>12s}" for side in per_req))
    for g in (*GROUPS, "total"):
        cells = [sum(v.values()) if g == "total" else v[g] for v in per_req.values()]
        print(f"{g:12s}" + "".join(f"{c:12.1f}" for c in cells))
    floor = floor_costs(args.req_len, args.page_size)
    print("\nµs per call of the steps a request cannot skip (timeit, best of 5):")
    for name, us in floor.items():
        print(f"  {us:8.2f}  {name}")
    if "sglang" in per_req:
        sg = sum(per_req["sglang"].values())
        for side in backends:
            floor = per_req[side]["torch"] + per_req[side]["key checks"]
            print(f"{side}: SGLang total / its own total {sg / sum(per_req[side].values()):.2f}x; "
                  f"SGLang total / (its torch + key checks) {sg / floor:.2f}x (the bound with no Python left)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Chunked prefill through SGLang's own request path: kvcore's caches against SGLang's, per prompt token.

Runs in ``.venv-sglang`` (real SGLang 0.5.19, ``./dev sglang-venv``).  For each prompt
length L (``--prompt-lens``) one request of L tokens goes through the steps SGLang's
scheduler takes (``tools/sglang_request_path_shim.py``'s ``World``: ``Req.init_next_round_input``
and the lock, per chunk of ``--chunk`` tokens ``alloc_req_slots``, ``alloc_token_slots`` /
``alloc_paged_token_slots_extend``, the row write and ``maybe_cache_unfinished_req``, then
``release_kv_cache``), once with SGLang's own cache and once with the kvcore cache that
``create_tree_cache`` builds for ``--radix-cache-backend kvcore-...``, on SGLang's pools.
Pairs: SGLang's ``RadixCache`` against ``kvcore-radix``, its ``UnifiedRadixCache`` against
``kvcore-unified``.  The figure is ns per prompt token, best of ``--repeat`` runs, in CPU time;
the sides alternate.  The CPU stand-ins are the test's (SGLang's Triton allocation kernels by
its own CPU reference; no model forward).

    .venv-sglang/bin/python benchmarks/bench_sglang_path.py
    .venv-sglang/bin/python benchmarks/bench_sglang_path.py --prompt-lens 8192 65536 --page-size 16 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

PAIRS = {"radix": ("radix", "kvcore-radix"), "unified": ("unified", "kvcore-unified")}


def one_prompt(cache_kind: str, kvcore_name: str | None, length: int, chunk: int, page_size: int) -> float:
    """CPU seconds for one ``length``-token prompt through chunked prefill and its release."""
    from tools.sglang_request_path_shim import World

    world = World(cache_kind, size=length + 4 * page_size, page_size=page_size, rows=2,
                  width=length + page_size, kvcore_name=kvcore_name)
    ids = [(i * 7919) % 30000 + 1 for i in range(length)]
    world.new_req("r", ids, None)
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        world.admit("r")
        while len(world.reqs["r"].prefix_indices) < length:
            world.extend("r", chunk)
        world.sample_first("r", 1)
        world.finish("r")
        return time.process_time() - start
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768, 131072, 262144])
    ap.add_argument("--chunk", type=int, default=8192, help="chunked prefill size in tokens")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--pairs", default="radix,unified", help=f"comma-separated, of {sorted(PAIRS)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        print(f"bench_sglang_path: unknown pair(s) {unknown}; choose from {sorted(PAIRS)}", file=sys.stderr)
        return 2

    import pytest
    from sglang.srt.runtime_context import get_context

    from tools.sglang_request_path_shim import install_cpu_kernels

    patch = pytest.MonkeyPatch()
    install_cpu_kernels(patch)
    rows: list[dict[str, Any]] = []
    with get_context().override_server_args():
        for pair in pairs:
            kind, name = PAIRS[pair]
            for length in args.prompt_lens:
                best: dict[str, float] = {}
                for _ in range(args.repeat):
                    for side, kvcore_name in (("sglang", None), ("kvcore", name)):
                        t = one_prompt(kind, kvcore_name, length, args.chunk, args.page_size)
                        best[side] = min(best.get(side, t), t)
                row = {"pair": pair, "prompt_len": length,
                       "sglang_ns_per_token": best["sglang"] / length * 1e9,
                       "kvcore_ns_per_token": best["kvcore"] / length * 1e9}
                row["speedup"] = row["sglang_ns_per_token"] / row["kvcore_ns_per_token"]
                rows.append(row)
                if not args.json:
                    print(f"{pair:8s} {length:>8d} tokens: SGLang {row['sglang_ns_per_token']:8.1f} ns/token, "
                          f"kvcore {row['kvcore_ns_per_token']:8.1f} ns/token, SGLang / kvcore "
                          f"{row['speedup']:.2f}x", flush=True)
    patch.undo()
    if args.json:
        print(json.dumps({"chunk": args.chunk, "page_size": args.page_size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

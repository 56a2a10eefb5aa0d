"""Two vLLM engines in turn, sharing long prefixes through Redis: what the second one does not compute.

Each engine runs in a process of its own (``python -m kvcore_vllm.runs``), on a
tiny random-weight Llama on the CPU, against a real ``redis-server`` started
here on a free loopback port:

1. engine 1 with kvcore-vllm serves the prompts (its offloaded blocks go to Redis);
2. engine 2 with kvcore-vllm, a new process, serves the same prompts;
3. engine 2 without any connector (the baseline), a new process.

Reported: prefill tokens engine 2 computes with and without kvcore-vllm (prompt
tokens minus the tokens vLLM reports as cached), its time to first token
(``max_tokens=1``, requests one at a time: the wall time of each request), the
bytes per second of the store reads that fed engine 2 and of the worker's
copies, ``redis-benchmark`` GET with the same value size (one block) and
pipeline depth in the same run, and the host tier's hit rate.  Run it with
.venv-vllm's Python (vLLM and kvcore-redis installed)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--groups 4 --prefix-blocks 16 --json]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvcore_redis.servers import RedisServer, redis_server_missing
from kvcore_vllm.runs import BLOCK, run_in_new_process, tiny_llama


def prompts_with_shared_prefixes(groups: int, per_group: int, prefix_blocks: int, tail: int,
                                 seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    out = []
    for _ in range(groups):
        prefix = [r.randrange(1, 500) for _ in range(prefix_blocks * BLOCK)]
        out += [prefix + [r.randrange(1, 500) for _ in range(tail)] for _ in range(per_group)]
    return out


def redis_benchmark_get(port: int, value_size: int, pipeline: int, n: int) -> float:
    """GET bytes/s of ``redis-benchmark`` (one client, one key of ``value_size`` bytes, ``pipeline`` deep)."""
    def run(test: str) -> float:
        out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", test, "-d",
                              str(value_size), "-n", str(n), "-P", str(pipeline), "-c", "1", "--csv"],
                             check=True, capture_output=True, text=True, timeout=600).stdout
        return next(float(row[1]) for row in csv.reader(io.StringIO(out)) if row and row[0] == test.upper())

    run("set")  # the key GET reads
    return run("get") * value_size


def prefill_computed(prompts: list[list[int]], run: dict[str, Any]) -> int:
    return sum(len(p) - c for p, c in zip(prompts, run["cached"], strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4, help="distinct shared prefixes")
    ap.add_argument("--per-group", type=int, default=2, help="prompts per prefix")
    ap.add_argument("--prefix-blocks", type=int, default=16, help=f"blocks ({BLOCK} tokens) per shared prefix")
    ap.add_argument("--tail", type=int, default=24, help="tokens of each prompt's own after the prefix")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    why = redis_server_missing()
    if why:
        ap.error(why)

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = str(tiny_llama(work / "model", seed=0, layers=args.layers, hidden=args.hidden, heads=args.hidden // 64,
                           kv_heads=max(1, args.hidden // 128)))
    prompts = prompts_with_shared_prefixes(args.groups, args.per_group, args.prefix_blocks, args.tail)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with RedisServer(work / "redis") as server:
        url = f"redis://{server.address}/0"
        kv = {"store": url, "host_bytes": 1 << 28}
        engine = {"prompts": prompts, "max_tokens": 1}
        [first] = run_in_new_process(model, [{**engine, "kvcore": kv}], work / "jobs")
        [second] = run_in_new_process(model, [{**engine, "kvcore": {**kv, "write_to_store": False}}], work / "jobs")
        [baseline] = run_in_new_process(model, [{**engine, "kvcore": None}], work / "jobs")
        m = second["manager"]
        block_bytes = m["store_bytes_found"] // max(1, m["store_blocks_found"])
        pipeline = max(1, round(m["store_blocks_asked"] / max(1, m["store_reads"])))
        rb = redis_benchmark_get(server.port, block_bytes or 1, pipeline, n=max(2000, 20 * pipeline))
    for run in (first, second, baseline):
        if run["tokens"] != baseline["tokens"]:
            print("WARNING: tokens differ from the baseline run", file=sys.stderr)
    final = m["host_hits"] + m["misses"]
    w = second.get("worker", {})
    report = {
        "prompts": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
        "block_bytes": block_bytes, "store_batch_blocks": pipeline,
        "engine2_prefill_tokens_with_kvcore": prefill_computed(prompts, second),
        "engine2_prefill_tokens_without": prefill_computed(prompts, baseline),
        "engine2_ttft_ms_median_with_kvcore": 1e3 * statistics.median(second["ttft_s"]),
        "engine2_ttft_ms_median_without": 1e3 * statistics.median(baseline["ttft_s"]),
        "engine2_store_read_MBps": m["store_bytes_found"] / max(1e-9, m["store_read_s"]) / 1e6,
        "engine2_worker_load_MBps": w.get("bytes_loaded", 0) / max(1e-9, w.get("load_s", 0.0)) / 1e6,
        "engine2_store_read_bytes": m["store_bytes_found"],
        "redis_benchmark_get_MBps": rb / 1e6,
        "engine2_host_hit_rate": m["host_hits"] / max(1, final),
        "tokens_identical": first["tokens"] == second["tokens"] == baseline["tokens"],
        "engine1_blocks_stored": first["manager"]["blocks_stored"],
    }
    report["store_read_vs_redis_benchmark"] = report["engine2_store_read_MBps"] / max(1e-9, report[
        "redis_benchmark_get_MBps"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bytes per second to a loopback Redis: kvcore's store against ``redis-benchmark``, same value size, one run.

Starts a ``redis-server`` on a free loopback port (kvcore_redis.servers), then
alternates the two sides ``--repeat`` times:

- kvcore: ``RedisStore.batch_set`` / ``batch_get`` of ``--batch`` pages of
  ``--value-size`` bytes (one pipeline each, framed and checksummed), one client;
- ``redis-benchmark -t set,get -d SIZE -P BATCH -c 1``: the same value size and
  pipeline depth from one client, without framing or checksums.

Reports each side's median bytes/s for SET and GET and kvcore's share of
redis-benchmark's.  The issue's target is a share of at least 0.5.

``--cluster N`` runs the same on an N-master Redis Cluster: kvcore's
``redis+cluster://`` store (one pipeline per master, sent at once from its
thread pool) against ``redis-benchmark --cluster -c N`` (one pipelined client
per master).

    python benchmarks/bench_store.py [--value-size 262144] [--batch 16] [--total-mb 512] [--repeat 3] [--json]
    python benchmarks/bench_store.py --cluster 3
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvcore_redis.servers import RedisClusterServers, RedisServer, redis_server_missing

import kvcore


def kvcore_side(url: str, value_size: int, batch: int, total: int) -> dict[str, float]:
    store = kvcore.open_store(url)
    value = os.urandom(value_size)
    rounds = max(1, total // (value_size * batch))
    keys = [[f"kvcore:bench:{r}:{i}" for i in range(batch)] for r in range(rounds)]
    t = time.perf_counter()
    for ks in keys:
        assert all(store.batch_set(ks, [value] * batch))
    set_s = time.perf_counter() - t
    t = time.perf_counter()
    for ks in keys:
        got = store.batch_get(ks)
        assert all(g is not None and len(g) == value_size for g in got)
    get_s = time.perf_counter() - t
    moved = rounds * batch * value_size
    stats = store.stats()
    assert stats["errors"] == 0, stats
    store.clear()
    store.close()
    return {"set_Bps": moved / set_s, "get_Bps": moved / get_s}


def redis_benchmark_side(port: int, value_size: int, batch: int, total: int, cluster: int = 0) -> dict[str, float]:
    n = max(batch, total // value_size)
    mode = ["--cluster", "-c", str(cluster)] if cluster else ["-c", "1"]
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(value_size),
         "-n", str(n), "-P", str(batch), *mode, "-r", str(n), "--csv"],
        check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    rps = {row[0]: float(row[1]) for row in csv.reader(io.StringIO(out)) if row and row[0] in ("SET", "GET")}
    return {"set_Bps": rps["SET"] * value_size, "get_Bps": rps["GET"] * value_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--value-size", type=int, default=256 * 1024, help="bytes per value (a page of K/V)")
    ap.add_argument("--batch", type=int, default=16, help="values per batch / pipeline depth")
    ap.add_argument("--total-mb", type=int, default=512, help="MB moved per side, per direction, per repeat")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cluster", type=int, default=0, metavar="N", help="an N-master Redis Cluster (0: one server)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    why = redis_server_missing()
    if why:
        print(f"bench_store: {why}", file=sys.stderr)
        return 2
    total = args.total_mb << 20
    runs: dict[str, list[dict[str, float]]] = {"kvcore": [], "redis-benchmark": []}
    with tempfile.TemporaryDirectory() as d:
        servers: RedisServer | RedisClusterServers = RedisClusterServers(d, masters=args.cluster) if args.cluster \
            else RedisServer(d)
        with servers:
            nodes = servers.nodes if isinstance(servers, RedisClusterServers) else [servers]
            url = (servers.url + "?timeout=30") if isinstance(servers, RedisClusterServers) \
                else f"redis://{nodes[0].address}/0?timeout=30"
            for _ in range(args.repeat):  # alternate the sides: the machine is shared and noisy
                runs["kvcore"].append(kvcore_side(url, args.value_size, args.batch, total))
                runs["redis-benchmark"].append(redis_benchmark_side(nodes[0].port, args.value_size, args.batch,
                                                                    total, args.cluster))
                for node in nodes:
                    with node.client() as c:
                        c.flushdb()
    med: dict[str, Any] = {side: {k: statistics.median(r[k] for r in rs) for k in ("set_Bps", "get_Bps")}
                           for side, rs in runs.items()}
    ratio = {k: med["kvcore"][k] / med["redis-benchmark"][k] for k in ("set_Bps", "get_Bps")}
    report = {"value_size": args.value_size, "batch": args.batch, "total_mb": args.total_mb, "repeat": args.repeat,
              "cluster_masters": args.cluster, "median": med, "kvcore_over_redis_benchmark": ratio, "runs": runs}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        where = f"{args.cluster}-master Cluster" if args.cluster else "one server"
        print(f"{where}: value {args.value_size:,} B, batch/pipeline {args.batch}, {args.total_mb} MB per side, "
              f"median of {args.repeat}")
        for op in ("set_Bps", "get_Bps"):
            k, r = med["kvcore"][op], med["redis-benchmark"][op]
            print(f"  {op[:3].upper()}: kvcore {k / 1e6:,.0f} MB/s, redis-benchmark {r / 1e6:,.0f} MB/s, "
                  f"ratio {k / r:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

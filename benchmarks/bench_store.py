"""Bytes per second to a loopback Redis: kvcore's store against ``redis-benchmark``, same value size, one run.

Starts a ``redis-server`` on a free loopback port (kvcore_redis.servers), then
alternates the sides ``--repeat`` times, each kvcore side in a fresh process:

- kvcore: ``batch_set`` of ``--batch`` pages of ``--value-size`` bytes (one
  pipeline each, framed and checksummed), one client; then the same pages read
  back three ways, each a whole pass: ``batch_get`` (``bytes``),
  ``batch_get_views`` (memoryviews of the frames read off the socket) and
  ``batch_get_into`` (into ``--batch`` preallocated buffers, reused from batch
  to batch as a host tier reuses its pages);
- with ``--baseline REV``: the same with kvcore and kvcore-redis as they were at
  git revision ``REV`` (extracted into a temporary folder, put first on
  ``PYTHONPATH``), which may only have ``batch_get``;
- ``redis-benchmark -d SIZE -P BATCH -c 1 -r N``: the same value size and
  pipeline depth from one client, without framing or checksums.  GET runs
  after every one of the N keys it draws from was written, and only the GETs
  that found a value count (``INFO stats`` keyspace hits): a GET of an absent
  key moves no value, and after a random ``-t set,get`` run a third of the
  keys are absent.

Reports each side's median bytes/s and kvcore's share of redis-benchmark's.
The target is a share of at least 0.5.

``--cluster N`` runs the same on an N-master Redis Cluster: kvcore's
``redis+cluster://`` store (one pipeline per master, sent at once from its
thread pool) against ``redis-benchmark --cluster -c N`` (one pipelined client
per master; without ``-r``, so each GET reads the one key its master holds).

    python benchmarks/bench_store.py [--value-size 262144] [--batch 16] [--total-mb 512] [--repeat 3] [--json]
    python benchmarks/bench_store.py --baseline HEAD~1 --total-mb 128 --repeat 5
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
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from kvcore_redis.servers import RedisClusterServers, RedisServer, redis_server_missing

ROOT = Path(__file__).resolve().parent.parent
READS = ("get", "views", "into")


def kvcore_side(url: str, value_size: int, batch: int, total: int, reads: list[str]) -> dict[str, Any]:
    """One process's pass: SET every page, then each read API over every page."""
    import kvcore

    store = kvcore.open_store(url)
    value = os.urandom(value_size)
    rounds = max(1, total // (value_size * batch))
    keys = [[f"kvcore:bench:{r}:{i}" for i in range(batch)] for r in range(rounds)]
    t = time.perf_counter()
    for ks in keys:
        assert all(store.batch_set(ks, [value] * batch))
    out: dict[str, Any] = {"set_Bps": rounds * batch * value_size / (time.perf_counter() - t)}
    buffers = [bytearray(value_size) for _ in range(batch)]
    for how in reads:
        if not hasattr(store, f"batch_{how}" if how == "get" else f"batch_get_{how}"):
            continue
        t = time.perf_counter()
        for ks in keys:
            if how == "get":
                assert all(g is not None and len(g) == value_size for g in store.batch_get(ks))
            elif how == "views":
                assert all(g is not None and g.nbytes == value_size for g in store.batch_get_views(ks))
            else:
                assert all(store.batch_get_into(ks, buffers))
        out[f"{how}_Bps"] = rounds * batch * value_size / (time.perf_counter() - t)
    assert buffers[0] == value or "into_Bps" not in out
    stats = store.stats()
    assert stats["errors"] == 0, stats
    store.clear()
    store.close()
    out["kvcore_from"] = str(Path(kvcore.__file__).resolve().parent.parent)
    return out


def run_kvcore(url: str, args: argparse.Namespace, total: int, checkout: Path | None) -> dict[str, Any]:
    """``kvcore_side`` in a fresh process, on this checkout or an extracted one."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(checkout / "plugins" / "redis"),
                                             env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--worker", url, "--value-size", str(args.value_size), "--batch",
           str(args.batch), "--total-mb", str(total >> 20), "--reads", ",".join(args.reads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"the kvcore side ({checkout or ROOT}) failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    want = checkout if checkout is not None else ROOT
    if Path(result.pop("kvcore_from")) != want.resolve():
        raise RuntimeError(f"the kvcore side did not import kvcore from {want}")
    return result


def extract(rev: str, into: Path) -> Path:
    """kvcore and kvcore-redis as they were at ``rev``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kvcore", "plugins/redis/kvcore_redis"],
                             check=True, capture_output=True, timeout=120).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _populate(node: RedisServer, n: int, value_size: int) -> None:
    """Every key ``redis-benchmark -r n`` draws from (``key:%012d``), so each of its GETs finds a value."""
    value = os.urandom(value_size)
    with node.client(timeout=60) as c:
        for lo in range(0, n, 64):
            pipe = c.pipeline(transaction=False)
            for i in range(lo, min(n, lo + 64)):
                pipe.set(f"key:{i:012d}", value)
            pipe.execute()


def _keyspace(nodes: list[RedisServer]) -> tuple[int, int]:
    hits = misses = 0
    for node in nodes:
        with node.client() as c:
            s = c.info("stats")
            hits += int(s["keyspace_hits"])
            misses += int(s["keyspace_misses"])
    return hits, misses


def redis_benchmark_side(nodes: list[RedisServer], value_size: int, batch: int, total: int,
                         cluster: int = 0) -> dict[str, float]:
    n = max(batch, total // value_size)
    # A Cluster's benchmark keys carry a random slot tag with -r, so no written set covers what GET draws:
    # there each client reads the one key per master that its SET wrote (no -r).
    mode = ["--cluster", "-c", str(cluster)] if cluster else ["-c", "1", "-r", str(n)]

    def bench(test: str) -> float:
        out = subprocess.run(
            ["redis-benchmark", "-h", "127.0.0.1", "-p", str(nodes[0].port), "-t", test, "-d", str(value_size),
             "-n", str(n), "-P", str(batch), *mode, "--csv"],
            check=True, capture_output=True, text=True, timeout=600,
        ).stdout
        return next(float(row[1]) for row in csv.reader(io.StringIO(out)) if row and row[0] == test.upper())

    set_rps = bench("set")
    if not cluster:
        _populate(nodes[0], n, value_size)
    h0, m0 = _keyspace(nodes)
    get_rps = bench("get")
    h1, m1 = _keyspace(nodes)
    found = (h1 - h0) / max(1, (h1 - h0) + (m1 - m0))
    return {"set_Bps": set_rps * value_size, "get_Bps": get_rps * value_size * found, "get_found": found}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--value-size", type=int, default=256 * 1024, help="bytes per value (a page of K/V)")
    ap.add_argument("--batch", type=int, default=16, help="values per batch / pipeline depth")
    ap.add_argument("--total-mb", type=int, default=512, help="MB moved per side, per direction, per repeat")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cluster", type=int, default=0, metavar="N", help="an N-master Redis Cluster (0: one server)")
    ap.add_argument("--reads", type=lambda s: s.split(","), default=list(READS),
                    help=f"read APIs to time, comma-separated (of {','.join(READS)})")
    ap.add_argument("--baseline", metavar="REV", help="also time kvcore as it was at this git revision")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bad = set(args.reads) - set(READS)
    if bad:
        ap.error(f"--reads takes {', '.join(READS)}; got {', '.join(sorted(bad))}")
    total = args.total_mb << 20
    if args.worker:
        print(json.dumps(kvcore_side(args.worker, args.value_size, args.batch, total, args.reads)))
        return 0
    why = redis_server_missing()
    if why:
        print(f"bench_store: {why}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, float]]] = {"kvcore": [], "redis-benchmark": []}
    if args.baseline:
        runs[f"kvcore@{args.baseline}"] = []
    with tempfile.TemporaryDirectory() as d:
        baseline = extract(args.baseline, Path(d) / "baseline") if args.baseline else None
        data_dir = Path(d) / "redis"
        servers: RedisServer | RedisClusterServers = \
            RedisClusterServers(data_dir, masters=args.cluster) if args.cluster else RedisServer(data_dir)
        with servers:
            nodes = servers.nodes if isinstance(servers, RedisClusterServers) else [servers]
            url = (servers.url + "?timeout=30") if isinstance(servers, RedisClusterServers) \
                else f"redis://{nodes[0].address}/0?timeout=30"
            for _ in range(args.repeat):  # alternate the sides: the machine is shared and noisy
                if baseline is not None:
                    runs[f"kvcore@{args.baseline}"].append(run_kvcore(url, args, total, baseline))
                runs["kvcore"].append(run_kvcore(url, args, total, None))
                runs["redis-benchmark"].append(redis_benchmark_side(nodes, args.value_size, args.batch,
                                                                    total, args.cluster))
                for node in nodes:
                    with node.client() as c:
                        c.flushdb()
    med: dict[str, dict[str, float]] = {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_Bps")}
        for side, rs in runs.items()}
    rb = med["redis-benchmark"]
    ratio = {side: {k: v / rb["set_Bps" if k == "set_Bps" else "get_Bps"] for k, v in m.items()}
             for side, m in med.items() if side != "redis-benchmark"}
    per_round = {side: {k: [r[k] / b["set_Bps" if k == "set_Bps" else "get_Bps"]
                            for r, b in zip(rs, runs["redis-benchmark"], strict=True)] for k in rs[0]}
                 for side, rs in runs.items() if side != "redis-benchmark"}
    report = {"value_size": args.value_size, "batch": args.batch, "total_mb": args.total_mb, "repeat": args.repeat,
              "cluster_masters": args.cluster, "baseline": args.baseline, "median": med,
              "over_redis_benchmark": ratio, "over_redis_benchmark_per_round": per_round, "runs": runs}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    where = f"{args.cluster}-master Cluster" if args.cluster else "one server"
    print(f"{where}: value {args.value_size:,} B, batch/pipeline {args.batch}, {args.total_mb} MB per side, "
          f"median of {args.repeat} (ratio: median, then each round's)")
    print(f"  redis-benchmark: SET {rb['set_Bps'] / 1e6:,.0f} MB/s, GET {rb['get_Bps'] / 1e6:,.0f} MB/s "
          f"(GETs that found a value: {min(r['get_found'] for r in runs['redis-benchmark']):.0%} in its worst round)")
    for side, m in med.items():
        if side == "redis-benchmark":
            continue
        for op, v in m.items():
            rounds = " ".join(f"{x:.2f}" for x in per_round[side][op])
            print(f"  {side} {op[:-4]:>5}: {v / 1e6:,.0f} MB/s, ratio {ratio[side][op]:.2f} ({rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvcore fuzz`` on a device: the same seeded driver, its caches built on ``--device``.

    python benchmarks/fuzz_device.py --device cuda --backend chunk,radix,swa,hisparse [--ops 20000] [--seed 0]

``kvcore fuzz`` has no ``--device`` option (its driver builds CPU caches); this runs
:func:`kvcore.fuzz.run_fuzz` with the factory it calls bound to the device, so every pool,
row table and free list lives there while the driver's own operations (admit, chunked
prefill, decode, retract, evict, locks, bad inputs) stay as they are.  Prints one JSON
object: per backend, its operations, invariant checks and seconds, or the failure with its
seed, operation number and what failed.  Exit status 1 when any backend failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import kvcore.fuzz as fuzz
from kvcore.devices import check_device
from kvcore.errors import DeviceUnavailable
from kvcore.factory import create_cache


def run_on(device: torch.device, backend: str, ops: int, seed: int) -> dict:
    built: list[str] = []

    def patched(name: str, **options: object) -> object:
        cache = create_cache(name, device=str(device), **options)
        built.append(str(cache.req_to_token_pool.req_to_token.device))
        return cache

    original = fuzz.create_cache
    fuzz.create_cache = patched
    t0 = time.perf_counter()
    try:
        result = fuzz.run_fuzz(backend, ops, seed)
    except fuzz.FuzzFailure as exc:
        return {"backend": backend, "ok": False, "seed": exc.seed, "op": exc.op, "what": exc.what,
                "caches_on": sorted(set(built)), "seconds": time.perf_counter() - t0}
    finally:
        fuzz.create_cache = original
    return {"backend": backend, "ok": True, "seed": seed, "ops": result.ops, "checks": result.checks,
            "bad_inputs": sum(v for k, v in result.counts.items() if k.startswith("bad: ")),
            "caches_on": sorted(set(built)), "seconds": result.seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="chunk,radix,swa,hisparse", help="comma-separated backends")
    ap.add_argument("--ops", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        dev = check_device(args.device)
    except DeviceUnavailable as exc:
        print(f"fuzz_device: {exc}", file=sys.stderr)
        return 1
    if args.ops < 0:
        print(f"fuzz_device: --ops must be >= 0, got {args.ops}", file=sys.stderr)
        return 1
    runs = []
    for backend in [b.strip() for b in args.backend.split(",") if b.strip()]:
        r = run_on(dev, backend, args.ops, args.seed)
        print(f"fuzz_device: {backend} on {dev}: " + ("clean" if r["ok"] else f"FAILED at operation {r['op']}: "
                                                     f"{r['what']}") + f" ({r['seconds']:.1f} s)", file=sys.stderr)
        runs.append(r)
    print(json.dumps({"device": str(dev), "ops": args.ops, "runs": runs}, indent=2))
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Mooncake-format JSONL traces: replay production request streams, streamed.

Each line is an object with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``: one id per 512-token block of the prompt, equal ids meaning equal
blocks (and, as in Mooncake, equal prefixes).  Replay turns every hash id into a
fixed block of 512 token ids (a function of the id and ``--seed``), cuts the prompt to
``input_length`` and pads it with fresh tokens where the ids run out; the output is
fresh tokens too.

Nothing is materialised up front: a line becomes a :class:`RequestSpec` holding its
hash ids and lengths (a :class:`TraceRecipe`), the serving loop makes its tokens
(``array('q')``, vectorised) when it arrives and drops them when it finishes, so memory
follows what is running and cached, not the length of the trace.
:func:`generate_mooncake_like` writes synthetic traces with the published statistics of
Mooncake's FAST'25 traces (``python -m kvcore.bench.trace --help``).
"""

from __future__ import annotations

import json
import math
import random
from array import array
from importlib import resources
from pathlib import Path

import numpy as np

from kvcore.bench.spec import VOCAB, RequestSpec, Workload

__all__ = [
    "BLOCK_TOKENS", "SAMPLE_TRACE", "TRACE_PRESETS", "TraceRecipe", "load_trace", "generate_sample_trace",
    "generate_mooncake_like", "sample_trace_path",
]

BLOCK_TOKENS = 512
SAMPLE_TRACE = "mooncake_sample.jsonl"
# Bumped when the id -> tokens function changes (it is part of the workload digest).
_TOKENS_VERSION = b"kvcore-trace-tokens-2"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def sample_trace_path() -> Path:
    return Path(str(resources.files("kvcore.bench") / "data" / SAMPLE_TRACE))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping): a fixed pseudo-random function of x."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _base(seed: int, domain: int) -> int:
    return int(_mix(np.array([(seed * _GOLDEN + domain) & _MASK], dtype=np.uint64))[0])


def _to_ids(x: np.ndarray) -> np.ndarray:
    return (x % np.uint64(VOCAB - 1) + np.uint64(1)).astype(np.int64)


class TraceRecipe:
    """One trace line's tokens, made on demand: block tokens are a function of (hash id, seed), the
    pad and the output of (line, seed), so equal ids give equal blocks in every request."""

    __slots__ = ("seed", "index", "ids", "n_in", "n_out")

    def __init__(self, seed: int, index: int, ids: array, n_in: int, n_out: int):
        self.seed = seed
        self.index = index
        self.ids = ids
        self.n_in = n_in
        self.n_out = n_out

    def _blocks_used(self) -> int:
        return min(len(self.ids), -(-self.n_in // BLOCK_TOKENS))

    def tokens(self) -> tuple[array, array]:
        k = self._blocks_used()
        pos = np.arange(BLOCK_TOKENS, dtype=np.uint64)
        ids = np.frombuffer(self.ids, dtype=np.int64, count=k).astype(np.uint64)
        keys = _mix(ids ^ np.uint64(_base(self.seed, 1)))
        blk = _mix(keys[:, None] + pos[None, :]).ravel()[: self.n_in]
        fresh_n = self.n_in - blk.size + self.n_out
        start = np.uint64((_base(self.seed, 2) + self.index * (1 << 32)) & _MASK)
        fresh = _mix(start + np.arange(fresh_n, dtype=np.uint64))
        toks = _to_ids(np.concatenate((blk, fresh)))
        prompt, output = array("q"), array("q")
        prompt.frombytes(toks[: self.n_in].tobytes())
        output.frombytes(toks[self.n_in :].tobytes())
        return prompt, output

    def digest_bytes(self) -> bytes:
        head = f"{self.seed}\x00{self.index}\x00{self.n_in}\x00{self.n_out}\x00".encode()
        return _TOKENS_VERSION + head + self.ids[: self._blocks_used()].tobytes()

    def prompt_blocks(self) -> list[tuple[int, int]]:
        n = self.n_in
        return [(h, min(BLOCK_TOKENS, n - i * BLOCK_TOKENS)) for i, h in enumerate(self.ids[: self._blocks_used()])]


# The longest prompt or output a trace line may ask for (a row of the request table holds it).
MAX_TRACE_TOKENS = 1 << 20


def _field(obj: dict, name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: field {name!r} must be a non-negative integer, got {value!r}")
    if value > MAX_TRACE_TOKENS:
        raise ValueError(f"{where}: field {name!r} is {value:,} tokens, more than {MAX_TRACE_TOKENS:,}")
    return value


def load_trace(path: str | None, *, seed: int = 0, num_requests: int | None = None, step_ms: float = 20.0) -> Workload:
    """Read a Mooncake JSONL trace (default: the shipped sample) as a streamed workload.

    ``timestamp`` (ms, relative to the first line) becomes the arrival step
    ``timestamp // step_ms``; ``num_requests`` keeps only the first lines.  Each request
    holds its hash ids and lengths; its tokens are made when it arrives
    (:meth:`RequestSpec.materialise`).
    """
    if step_ms <= 0:
        raise ValueError(f"--step-ms must be positive, got {step_ms}")
    p = sample_trace_path() if path is None else Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {str(p)!r} does not exist or is not a file")
    reqs: list[RequestSpec] = []
    t0 = None
    with p.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if num_requests is not None and len(reqs) >= num_requests:
                break
            line = line.strip()
            if not line:
                continue
            where = f"{p.name}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ts = obj.get("timestamp", 0)
            if not isinstance(ts, (int, float)) or isinstance(ts, bool):
                raise ValueError(f"{where}: field 'timestamp' must be a number, got {ts!r}")
            if not math.isfinite(ts) or ts < 0:
                raise ValueError(f"{where}: field 'timestamp' must be a finite number >= 0 (ms), got {ts!r}")
            n_in = _field(obj, "input_length", where)
            n_out = _field(obj, "output_length", where)
            if n_in < 2 or n_out < 1:
                raise ValueError(f"{where}: input_length must be >= 2 and output_length >= 1")
            raw = obj.get("hash_ids", [])
            if not isinstance(raw, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in raw):
                raise ValueError(f"{where}: field 'hash_ids' must be a list of integers")
            try:
                ids = array("q", raw[: -(-n_in // BLOCK_TOKENS)])
            except OverflowError:
                raise ValueError(f"{where}: field 'hash_ids' holds an id outside the 64-bit signed range") from None
            t0 = ts if t0 is None else t0
            i = len(reqs)
            reqs.append(RequestSpec(f"r{i}", int(max(0.0, ts - t0) // step_ms), (), (),
                                    recipe=TraceRecipe(seed, i, ids, n_in, n_out), prompt_len=n_in, output_len=n_out))
    if not reqs:
        raise ValueError(f"trace file {str(p)!r} holds no requests")
    reqs.sort(key=lambda r: r.arrival)  # stable: equal timestamps keep file order
    params = {"trace": str(p), "step_ms": step_ms, "block_tokens": BLOCK_TOKENS}
    return Workload("trace", seed, reqs, params)


def generate_sample_trace(path: str | Path, *, num_requests: int = 240, seed: int = 0) -> None:
    """Write a small synthetic trace in the Mooncake format (how the shipped sample was made).

    Requests draw a prefix chain from a few popular "documents" (Zipf-like), extend
    it by a few private blocks, and arrive with exponential gaps (mean 60 ms).
    """
    rng = random.Random(seed)
    next_id = 0
    docs: list[list[int]] = []
    for _ in range(12):
        k = rng.randint(1, 6)
        docs.append(list(range(next_id, next_id + k)))
        next_id += k
    weights = [1.0 / (i + 1) for i in range(len(docs))]
    t = 0.0
    lines = []
    for _ in range(num_requests):
        t += rng.expovariate(1 / 60.0)
        doc = rng.choices(docs, weights=weights)[0]
        own = rng.randint(0, 3)
        ids = doc + list(range(next_id, next_id + own))
        next_id += own
        n_in = max(2, (len(ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS))
        n_out = rng.randint(8, 400)
        lines.append(json.dumps({"timestamp": int(t), "input_length": n_in, "output_length": n_out, "hash_ids": ids}))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


# Published statistics of Mooncake's FAST'25 traces (github.com/kvcache-ai/Mooncake, FAST25-release/traces):
# requests, average input and output tokens, and about an hour of arrivals.  The synthetic traces match
# these; their reuse structure (shared documents, conversations that extend their previous turn) is ours.
TRACE_PRESETS: dict[str, dict] = {
    "conversation": dict(requests=12_031, mean_input=12_035, mean_output=343, duration_ms=3_600_000,
                         docs=400, doc_blocks=(2, 12), first_blocks=(1, 16), turns=(1, 10), turn_blocks=(1, 5),
                         output=(16, 800), turn_gap_ms=90_000.0),
    "toolagent": dict(requests=23_608, mean_input=8_596, mean_output=182, duration_ms=3_600_000,
                      docs=60, doc_blocks=(4, 14), first_blocks=(0, 10), turns=(1, 6), turn_blocks=(1, 3),
                      output=(8, 400), turn_gap_ms=20_000.0),
}


def generate_mooncake_like(path: str | Path, preset: str = "conversation", *, seed: int = 0,
                           num_requests: int | None = None) -> dict:
    """Write a synthetic trace in the Mooncake format with ``preset``'s statistics; returns them as measured.

    Conversations start at uniform times over the hour; the first turn is a popular shared
    document (Zipf) plus private blocks, each later turn extends the previous prompt (its
    full blocks keep their ids, the rest — its last partial block, the previous answer and
    the new question — get new ids, as a content hash would) after an exponential gap.
    Prompt lengths are then scaled per preset so the mean input matches.
    """
    if preset not in TRACE_PRESETS:
        raise ValueError(f"unknown trace preset {preset!r}; choose one of: {', '.join(TRACE_PRESETS)}")
    p = TRACE_PRESETS[preset]
    n = num_requests if num_requests is not None else p["requests"]
    if n <= 0:
        raise ValueError(f"num_requests must be positive, got {n}")
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    docs = [fresh(rng.randint(*p["doc_blocks"])) for _ in range(p["docs"])]
    weights = [1.0 / (i + 1) for i in range(len(docs))]
    rows: list[tuple[float, list[int], int, int]] = []
    while len(rows) < n:
        t = rng.uniform(0, p["duration_ms"])
        ids = rng.choices(docs, weights=weights)[0] + fresh(rng.randint(*p["first_blocks"]))
        n_in = max(2, len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS))
        for turn in range(rng.randint(*p["turns"])):
            if turn:
                t += rng.expovariate(1 / p["turn_gap_ms"])
                keep = n_in // BLOCK_TOKENS
                ids = ids[:keep] + fresh(rng.randint(*p["turn_blocks"]) + 1)
                n_in = max(2, len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS))
            rows.append((t, ids, n_in, rng.randint(*p["output"])))
    rows.sort(key=lambda r: r[0])
    rows = rows[:n]
    # Scale the outputs to the published mean (the prompts follow from the block structure).
    out_scale = p["mean_output"] * len(rows) / sum(r[3] for r in rows)
    t0 = rows[0][0]
    lines = []
    total_in = total_out = 0
    seen: set[int] = set()
    reused = 0
    for t, ids, n_in, n_out in rows:
        n_out = max(1, round(n_out * out_scale))
        total_in += n_in
        total_out += n_out
        reused += sum(min(BLOCK_TOKENS, n_in - i * BLOCK_TOKENS) for i, h in enumerate(ids) if h in seen)
        seen.update(ids)
        lines.append(json.dumps({"timestamp": int(t - t0), "input_length": n_in, "output_length": n_out,
                                 "hash_ids": ids}, separators=(",", ":")))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"preset": preset, "requests": len(rows), "prompt_tokens": total_in, "output_tokens": total_out,
            "mean_input": total_in / len(rows), "mean_output": total_out / len(rows),
            "block_reuse": reused / total_in, "unique_blocks": len(seen)}


def _main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcore.bench.trace",
                                 description="Write a synthetic Mooncake-format trace with a preset's statistics.")
    ap.add_argument("preset", choices=list(TRACE_PRESETS))
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=None)
    args = ap.parse_args(argv)
    stats = generate_mooncake_like(args.out, args.preset, seed=args.seed, num_requests=args.num_requests)
    print(json.dumps(stats))


if __name__ == "__main__":
    _main()

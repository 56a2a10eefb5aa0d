"""Mooncake-format JSONL traces: replay production request streams.

Each line is an object with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``: one id per 512-token block of the prompt, equal ids meaning equal
blocks (and, as in Mooncake, equal prefixes).  Replay turns every hash id into a
fixed block of 512 token ids (seeded by the id and ``--seed``), cuts the prompt to
``input_length`` and pads it with fresh tokens where the ids run out.
"""

from __future__ import annotations

import json
import math
import random
from importlib import resources
from pathlib import Path

import torch

from kvcore.bench.spec import VOCAB, RequestSpec, TokenSource, Workload

__all__ = ["BLOCK_TOKENS", "SAMPLE_TRACE", "load_trace", "generate_sample_trace", "sample_trace_path"]

BLOCK_TOKENS = 512
SAMPLE_TRACE = "mooncake_sample.jsonl"


def sample_trace_path() -> Path:
    return Path(str(resources.files("kvcore.bench") / "data" / SAMPLE_TRACE))


class _Blocks:
    def __init__(self, seed: int):
        self.seed = seed
        self.cache: dict[int, list[int]] = {}

    def get(self, h: int) -> list[int]:
        blk = self.cache.get(h)
        if blk is None:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + h) & 0x7FFF_FFFF_FFFF_FFFF)
            blk = self.cache[h] = torch.randint(1, VOCAB, (BLOCK_TOKENS,), generator=gen).tolist()
        return blk


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
    """Read a Mooncake JSONL trace (default: the shipped sample) as a workload.

    ``timestamp`` (ms, relative to the first line) becomes the arrival step
    ``timestamp // step_ms``; ``num_requests`` keeps only the first lines.
    """
    if step_ms <= 0:
        raise ValueError(f"--step-ms must be positive, got {step_ms}")
    p = sample_trace_path() if path is None else Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {str(p)!r} does not exist or is not a file")
    blocks = _Blocks(seed)
    toks = TokenSource(seed)
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
            ids = obj.get("hash_ids", [])
            if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                raise ValueError(f"{where}: field 'hash_ids' must be a list of integers")
            t0 = ts if t0 is None else t0
            prompt: list[int] = []
            for h in ids:
                if len(prompt) >= n_in:
                    break
                prompt += blocks.get(h)
            prompt = prompt[:n_in] + toks.take(n_in - len(prompt))
            reqs.append(RequestSpec(f"r{len(reqs)}", int(max(0.0, ts - t0) // step_ms), prompt, toks.take(n_out)))
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

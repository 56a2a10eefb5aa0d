"""Seeded workload generators: every request, token and arrival follows from the options and the seed.

A workload is a list of :class:`RequestSpec` in arrival order.  Arrivals are in
scheduler steps; a follow-up turn of a conversation arrives ``think`` steps after
the previous turn finished, so its arrival is decided by the serving loop.
``Workload.digest`` is a sha256 over every field of every request, so two runs
can be shown to have done the same work.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["RequestSpec", "Workload", "WORKLOADS", "DEFAULT_NUM_REQUESTS", "make_workload", "TokenSource"]

VOCAB = 32000


@dataclass(slots=True)
class RequestSpec:
    """One request: its prompt, the tokens it will generate, and when it arrives.

    ``session_id`` groups the turns of one conversation; ``turn`` counts from 0 and
    a follow-up turn (turn > 0) arrives ``think`` steps after the previous turn of
    its conversation finished (``arrival`` is then unused).  ``last_turn`` closes the
    conversation.
    """

    rid: str
    arrival: int
    prompt: list[int]
    output: list[int]
    session_id: str | None = None
    turn: int = 0
    think: int = 0
    last_turn: bool = True

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class Workload:
    name: str
    seed: int
    requests: list[RequestSpec]
    params: dict[str, Any] = field(default_factory=dict)
    _digest: str | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:
            h = hashlib.sha256()
            h.update(f"{self.name}\x00{self.seed}\x00{len(self.requests)}\x00".encode())
            for r in self.requests:
                h.update(
                    f"{r.rid}\x00{r.arrival}\x00{r.session_id}\x00{r.turn}\x00{r.think}\x00{int(r.last_turn)}"
                    f"\x00{len(r.prompt)}\x00{len(r.output)}\x00".encode()
                )
                h.update(array("q", r.prompt).tobytes())
                h.update(array("q", r.output).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    @property
    def max_total_len(self) -> int:
        return max((r.total_len for r in self.requests), default=1)


class TokenSource:
    """Hands out fresh random token ids from one seeded torch generator, in bulk."""

    def __init__(self, seed: int, block: int = 1 << 16):
        self._gen = torch.Generator().manual_seed(seed)
        self._block = block
        self._buf: list[int] = []
        self._pos = 0

    def take(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if self._pos + n > len(self._buf):
            rest = self._buf[self._pos :]
            size = max(self._block, n)
            self._buf = rest + torch.randint(1, VOCAB, (size,), generator=self._gen).tolist()
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out


def _arrivals(rng: random.Random, n: int, rate: float) -> list[int]:
    """Poisson arrivals at ``rate`` requests per step, as step numbers."""
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(int(t))
    return out


def _shared_prefix(n: int, seed: int) -> Workload:
    p = dict(groups=16, min_group=8, system_prompt=(512, 1536), suffix=(32, 256), output=(32, 384), rate=4.0)
    rng = random.Random(seed)
    toks = TokenSource(seed)
    num_groups = max(1, min(p["groups"], math.ceil(n / p["min_group"])))
    systems = [toks.take(rng.randint(*p["system_prompt"])) for _ in range(num_groups)]
    reqs = []
    for i, t in enumerate(_arrivals(rng, n, p["rate"])):
        g = rng.randrange(num_groups)
        prompt = systems[g] + toks.take(rng.randint(*p["suffix"]))
        reqs.append(RequestSpec(f"r{i}", t, prompt, toks.take(rng.randint(*p["output"]))))
    return Workload("shared-prefix", seed, reqs, p | {"num_groups": num_groups})


def _multi_turn(n: int, seed: int) -> Workload:
    p = dict(
        turns=(2, 6), system_prompts=4, system_prompt=(256, 768), user=(64, 256), output=(32, 256),
        think=(5, 60), rate=0.5,
    )
    rng = random.Random(seed)
    toks = TokenSource(seed)
    systems = [toks.take(rng.randint(*p["system_prompt"])) for _ in range(p["system_prompts"])]
    reqs: list[RequestSpec] = []
    conv = 0
    t = 0.0
    while len(reqs) < n:
        t += rng.expovariate(p["rate"])
        turns = min(rng.randint(*p["turns"]), n - len(reqs))
        sid = f"c{conv}"
        history = list(rng.choice(systems))
        for k in range(turns):
            prompt = history + toks.take(rng.randint(*p["user"]))
            output = toks.take(rng.randint(*p["output"]))
            think = rng.randint(*p["think"]) if k else 0
            reqs.append(RequestSpec(f"{sid}.t{k}", int(t), prompt, output, sid, k, think, k == turns - 1))
            history = prompt + output
        conv += 1
    return Workload("multi-turn", seed, reqs, p | {"conversations": conv})


def _zipf(n: int, seed: int) -> Workload:
    p = dict(prefixes=64, exponent=1.1, prefix=(256, 2048), suffix=(16, 128), output=(32, 256), rate=4.0)
    rng = random.Random(seed)
    toks = TokenSource(seed)
    prefixes = [toks.take(rng.randint(*p["prefix"])) for _ in range(p["prefixes"])]
    weights = [1.0 / (k + 1) ** p["exponent"] for k in range(p["prefixes"])]
    picks = rng.choices(range(p["prefixes"]), weights=weights, k=n)
    reqs = []
    for i, t in enumerate(_arrivals(rng, n, p["rate"])):
        prompt = prefixes[picks[i]] + toks.take(rng.randint(*p["suffix"]))
        reqs.append(RequestSpec(f"r{i}", t, prompt, toks.take(rng.randint(*p["output"]))))
    return Workload("zipf", seed, reqs, p)


def _unrelated(name: str, p: dict, n: int, seed: int) -> Workload:
    """Requests that share nothing: a fresh prompt and output each."""
    rng = random.Random(seed)
    toks = TokenSource(seed)
    reqs = [
        RequestSpec(f"r{i}", t, toks.take(rng.randint(*p["prompt"])), toks.take(rng.randint(*p["output"])))
        for i, t in enumerate(_arrivals(rng, n, p["rate"]))
    ]
    return Workload(name, seed, reqs, p)


def _no_reuse(n: int, seed: int) -> Workload:
    return _unrelated("no-reuse", dict(prompt=(256, 2048), output=(32, 256), rate=2.0), n, seed)


def _long_decode(n: int, seed: int) -> Workload:
    return _unrelated("long-decode", dict(prompt=(32, 256), output=(1024, 2048), rate=0.5), n, seed)


WORKLOADS: dict[str, Callable[[int, int], Workload]] = {
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "zipf": _zipf,
    "no-reuse": _no_reuse,
    "long-decode": _long_decode,
}

DEFAULT_NUM_REQUESTS = {
    "shared-prefix": 500,
    "multi-turn": 600,
    "zipf": 1000,
    "no-reuse": 400,
    "long-decode": 128,
    "trace": None,  # every line of the trace
}


def make_workload(name: str, *, seed: int = 0, num_requests: int | None = None, trace: str | None = None,
                  step_ms: float = 20.0) -> Workload:
    """Build workload ``name``; ``trace`` is a Mooncake JSONL file (default: the shipped sample)."""
    if num_requests is not None and num_requests <= 0:
        raise ValueError(f"--num-requests must be positive, got {num_requests}")
    if name == "trace":
        from kvcore.bench.trace import load_trace

        return load_trace(trace, seed=seed, num_requests=num_requests, step_ms=step_ms)
    if trace is not None:
        raise ValueError(f"--trace only goes with --workload trace (got --workload {name})")
    gen = WORKLOADS.get(name)
    if gen is None:
        known = ", ".join([*WORKLOADS, "trace"])
        raise ValueError(f"unknown workload {name!r}; choose one of: {known}")
    return gen(num_requests or DEFAULT_NUM_REQUESTS[name], seed)

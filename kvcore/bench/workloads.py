"""Seeded workload generators and the one workload registry.

A workload is a list of :class:`RequestSpec` in arrival order.  Arrivals are in
scheduler steps; a follow-up turn of a conversation arrives ``think`` steps after
the previous turn finished, so its arrival is decided by the serving loop.
``Workload.digest`` is a sha256 over every field of every request, so two runs
can be shown to have done the same work.

:data:`WORKLOADS` is the registry: the CLI's choices and help, the docs table and
:func:`make_workload` all read it.  Every generator is registered with
:func:`register_workload`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvcore.bench.spec import VOCAB, RequestSpec, TokenSource, Workload
from kvcore.bench.trace import load_trace

__all__ = [
    "RequestSpec", "Workload", "TokenSource", "VOCAB", "WorkloadDef", "WORKLOADS", "DEFAULT_NUM_REQUESTS",
    "register_workload", "make_workload", "default_workload", "workloads_table", "TopKSelector",
]


@dataclass(frozen=True)
class WorkloadDef:
    """One registered workload.

    ``build(num_requests, seed, trace, step_ms)`` makes it (``num_requests`` None:
    the default); ``default_num_requests`` None means "all of the input";
    ``favours``: a backend config option; when every backend of a run has it and no
    workload is given, this workload runs (long-decode shows what window freeing saves).
    """

    name: str
    default_num_requests: int | None
    summary: str
    build: Callable[[int | None, int, str | None, float], Workload]
    takes_trace: bool = False
    favours: str | None = None


WORKLOADS: dict[str, WorkloadDef] = {}

# A workload function: ``fn(num_requests, seed)``, or with ``takes_trace`` the full build signature.
_WorkloadFn = TypeVar("_WorkloadFn", bound=Callable[..., Workload])


def register_workload(name: str, default_num_requests: int | None, summary: str, *, takes_trace: bool = False,
                      favours: str | None = None) -> Callable[[_WorkloadFn], _WorkloadFn]:
    """Decorator: register ``fn(num_requests, seed)`` (or, with ``takes_trace``, the full build signature)."""

    def deco(fn: _WorkloadFn) -> _WorkloadFn:
        build: Callable[[int | None, int, str | None, float], Workload]
        if takes_trace:
            build = fn
        else:
            def build(n: int | None, seed: int, trace: str | None, step_ms: float, _fn: _WorkloadFn = fn,
                      _default: int | None = default_num_requests) -> Workload:
                return _fn(n or _default, seed)
        WORKLOADS[name] = WorkloadDef(name, default_num_requests, summary, build, takes_trace, favours)
        return fn

    return deco


def _arrivals(rng: random.Random, n: int, rate: float) -> list[int]:
    """Poisson arrivals at ``rate`` requests per step, as step numbers."""
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(int(t))
    return out


@register_workload(
    "shared-prefix", 500,
    "up to 16 system prompts of 512-1536 tokens (one per 8 requests), each request adds a 32-256 token suffix, "
    "outputs 32-384; 4 arrivals/step",
)
def _shared_prefix(n: int, seed: int) -> Workload:
    p: dict[str, Any] = dict(
        groups=16, min_group=8, system_prompt=(512, 1536), suffix=(32, 256), output=(32, 384), rate=4.0
    )
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


@register_workload(
    "multi-turn", 600,
    "conversations of 2-6 turns over 4 shared system prompts (256-768); each turn is the previous prompt + output "
    "+ 64-256 new tokens, outputs 32-256, think time 5-60 steps; 0.5 conversations/step. Turns after the first run "
    "on a streaming session (`--no-sessions` sends them through the tree)",
)
def _multi_turn(n: int, seed: int) -> Workload:
    p: dict[str, Any] = dict(
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


@register_workload(
    "zipf", 1000,
    "64 prefixes of 256-2048 tokens picked with Zipf(1.1) popularity, 16-128 token suffixes, outputs 32-256",
)
def _zipf(n: int, seed: int) -> Workload:
    p: dict[str, Any] = dict(
        prefixes=64, exponent=1.1, prefix=(256, 2048), suffix=(16, 128), output=(32, 256), rate=4.0
    )
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


@register_workload(
    "no-reuse", 400, "unique prompts of 256-2048 tokens, outputs 32-256: the miss path and SWA's worst case",
)
def _no_reuse(n: int, seed: int) -> Workload:
    return _unrelated("no-reuse", dict(prompt=(256, 2048), output=(32, 256), rate=2.0), n, seed)


@register_workload(
    "long-decode", 128, "prompts of 32-256 tokens, outputs of 1024-2048: where window freeing pays",
    favours="sliding_window_size",
)
def _long_decode(n: int, seed: int) -> Workload:
    return _unrelated("long-decode", dict(prompt=(32, 256), output=(1024, 2048), rate=0.5), n, seed)


@register_workload(
    "pd-decode", 200,
    "the decode side of disaggregated serving: prompts of 256-1024 tokens arrive as KV transfers (4 steps each), "
    "outputs 64-256, 2 arrivals/step; `--pre-alloc-size N` gives pre-allocation rows on top of --max-num-reqs",
)
def _pd_decode(n: int, seed: int) -> Workload:
    return _unrelated("pd-decode", dict(prompt=(256, 1024), output=(64, 256), rate=2.0, pd_decode=True), n, seed)


@register_workload(
    "sparse-decode", 8,
    "long contexts of 8K-32K tokens, outputs 128-256, 1 arrival/step; every decode step reads a seeded top-k "
    "selection per request (`--topk-locality`: 0 uniform over the context, 1 only the most recent tokens)",
    favours="top_k",
)
def _sparse_decode(n: int, seed: int) -> Workload:
    return _unrelated("sparse-decode", dict(prompt=(8192, 32768), output=(128, 256), rate=1.0), n, seed)


class TopKSelector:
    """The sparse-decode selection: per request, ``min(top_k, seq_len)`` distinct positions of its context.

    ``locality`` of them are the most recent tokens (the newest included); the rest are
    drawn uniformly from the older ones (with repeats dropped, so a few fewer).  Rows are
    -1 padded to ``top_k``; one seeded generator makes the run reproducible.
    """

    def __init__(self, top_k: int, locality: float, seed: int = 0):
        if not 0.0 <= locality <= 1.0:
            raise ValueError(f"--topk-locality must lie in [0, 1], got {locality}")
        self.top_k = top_k
        self.locality = locality
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, seq_lens: list[int]) -> torch.Tensor:
        k = self.top_k
        out = torch.full((len(seq_lens), k), -1, dtype=torch.int64)
        for i, n in enumerate(seq_lens):
            want = min(k, n)
            recent = int(round(self.locality * want))
            older = n - recent
            picks = torch.arange(older, n, dtype=torch.int64)
            if want > recent and older > 0:
                drawn = torch.unique(torch.randint(0, older, (want - recent,), generator=self.gen))
                picks = torch.cat((drawn, picks))
            out[i, : picks.numel()] = picks
        return out


@register_workload(
    "trace", None,
    "a Mooncake JSONL trace (`--trace FILE`, default the shipped `kvcore/bench/data/mooncake_sample.jsonl`)",
    takes_trace=True,
)
def _trace(num_requests: int | None, seed: int, trace: str | None, step_ms: float) -> Workload:
    return load_trace(trace, seed=seed, num_requests=num_requests, step_ms=step_ms)


DEFAULT_NUM_REQUESTS = {name: w.default_num_requests for name, w in WORKLOADS.items()}


def make_workload(name: str, *, seed: int = 0, num_requests: int | None = None, trace: str | None = None,
                  step_ms: float = 20.0) -> Workload:
    """Build workload ``name``; ``trace`` is a Mooncake JSONL file (default: the shipped sample)."""
    if num_requests is not None and num_requests <= 0:
        raise ValueError(f"--num-requests must be positive, got {num_requests}")
    wl = WORKLOADS.get(name)
    if wl is None:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    if trace is not None and not wl.takes_trace:
        raise ValueError(f"--trace only goes with --workload trace (got --workload {name})")
    return wl.build(num_requests, seed, trace, step_ms)


def workloads_table() -> str:
    """The registry as the Markdown table in docs/bench.md."""
    rows = ["| workload | default n | shape |", "|---|---:|---|"]
    for name, w in WORKLOADS.items():
        n = "all lines" if w.default_num_requests is None else str(w.default_num_requests)
        rows.append(f"| `{name}` | {n} | {w.summary} |")
    return "\n".join(rows)


def default_workload(backend_options: list[set[str]], trace: str | None = None) -> str:
    """The workload a run gets when none is named: ``trace`` with a trace file, else the first workload
    that every backend's options favour, else the first registered one."""
    if trace is not None:
        return next(n for n, w in WORKLOADS.items() if w.takes_trace)
    for name, w in WORKLOADS.items():
        if w.favours and backend_options and all(w.favours in opts for opts in backend_options):
            return name
    return next(iter(WORKLOADS))

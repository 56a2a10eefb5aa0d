"""A workload as the prefix tree sees it: one path of weighted symbols per request, in serving order.

A path is what a request leaves in a radix tree once it finishes: its prompt and its
output, cut to whole pages (the tree keeps only whole pages).  Each symbol carries a
number of tokens:

- a generated request (token lists): one symbol per page, the page's token ids
  (the token id itself when ``page_size`` is 1), ``page_size`` tokens each;
- a streamed trace line (Mooncake ``hash_ids``): one symbol per 512-token block, its
  hash id, with the block's tokens (the last block of a prompt may be partial; only its
  whole pages count, the page that mixes it with fresh tokens is the request's own),
  then one symbol unique to the request for every other token (the pad past the ids
  and the output, fresh tokens that match nothing).  No token is generated.

``limit`` is the most a match may reuse: the prompt less its last token, page-aligned
(the serving loop matches ``prompt[:-1]``).  ``order`` puts conversation turns where
they would arrive (see :func:`serving_order`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from kvcore.bench.spec import RequestSpec, Workload
from kvcore.bench.trace import BLOCK_TOKENS

__all__ = ["Path", "request_path", "workload_paths", "serving_order"]


@dataclass(frozen=True, slots=True)
class Path:
    """One request's path: ``ids[i]`` holds ``his[i]`` tokens (all symbols start at token 0)."""

    ids: list[Hashable]
    his: list[int]
    limit: int
    prompt_len: int

    @property
    def tokens(self) -> int:
        return sum(self.his)


class _Fresh:
    """A symbol equal only to itself: tokens no other request shares."""

    __slots__ = ()


def request_path(spec: RequestSpec, page_size: int) -> Path:
    """``spec``'s path at ``page_size`` (see the module docstring)."""
    ps = page_size
    total = (spec.prompt_len + spec.output_len) // ps * ps
    limit = (spec.prompt_len - 1) // ps * ps
    if spec.recipe is not None:
        if BLOCK_TOKENS % ps:
            raise ValueError(f"--page-size {ps} must divide the trace's block of {BLOCK_TOKENS} tokens")
        ids: list[Hashable] = []
        his: list[int] = []
        for h, n in spec.recipe.prompt_blocks():
            whole = n // ps * ps
            if whole:
                ids.append(h)
                his.append(whole)
            if whole < BLOCK_TOKENS:
                break
        rest = total - sum(his)
        if rest > 0:
            ids.append(_Fresh())
            his.append(rest)
        return Path(ids, his, limit, spec.prompt_len)
    seq: list[Hashable] = [*spec.prompt, *spec.output]
    if ps == 1:
        return Path(seq, [1] * total, limit, spec.prompt_len)
    return Path([tuple(seq[k : k + ps]) for k in range(0, total, ps)], [ps] * (total // ps), limit, spec.prompt_len)


def serving_order(workload: Workload, chunk_size: int = 2048) -> list[int]:
    """Request indices in the order they reach the cache.

    First turns (and requests outside conversations) arrive at their arrival step.  A
    follow-up turn arrives ``think`` steps after its previous turn finished, which the
    serving loop decides; here it is estimated as that turn's arrival plus its prefill
    steps (``ceil(prompt / chunk_size)``) and one step per output token, i.e. a loop that
    never queues.  Ties keep the workload's order.
    """
    reqs = workload.requests
    at: dict[int, float] = {}
    done: dict[str, float] = {}
    for i, s in enumerate(reqs):
        if s.session_id is not None and s.turn > 0 and s.session_id in done:
            t = done[s.session_id] + s.think
        else:
            t = float(s.arrival)
        at[i] = t
        if s.session_id is not None:
            done[s.session_id] = t + -(-s.prompt_len // chunk_size) + s.output_len
    return sorted(range(len(reqs)), key=lambda i: (at[i], i))


def workload_paths(workload: Workload, page_size: int) -> Iterator[Path]:
    """Every request's path, in serving order."""
    if page_size < 1:
        raise ValueError(f"--page-size must be at least 1, got {page_size}")
    reqs = workload.requests
    for i in serving_order(workload):
        yield request_path(reqs[i], page_size)

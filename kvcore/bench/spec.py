"""What a workload is made of: requests, the workload itself and the seeded token source.

Shared by the generators (:mod:`kvcore.bench.workloads`) and the trace reader
(:mod:`kvcore.bench.trace`); it imports neither.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["VOCAB", "RequestSpec", "TokenRecipe", "Workload", "TokenSource", "token_list"]

VOCAB = 32000

# One int object per token id: lists made from arrays point at these instead of holding a fresh
# 28-byte int per token, so a prefix tree of N cached tokens costs 8N bytes of pointers, not 36N.
_INTERNED = np.array(list(range(VOCAB)), dtype=object)


def token_list(ids: Sequence[int]) -> list[int]:
    """The one place a streamed request's ``array('q')`` tokens become the list the caches take today.

    Ids in ``[0, VOCAB)`` share interned int objects; other sequences are copied as they are.
    """
    if isinstance(ids, array) and ids.typecode == "q":
        a = np.frombuffer(ids, dtype=np.int64) if len(ids) else np.zeros(0, dtype=np.int64)
        if a.size == 0 or (int(a.min()) >= 0 and int(a.max()) < VOCAB):
            return _INTERNED[a].tolist()
    return list(ids)

_NO_TOKENS: array = array("q")


class TokenRecipe(Protocol):
    """How a streamed request makes its tokens (a trace line): on arrival, not up front.

    ``tokens()`` returns (prompt, output) as ``array('q')``; ``digest_bytes()`` determines
    them (the workload digest hashes it instead of the tokens); ``prompt_blocks()`` lists
    the prompt as (block id, tokens) segments for the infinite-cache hit rate, where equal
    ids on equal paths are equal tokens and every other token is fresh.
    """

    def tokens(self) -> tuple[array, array]: ...

    def digest_bytes(self) -> bytes: ...

    def prompt_blocks(self) -> list[tuple[int, int]]: ...


@dataclass(slots=True)
class RequestSpec:
    """One request: its prompt, the tokens it will generate, and when it arrives.

    ``session_id`` groups the turns of one conversation; ``turn`` counts from 0 and
    a follow-up turn (turn > 0) arrives ``think`` steps after the previous turn of
    its conversation finished (``arrival`` is then unused).  ``last_turn`` closes the
    conversation.

    A streamed request (``recipe`` set, a trace line) holds no tokens until the serving
    loop calls :meth:`materialise` on its arrival, and none again after :meth:`release`
    when it finishes; ``prompt_len`` and ``output_len`` are known throughout.
    """

    rid: str
    arrival: int
    prompt: Sequence[int]
    output: Sequence[int]
    session_id: str | None = None
    turn: int = 0
    think: int = 0
    last_turn: bool = True
    recipe: TokenRecipe | None = None
    prompt_len: int = -1
    output_len: int = -1

    def __post_init__(self) -> None:
        if self.recipe is None:
            self.prompt_len = len(self.prompt)
            self.output_len = len(self.output)
        elif self.prompt_len < 0 or self.output_len < 0:
            raise ValueError(f"request {self.rid!r}: a streamed request needs prompt_len and output_len")

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len

    def materialise(self) -> None:
        """Make a streamed request's tokens (a no-op when it holds them)."""
        if self.recipe is not None and not self.prompt:
            self.prompt, self.output = self.recipe.tokens()

    def release(self) -> None:
        """Drop a streamed request's tokens (generated requests keep theirs)."""
        if self.recipe is not None:
            self.prompt = self.output = _NO_TOKENS


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
                    f"\x00{r.prompt_len}\x00{r.output_len}\x00".encode()
                )
                if r.recipe is not None:  # the recipe determines the tokens
                    h.update(r.recipe.digest_bytes())
                    continue
                h.update(array("q", r.prompt).tobytes())
                h.update(array("q", r.output).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

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

"""What a workload is made of: requests, the workload itself and the seeded token source.

Shared by the generators (:mod:`kvcore.bench.workloads`) and the trace reader
(:mod:`kvcore.bench.trace`); it imports neither.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["VOCAB", "RequestSpec", "Workload", "TokenSource"]

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

"""Rows of the request -> token-slot table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ReqToTokenPool"]


def _name(owner: Any) -> str:
    rid = getattr(owner, "rid", None)
    return f"request {rid!r}" if rid is not None else repr(owner)


class ReqToTokenPool:
    """A row of ``req_to_token`` per live request.

    Like SGLang, row 0 is padding (the table has ``size + 1`` rows) and the free
    list is a stack: rows are taken from its tail and freed rows go back there.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size={size} and max_context_len={max_context_len} must be positive")
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.clear()

    def clear(self) -> None:
        # The flag list makes double-free checks O(1); row 0 is padding, never free.
        self._free: list[int] = list(range(1, self.size + 1))
        self._is_free = [False] + [True] * self.size
        # The record (ReqKvInfo) each row was handed to, so a release can check it is the holder.
        self._holder: list[Any] = [None] * (self.size + 1)

    def available_size(self) -> int:
        return len(self._free)

    def free_rows(self) -> list[int]:
        return list(self._free)

    def holds(self, kv: Any) -> bool:
        """True when ``kv`` (a ReqKvInfo) holds one of this pool's rows, handed to it by ``alloc``."""
        row = kv.req_pool_idx
        return row is not None and 1 <= row <= self.size and self._holder[row] is kv

    def write(self, indices: Any, values: Any) -> None:
        self.req_to_token[indices] = values

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        need: dict[int, Any] = {}
        for r in reqs:
            if r.kv.req_pool_idx is None:
                # The same record listed twice must still get one row.
                need.setdefault(id(r.kv), r.kv)
        if len(need) > len(self._free):
            return None
        if need:
            rows = self._free[-len(need):]
            del self._free[-len(need):]
            for kv, row in zip(need.values(), rows):
                self._is_free[row] = False
                self._holder[row] = kv
                kv.req_pool_idx = row
        return [r.kv.req_pool_idx for r in reqs]

    def free(self, owner: Any) -> None:
        row = owner.kv.req_pool_idx
        if row is None:
            raise ValueError(f"{_name(owner)} holds no req_to_token row")
        if not 1 <= row <= self.size:
            raise ValueError(f"{_name(owner)} holds row {row}, outside the pool's rows 1..{self.size}")
        if self._is_free[row]:
            raise ValueError(f"row {row} of {_name(owner)} is already free (double free)")
        if self._holder[row] is not owner.kv:
            raise ValueError(f"row {row} is not {_name(owner)}'s: this pool handed it to another record")
        self._is_free[row] = True
        self._holder[row] = None
        self._free.append(row)
        owner.kv.req_pool_idx = None

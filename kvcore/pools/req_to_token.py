"""Rows of the request -> token-slot table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ReqToTokenPool", "DecodeReqToTokenPool"]


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
        # Rows the table hands out (row 0 is padding); DecodeReqToTokenPool adds its pre-allocation rows.
        self.num_rows = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.clear()

    def clear(self) -> None:
        # The flag list makes double-free checks O(1); row 0 is padding, never free.
        self._free: list[int] = list(range(1, self.num_rows + 1))
        self._is_free = [False] + [True] * self.num_rows
        # The record (ReqKvInfo) each row was handed to, so a release can check it is the holder.
        self._holder: list[Any] = [None] * (self.num_rows + 1)

    def available_size(self) -> int:
        return len(self._free)

    def free_rows(self) -> list[int]:
        return list(self._free)

    def holds(self, kv: Any) -> bool:
        """True when ``kv`` (a ReqKvInfo) holds one of this pool's rows, handed to it by ``alloc``."""
        row = kv.req_pool_idx
        return row is not None and 1 <= row <= self.num_rows and self._holder[row] is kv

    def write(self, indices: Any, values: Any) -> None:
        self.req_to_token[indices] = values

    def _take(self, n: int) -> list[int]:
        """``n`` free rows off the free list (its tail: a stack)."""
        rows = self._free[-n:]
        del self._free[-n:]
        return rows

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        """A row for every record in ``reqs`` that holds none; None (nothing taken) when rows run short.

        A record that already holds a row keeps it, and must carry allocated KV
        (SGLang's check: ValueError, nothing taken, when it does not).
        """
        need: dict[int, Any] = {}
        for r in reqs:
            if r.kv.req_pool_idx is None:
                # The same record listed twice must still get one row.
                need.setdefault(id(r.kv), r.kv)
            elif r.kv.kv_allocated_len <= 0:
                raise ValueError(
                    f"{_name(r)} reuses row {r.kv.req_pool_idx}, which carries no allocated KV "
                    "(a reused row must carry allocated KV)"
                )
        if len(need) > len(self._free):
            return None
        if need:
            rows = self._take(len(need))
            for kv, row in zip(need.values(), rows):
                self._is_free[row] = False
                self._holder[row] = kv
                kv.req_pool_idx = row
        return [r.kv.req_pool_idx for r in reqs]

    def free(self, owner: Any) -> None:
        row = owner.kv.req_pool_idx
        if row is None:
            raise ValueError(f"{_name(owner)} holds no req_to_token row")
        if not 1 <= row <= self.num_rows:
            raise ValueError(f"{_name(owner)} holds row {row}, outside the pool's rows 1..{self.num_rows}")
        if self._is_free[row]:
            raise ValueError(f"row {row} of {_name(owner)} is already free (double free)")
        if self._holder[row] is not owner.kv:
            raise ValueError(f"row {row} is not {_name(owner)}'s: this pool handed it to another record")
        self._is_free[row] = True
        self._holder[row] = None
        self._free.append(row)
        owner.kv.req_pool_idx = None


class DecodeReqToTokenPool(ReqToTokenPool):
    """The decode side of disaggregated serving (SGLang's ``disaggregation.decode.DecodeReqToTokenPool``).

    ``size`` rows for running requests plus ``pre_alloc_size`` rows for requests
    pre-allocated while their KV is still being transferred from a prefill
    server, so that pre-allocation (which unblocks the prefill side) does not wait
    for a running request to finish.  The scheduler keeps ``#running <= size``;
    the pool hands out any of its ``num_rows`` (``size + pre_alloc_size``) rows.
    As in SGLang, rows are taken from the head of the free list and freed rows go
    to its tail (a queue, where ``ReqToTokenPool`` is a stack).
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        pre_alloc_size: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if size <= 0 or pre_alloc_size < 0:
            raise ValueError(f"size={size} must be positive and pre_alloc_size={pre_alloc_size} not negative")
        super().__init__(size + pre_alloc_size, max_context_len, device)
        self.size = size  # SGLang's meaning: the running requests' rows
        self.pre_alloc_size = pre_alloc_size

    def _take(self, n: int) -> list[int]:
        rows = self._free[:n]
        del self._free[:n]
        return rows

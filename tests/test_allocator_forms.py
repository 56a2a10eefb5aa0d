"""The two array forms of the token allocator (numpy views on the CPU, torch elsewhere) are one
algorithm: random calls through ``NumpyOps`` and ``TorchOps("cpu")`` give the same slots, free
lists, claims and errors.  On a CPU-only machine this is how the torch form gets run at all."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvcore.pools import TokenToKVPoolAllocator
from kvcore.pools.array_ops import NumpyOps, TorchOps


def _outcome(fn: Any) -> Any:
    try:
        out = fn()
    except (ValueError, TypeError) as e:
        return ("error", type(e).__name__, str(e))
    return out.tolist() if isinstance(out, torch.Tensor) else out


def _state(a: TokenToKVPoolAllocator) -> Any:
    return a.available_size(), a.free_slots().tolist(), a.claimed_slots().tolist()


@pytest.mark.parametrize("p", [1, 3, 4])
def test_numpy_and_torch_forms_agree(p: int) -> None:
    rng = random.Random(p)
    size = 32 * p
    forms = [TokenToKVPoolAllocator(size, p, array_ops=NumpyOps()),
             TokenToKVPoolAllocator(size, p, array_ops=TorchOps("cpu"))]
    assert isinstance(TokenToKVPoolAllocator(size, p).ops, NumpyOps)  # the CPU default
    rows: list[list[int]] = []  # each "request": its slots in row order (the same on both forms)
    seen: set[tuple[str, bool]] = set()
    for step in range(400):
        op = rng.random()
        calls: list[Any]
        if op < 0.2:
            n = rng.randrange(0, 4) * p
            calls = [lambda a, n=n: a.alloc(n) for _ in forms]
            kind = "alloc"
        elif op < 0.4:
            pre, seq, last, owners = [], [], [], []
            for _ in range(rng.randrange(1, 4)):
                r = rng.choice(rows) if rows and rng.random() < 0.6 else []
                r = [] if any(r is o for o in owners) else r
                owners.append(r)
                pre.append(len(r))
                seq.append(len(r) + rng.randrange(0, 2 * p + 1))
                last.append(r[-1] if r else -1)
            if rng.random() < 0.1:  # a bad last_loc now and then
                last[0] = rng.randrange(-2, size + 2 * p)
            n = sum(seq) - sum(pre)
            calls = [lambda a, args=(pre, pre, seq, seq, last, n): a.alloc_extend(*args) for _ in forms]
            kind = "extend"
        elif op < 0.5 and rows:
            r = rng.choice(rows)
            calls = [lambda a, r=r: a.alloc_decode([len(r) + 1], [len(r) + 1], [r[-1]]) for _ in forms]
            kind = "decode"
        elif op < 0.75 and rows:
            r = rows.pop(rng.randrange(len(rows)))
            slots = r if rng.random() < 0.9 else r + [rng.randrange(-1, size + p + 1)]
            how = rng.choice(["free", "segment", "group"])
            calls = [lambda a, s=slots, h=how: _free(a, s, h) for _ in forms]
            kind = "free"
        elif op < 0.9 and rows:
            r = rng.choice(rows)
            slots = r[: rng.randrange(0, len(r) + 1)]
            if rng.random() < 0.3:
                slots = slots + [rng.randrange(-1, size + p + 1)]
            commit = rng.random() < 0.5
            calls = [lambda a, s=slots, c=commit: a.check_claimable(torch.tensor(s, dtype=torch.int64), commit=c)
                     for _ in forms]
            kind = "claim"
        else:
            calls = [lambda a: a.disown(a.claimed_slots()) for _ in forms]
            kind = "disown"
        got = [_outcome(lambda c=c, a=a: c(a)) for c, a in zip(calls, forms)]
        assert got[0] == got[1], (step, kind, got)
        seen.add((kind, isinstance(got[0], tuple)))
        assert _state(forms[0]) == _state(forms[1]), (step, kind)
        if kind in ("alloc", "extend") and isinstance(got[0], list) and got[0]:
            if kind == "alloc":
                rows.append(got[0])
            else:
                _grow(rows, owners, seq, got[0])
        elif kind == "decode" and isinstance(got[0], list):
            r.append(got[0][0])
    # Both successes and refusals of every kind of call were compared.
    assert {k for k, err in seen if err} >= {"free", "claim"} | ({"extend"} if p > 1 else set())
    assert {k for k, err in seen if not err} >= {"alloc", "extend", "decode", "free", "claim", "disown"}


def _free(a: TokenToKVPoolAllocator, slots: list[int], how: str) -> None:
    a.disown(torch.tensor(slots, dtype=torch.int64))
    if how == "free":
        a.free(slots)
    elif how == "segment":
        a.free_segments([(torch.tensor(slots, dtype=torch.int64), 0)])
    else:
        a.free_group_begin()
        try:
            a.free(slots)
        finally:
            a.free_group_end()


def _grow(rows: list[list[int]], owners: list[list[int]], seq: list[int], out: list[int]) -> None:
    """Hand an extend's slots to its requests (a fresh request becomes a new row)."""
    k = 0
    for r, b in zip(owners, seq):
        new = out[k : k + b - len(r)]
        k += len(new)
        if r:
            r.extend(new)
        elif new:
            rows.append(new)

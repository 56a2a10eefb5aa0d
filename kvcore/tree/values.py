"""Node values (1-D int64 slot tensors): joining a path's values, checking a caller's value.

A match returns the slots of the path it walked as one tensor; these helpers
concatenate once, and skip the concatenation where one part (or none) will do.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["join_values", "path_values", "checked_value", "alloc_value", "proven_prefix_len"]


def join_values(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """``parts`` as one tensor: ``empty`` when there are none, the part itself when there is one."""
    if not parts:
        return empty
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def path_values(node: Any, root: Any, empty: torch.Tensor) -> torch.Tensor:
    """The ``value`` of every node from below ``root`` down to ``node``, root side first, as one tensor."""
    parts: list[torch.Tensor] = []
    while node is not root:
        parts.append(node.value)
        node = node.parent
    parts.reverse()
    return join_values(parts, empty)


def checked_value(value: Any, key_len: int, aligned_len: int, device: Any) -> torch.Tensor:
    """An insert's ``value`` as int64 slots on ``device`` (refused before anything changes).

    TypeError unless it is a 1-D integer tensor (or a sequence of ints); ValueError
    unless it holds between ``aligned_len`` (the key's page-aligned length: a value
    covering just that will do, as SGLang's) and ``key_len`` slots.
    """
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(list(value), dtype=torch.int64)
        except (TypeError, ValueError):
            raise TypeError(f"value must be a 1-D integer tensor of slots, got {type(value).__name__}") from None
    if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(
            f"value must be a 1-D integer tensor of slots, got shape {tuple(value.shape)} dtype {value.dtype}"
        )
    if not aligned_len <= value.numel() <= key_len:
        raise ValueError(
            f"value has {value.numel()} slots but the key has {key_len} tokens"
            + (f" ({aligned_len} page-aligned)" if aligned_len != key_len else "")
        )
    return value.to(device=device, dtype=torch.int64)


def alloc_value(allocator: Any, n: int) -> torch.Tensor:
    """``n`` fresh slots from ``allocator`` for ``insert(key, value=None)``; RuntimeError when the pools are full."""
    value = allocator.alloc(n)
    if value is None:
        raise RuntimeError(f"cannot allocate {n} slots for insert(value=None): the pools are full")
    return value


def proven_prefix_len(root: Any, ids: list[int], n: int, page_size: int, extra_key: Any,
                      value: torch.Tensor, prev_prefix_len: int) -> int:
    """How much of ``value[:prev_prefix_len]`` is proven to be the tree's own slots for ``ids``.

    The one rule for ``prev_prefix_len``: it says the caller's first positions are
    the tree's (a request's protected prefix), so an insert need not check them as
    the caller's slots -- but it must never narrow a strict check.  The read-only
    walk (:func:`kvcore.tree.descend`, no LRU touch) finds the tree's slots for
    ``ids[:prev_prefix_len]``; the answer is how far ``value`` agrees with them.
    Everything above it is checked as the caller's.
    """
    from kvcore.tree.match import descend

    prev = min(prev_prefix_len, n)
    if prev <= 0:
        return 0
    path, pos, child, m = descend(root, ids, prev, page_size, extra_key)
    parts = [x.value for x in path]
    if child is not None and m:
        parts.append(child.value[:m])
    if not parts:
        return 0
    held = parts[0] if len(parts) == 1 else torch.cat(parts)
    k = min(prev, int(held.numel()))
    same = held[:k] == value[:k].to(held.device)
    if bool(same.all()):
        return k
    return int(torch.argmin(same.to(torch.int8)))

"""Pieces of one request's row: what a release path frees, split and trimmed by page."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["split_row_segments", "trim_row_segments"]


def trim_row_segments(segments: Sequence[tuple[torch.Tensor, int]], page_size: int) -> list[tuple[torch.Tensor, int]]:
    """Drop empty ``(slots, start_pos)`` pieces and trim a piece's head page when the
    piece before it already ends in that page, so a shared page is freed once."""
    pieces: list[tuple[torch.Tensor, int]] = []
    prev_end = None
    for slots, start in segments:
        n = slots.numel()
        if n == 0:
            continue
        end = start + n
        if prev_end is not None and start // page_size == (prev_end - 1) // page_size:
            boundary = (start // page_size + 1) * page_size
            slots = slots[boundary - start :]
            start = boundary
        prev_end = end
        if slots.numel():
            pieces.append((slots, start))
    return pieces


def split_row_segments(
    segments: Sequence[tuple[torch.Tensor, int]], *, dead_lo: int, dead_hi: int
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int]]]:
    """Split ascending ``(slots, start_pos)`` pieces of one row at ``[dead_lo, dead_hi)``.

    Returns the slots inside that range (window-freed while decoding: only their
    full side is still held) and the ``(slots, start_pos)`` pieces outside it.
    """
    dead: list[torch.Tensor] = []
    alive: list[tuple[torch.Tensor, int]] = []
    for slots, start in segments:
        n = slots.numel()
        if n == 0:
            continue
        lo = min(max(dead_lo - start, 0), n)
        hi = min(max(dead_hi - start, lo), n)
        if lo:
            alive.append((slots[:lo], start))
        if hi > lo:
            dead.append(slots[lo:hi])
        if hi < n:
            alive.append((slots[hi:], start + hi))
    return dead, alive

"""The host tier: K/V pages in host memory, keyed by store key, least recently used dropped first.

Its slots come from a :class:`kvcore.TokenToKVPoolAllocator` of ``host_size``
slots, exposed as the ``host`` pool, so the invariant checker proves that every
host slot is free or held by exactly one page.  A page is copied in and out
whole; nothing on the device points at a host slot, so a page is never locked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from kvcore.cache import SlotOwner
from kvcore.pools import PoolView, TokenToKVPoolAllocator

__all__ = ["HostTier"]


_NONE = torch.empty(0, dtype=torch.int64)


def _no_slots(kv: object) -> tuple[torch.Tensor, int]:
    return _NONE, 0


class HostTier:
    def __init__(self, size: int, page_size: int, page_bytes: int) -> None:
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.allocator = TokenToKVPoolAllocator(size, page_size=page_size, device="cpu")
        # Row p holds the page whose slots are [p * page_size, (p + 1) * page_size); row 0 is padding.
        self.data = torch.zeros((size // page_size + 1, page_bytes), dtype=torch.uint8)
        self.pages: OrderedDict[str, int] = OrderedDict()

    def view(self) -> PoolView:
        # No request row points into the host pool: a record owns none of its slots.
        return PoolView("host", self.allocator, record_slots=_no_slots)

    def cached_tokens(self) -> int:
        return len(self.pages) * self.page_size

    def owned_slots(self) -> Iterator[SlotOwner]:
        ps = self.page_size
        for key, row in self.pages.items():
            yield SlotOwner("host", f"host page {key[-12:]}", torch.arange(row * ps, row * ps + ps))

    def contiguous_hits(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n

    def read(self, keys: Sequence[str]) -> torch.Tensor:
        """The pages of ``keys`` (all present), shape ``(len(keys), page_bytes)``, marked recently used."""
        rows = []
        for k in keys:
            self.pages.move_to_end(k)
            rows.append(self.pages[k])
        return self.data[torch.tensor(rows, dtype=torch.int64)]

    def write(self, keys: Sequence[str], pages: torch.Tensor) -> list[bool]:
        """Copy in the pages not held yet (dropping the least recently used); whether each is new here."""
        new = [k not in self.pages for k in keys]
        want = [i for i, n in enumerate(new) if n]
        if not want:
            return new
        need = len(want) * self.page_size
        if need > self.allocator.size:
            want = want[-(self.allocator.size // self.page_size):]
            new = [i in set(want) for i in range(len(keys))]
            need = len(want) * self.page_size
        short = need - self.allocator.available_size()
        while short > 0 and self.pages:
            _, row = self.pages.popitem(last=False)
            self.allocator.free(torch.arange(row * self.page_size, (row + 1) * self.page_size))
            short -= self.page_size
        slots = self.allocator.alloc(need)
        if slots is None:  # cannot happen after the drops above; keep the tier unchanged if it does
            return [False] * len(keys)
        rows = slots.view(-1, self.page_size)[:, 0] // self.page_size
        self.data[rows] = pages[torch.tensor(want, dtype=torch.int64)]
        for i, row in zip(want, rows.tolist(), strict=True):
            self.pages[keys[i]] = row
        return new

    def clear(self) -> None:
        for row in self.pages.values():
            self.allocator.free(torch.arange(row * self.page_size, (row + 1) * self.page_size))
        self.pages.clear()

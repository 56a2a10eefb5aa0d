"""Store keys: a namespace that says which KV layout a page belongs to, then its chained page hash.

Two engines of the same model (same layout, dtype, page size and ``extra_key``)
compute the same keys for the same token prefix, in any process, so they find
each other's pages; two namespaces never share a key.  The page hash is the one
the tree's KV events publish (:func:`kvcore.tree.events.chain_page_hashes`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.tree.events import chain_page_hashes

__all__ = ["StoreNamespace"]


@dataclass(frozen=True, slots=True)
class StoreNamespace:
    """The layout a page's K/V bytes have: ``layout`` names the model and its shape, e.g.
    ``"llama-8b:L32:H8:D128"``; ``dtype`` the element type; ``page_size`` tokens per page."""

    layout: str
    dtype: str
    page_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")

    def prefix(self, extra_key: str | None) -> str:
        """``kvcore:<digest>:``: one digest per (layout, dtype, page size, extra_key)."""
        text = f"{self.layout}\x00{self.dtype}\x00{self.page_size}\x00{'' if extra_key is None else 'X' + extra_key}"
        return "kvcore:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:24] + ":"

    def page_keys(self, token_ids: Sequence[int], extra_key: str | None = None) -> list[str]:
        """One key per whole page of ``token_ids`` (a partial last page has none), chained from the start."""
        whole = len(token_ids) - len(token_ids) % self.page_size
        prefix = self.prefix(extra_key)
        return [prefix + h for h in chain_page_hashes(token_ids[:whole], self.page_size, None, extra_key)]

"""kvcore's page events as SGLang 0.5.19's KV events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)."""

from __future__ import annotations

import hashlib
from typing import Any

from sglang.srt.disaggregation.kv_events import (  # type: ignore[import-not-found,unused-ignore]
    BlockRemoved,
    BlockStored,
    BlockStoredMetadata,
    BlockStoredWithMetadata,
    StorageMedium,
)
from sglang.srt.mem_cache.events import KVCacheEventRecorder  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64  # type: ignore[import-not-found,unused-ignore]

from kvcore.tree.events import AllPagesCleared, PageRemoved, PageStored
from kvcore_sglang.v0_5_19.version import SGLANG_VERSION

__all__ = ["EventTranslator", "salt_namespace_hash", "salt_of"]


def salt_of(extra_key: Any) -> str | None:
    """The ``cache_salt`` of a kvcore namespace made by :func:`namespace` (None when unsalted)."""
    return extra_key[1] if isinstance(extra_key, tuple) else None


def salt_namespace_hash(salt: str) -> str:
    """SGLang's prior hash of a salted chain's first page (``compute_node_event_hash_values``)."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode("utf-8")).hexdigest()


class EventTranslator:
    """kvcore's page events as SGLang's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.

    SGLang's block hashes chain SGLang's own page hash (``get_hash_str``) and ignore
    ``extra_key``; kvcore's chain covers the namespace too.  So each kvcore page hash
    is mapped to the SGLang hash of the same page (chained on its parent's), and the
    events go through SGLang's own recorder, which coalesces them as SGLang does.  A
    ``cache_salt`` page is SGLang's ``BlockStoredWithMetadata`` with its namespace-aware
    hash (the chain starts from the salt's hash), as SGLang publishes it.
    """

    def __init__(self, page_size: int):
        self.recorder = KVCacheEventRecorder(enabled=True, page_size=page_size)
        self._sglang_hash: dict[str, str] = {}

    def feed(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, PageStored):
                parent = None if ev.parent_hash is None else self._sglang_hash[ev.parent_hash]
                salt = salt_of(ev.extra_key)
                # A salted page's SGLang hash chains from the salt's namespace hash under the root
                # (its compute_node_event_hash_values); an unsalted one from nothing.
                prior = parent if parent is not None or salt is None else salt_namespace_hash(salt)
                h = get_hash_str(list(ev.token_ids), prior)
                self._sglang_hash[ev.page_hash] = h
                fields = dict(
                    block_hashes=[hash_str_to_int64(h)],
                    parent_block_hash=None if parent is None else hash_str_to_int64(parent),
                    token_ids=list(ev.token_ids),
                    block_size=len(ev.token_ids),
                    lora_id=None,
                    medium=StorageMedium.GPU,
                )
                self.recorder.enqueue(BlockStored(**fields) if salt is None else BlockStoredWithMetadata(
                    **fields, metadata=BlockStoredMetadata(cache_salt=salt)))
            elif isinstance(ev, PageRemoved):
                h = self._sglang_hash.pop(ev.page_hash)
                self.recorder.enqueue(BlockRemoved(block_hashes=[hash_str_to_int64(h)], medium=StorageMedium.GPU))
            elif isinstance(ev, AllPagesCleared):
                self._sglang_hash.clear()
                self.recorder.record_all_cleared()
            else:
                raise TypeError(f"kvcore event {ev!r} has no SGLang {SGLANG_VERSION} counterpart")

    def take(self) -> list:
        return self.recorder.take()

"""kvcore's page events as SGLang 0.5.23's KV events, made by SGLang's own recorder.

SGLang 0.5.23's ``BlockStored`` carries ``cache_salt``, ``session_id`` and ``lora_name``,
its hashes are namespaced (``namespaced_block_hash``) and the recorder coalesces pages.  So
kvcore's pages are handed to SGLang's ``KVCacheEventRecorder`` itself, each as a one-page
node of a shadow chain (:class:`_PageNode`: the fields the recorder reads of a tree node),
and every hash, name and coalescing rule is SGLang's.
"""

from __future__ import annotations

from array import array
from typing import Any

from sglang.srt.mem_cache.events import KVCacheEventRecorder  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.radix_cache import RadixKey  # type: ignore[import-not-found,unused-ignore]

from kvcore.tree.events import AllPagesCleared, PageRemoved, PageStored
from kvcore_sglang.v0_5_23.version import SGLANG_VERSION

__all__ = ["EventTranslator"]


class _PageNode:
    """One kvcore page as SGLang's recorder reads a tree node (``key``, ``parent``, its hash fields)."""

    __slots__ = ("key", "parent", "hash_value", "event_hash_value")

    def __init__(self, key: Any, parent: Any, hash_value: Any = None):
        self.key = key
        self.parent = parent
        self.hash_value = hash_value
        self.event_hash_value = None


def _split(namespace: Any) -> tuple[str | None, str | None]:
    """SGLang's ``(extra_key, cache_salt)`` of a kvcore namespace (``kvcore_sglang.common.fill_ids.namespace``)."""
    return namespace if isinstance(namespace, tuple) else (namespace, None)


class EventTranslator:
    """kvcore's ``PageStored`` / ``PageRemoved`` / ``AllPagesCleared`` fed to SGLang's recorder of ``params``."""

    def __init__(self, params: Any, *, enabled: bool):
        self.recorder = KVCacheEventRecorder(
            enabled=enabled, page_size=int(params.page_size), dynamo_format=bool(params.dynamo_kv_event_format),
            lora_names=params.kv_event_lora_names,
        )
        self._root = _PageNode(RadixKey(array("q")), None, [])
        self._pages: dict[str, _PageNode] = {}

    def feed(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, PageStored):
                parent = self._root if ev.parent_hash is None else self._pages[ev.parent_hash]
                extra_key, salt = _split(ev.extra_key)
                page = _PageNode(RadixKey(array("q", ev.token_ids), extra_key, cache_salt=salt), parent)
                self._pages[ev.page_hash] = page
                self.recorder.record_store(page)
            elif isinstance(ev, PageRemoved):
                self.recorder.record_remove(self._pages.pop(ev.page_hash))
            elif isinstance(ev, AllPagesCleared):
                self._pages.clear()
                self.recorder.record_all_cleared()
            else:
                raise TypeError(f"kvcore event {ev!r} has no SGLang {SGLANG_VERSION} counterpart")

    def take(self) -> list:
        return self.recorder.take()

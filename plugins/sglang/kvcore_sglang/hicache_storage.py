"""kvcore's KV stores as an SGLang HiCache L3 backend: ``--hicache-storage-backend dynamic``.

SGLang 0.5.19's ``StorageBackendFactory`` loads a ``dynamic`` backend by module
and class name from ``--hicache-storage-backend-extra-config`` and builds it with
``(storage_config, kwargs)``; the cache controller then registers its host pool
(``register_mem_pool_host``) and calls, from its prefetch and backup threads,
``batch_exists`` and either ``batch_get_v1``/``batch_set_v1`` (``"interface_v1": 1``
in the extra config: pages go straight between the store and the host pool) or
the legacy ``batch_get``/``batch_set`` of flat page tensors.
:data:`kvcore_sglang.plugin.HICACHE_BACKEND` holds the three names; the extra
config adds ``store_url`` (any ``kvcore.open_store`` URL: ``memory://``,
``file:///dir``, ``redis://host:port/0``, ``redis+cluster://host:port,...``).

The failure rule is kvcore's: SGLang's storage threads die on the first
exception a backend raises, so no method here raises once the backend is built.
A store that is down, slow, full or holds a bad value answers a miss (``False``,
``None``, a shorter ``batch_exists``), counted in :meth:`stats`, and SGLang
recomputes.  Only a bad configuration raises, when SGLang builds the backend.

Keys are SGLang's page hashes under a namespace (``kvcore:sglang:<digest>:``) of
the model name, the rank that holds the page (the tensor-parallel rank unless the
pool is replicated, as MLA's is; the pipeline and context-parallel ranks), and
the host pool's layout, dtype, page size and page bytes: engines of one model and
layout share pages, anything else never sees them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvcore.stores import KVStore, open_store

__all__ = ["STORE_URL_ENV", "KvcoreHiCacheStorage"]

_log = logging.getLogger(__name__)

#: Where the store URL comes from when the extra config has no ``store_url``.
STORE_URL_ENV = "KVCORE_HICACHE_STORE_URL"


def _rank_part(config: HiCacheStorageConfig) -> str:
    # A replicated pool (MLA) holds the same page on every TP rank: one copy serves all, as HiCacheFile does.
    part = "" if config.is_mla_model else f"tp{config.tp_rank}of{config.tp_size}"
    if config.pp_size > 1:
        part += f":pp{config.pp_rank}of{config.pp_size}"
    if config.attn_cp_size > 1:
        part += f":cp{config.attn_cp_rank}of{config.attn_cp_size}"
    return part


class KvcoreHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """An SGLang ``HiCacheStorage`` over a kvcore store (see the module doc); never raises after ``__init__``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = storage_config.extra_config or {}
        url = extra.get("store_url") or os.environ.get(STORE_URL_ENV)
        if not url or not isinstance(url, str):
            raise ValueError('kvcore HiCache storage needs a store URL: "store_url" in '
                             f"--hicache-storage-backend-extra-config (or ${STORE_URL_ENV}), e.g. redis://host:6379/0")
        if storage_config.should_split_heads:
            raise ValueError("kvcore HiCache storage does not split heads across TP sizes (tp_lcm_size): "
                             "drop tp_lcm_size from --hicache-storage-backend-extra-config")
        self.config = storage_config
        self.store: KVStore = open_store(url)  # a bad URL raises here, at startup; I/O never raises
        self._model = storage_config.model_name or ""
        self._ranks = _rank_part(storage_config)
        # Set by register_mem_pool_host: until then there is no page shape, and every call is a miss.
        self._prefix: str | None = None
        self._page_size = 1
        self._page_bytes = 0
        self._dtype: torch.dtype = torch.uint8
        self._warned: set[str] = set()

    # -- the host pool: the page shape and the key namespace ----------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        try:
            page = mem_pool_host.get_dummy_flat_data_page()
            self._page_size = int(mem_pool_host.page_size)
            self._dtype = page.dtype
            self._page_bytes = page.numel() * page.element_size()
            text = "\x00".join([self._model, self._ranks, str(mem_pool_host.layout), str(self._dtype),
                                str(self._page_size),
                                str(self._page_bytes)])
            self._prefix = "kvcore:sglang:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:24] + ":"
        except Exception as exc:  # a pool of a kind this adapter cannot read: every call stays a miss
            self._failed("register_mem_pool_host", exc)
            self._prefix = None

    def namespace(self) -> str | None:
        """The key prefix of this backend's pages (None before a host pool is registered)."""
        return self._prefix

    def _keys(self, keys: list[str]) -> list[str]:
        prefix = self._prefix
        assert prefix is not None
        return [prefix + str(k) for k in keys]

    # -- page bytes ------------------------------------------------------------------

    def _to_bytes(self, page: torch.Tensor) -> bytes:
        return page.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def _page(self, data: bytes | None) -> torch.Tensor | None:
        """A flat page of the host pool's dtype from a store value; None for a miss or a value of another shape."""
        if data is None or len(data) != self._page_bytes:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self._dtype)

    def _failed(self, what: str, exc: BaseException) -> None:
        # One warning per operation: a dead store must not flood SGLang's log from its storage threads.
        if what not in self._warned:
            self._warned.add(what)
            _log.warning("kvcore HiCache storage %s: %s failed (%s: %s); answering misses",
                         self.store.url, what, type(exc).__name__, exc)

    # -- the v1 interface (``"interface_v1": 1``): straight into the host pool ----------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self._prefix is None or not keys:
            return 0
        try:
            return self.store.batch_exists(self._keys(keys))
        except Exception as exc:
            self._failed("batch_exists", exc)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._prefix is None or not keys:
            return [False] * len(keys)
        try:
            values = self.store.batch_get(self._keys(keys))
            pool, ps = self.mem_pool_host, self._page_size
            out: list[bool] = []
            for i, data in enumerate(values):
                page = self._page(data)
                if page is not None:
                    pool.set_from_flat_data_page(int(host_indices[i * ps]), page)
                out.append(page is not None)
            return out
        except Exception as exc:
            self._failed("batch_get_v1", exc)
            return [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._prefix is None or not keys:
            return [False] * len(keys)
        try:
            pool, ps = self.mem_pool_host, self._page_size
            values = [self._to_bytes(pool.get_data_page(int(host_indices[i * ps]), flat=True))
                      for i in range(len(keys))]
            return self.store.batch_set(self._keys(keys), values)
        except Exception as exc:
            self._failed("batch_set_v1", exc)
            return [False] * len(keys)

    # -- the legacy interface: flat page tensors ---------------------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if self._prefix is None or not keys:
            return [None] * len(keys)
        try:
            values = self.store.batch_get(self._keys(keys))
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            out: list[torch.Tensor | None] = []
            for data, target in zip(values, targets, strict=True):
                page = self._page(data)
                if page is not None and target is not None:
                    if target.numel() * target.element_size() != self._page_bytes:
                        page = None  # a destination of another size: SGLang gets a miss, not a short copy
                    else:
                        target.view(-1).view(torch.uint8).copy_(page.view(torch.uint8))
                        page = target
                out.append(page)
            return out
        except Exception as exc:
            self._failed("batch_get", exc)
            return [None] * len(keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if self._prefix is None or not keys or values is None:
            return False
        try:
            data = [self._to_bytes(v) for v in values]
            if len(data) != len(keys):
                return False
            return all(self.store.batch_set(self._keys(keys), data))
        except Exception as exc:
            self._failed("batch_set", exc)
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return value is not None and self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- lifecycle and counters -----------------------------------------------------

    def clear(self) -> bool:
        """Drop every kvcore value the store's URL addresses (what HiCacheFile's ``clear`` does to its directory)."""
        try:
            return self.store.clear()
        except Exception as exc:
            self._failed("clear", exc)
            return False

    def close(self) -> None:
        """SGLang calls it when it detaches the backend."""
        try:
            self.store.close()
        except Exception as exc:
            self._failed("close", exc)

    def stats(self) -> dict[str, int]:
        """The store's counters: hits, misses, errors, bytes read and written, round trips."""
        return self.store.stats()

    def get_stats(self) -> None:
        # SGLang's storage metrics take its own StorageMetrics or None; kvcore's counters are in stats().
        return None

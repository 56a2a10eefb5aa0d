"""A tree backend with a host tier and a store under it, built as a subclass over its public protocol.

:func:`tiered` wraps a backend class's factory: with ``host_size`` or ``store``
set it builds ``Tiered<Backend>``, a subclass that changes four calls and
leaves the tree's internals alone:

- ``match_prefix``: after the device match, the rest of the key's whole pages
  are looked up in the host tier (contiguous from the first missing page), then
  in the store (one ``batch_exists`` and one ``batch_get``: two round trips per
  request at most).  What is found is copied into fresh device slots (the device
  tree evicts to make room, with the matched prefix locked meanwhile), inserted
  into the device tree, and the match is answered again.
- ``cache_finished_req`` / ``cache_unfinished_req``: before the tree takes the
  request's slots, the K/V bytes of its whole committed pages that the host tier
  lacks are copied to it, and queued for the store, as ``host_write_policy``
  says (SGLang HiCache's policies): ``write_through`` every such page,
  ``write_through_selective`` a page once ``host_write_threshold`` non-chunked
  calls cached it (SGLang counts a node's hits the same way, on insert).
- ``evicting``: under ``write_back`` the lifecycle calls only note which device
  page holds which store key (the tree's own slots, read back with a match after
  the tree took the request); the backend's ``evict`` reports the slots it is
  about to free (``BasePrefixCache.evicting``, a backend declaring
  ``Capability.EVICTION_REPORTS``), and their pages are copied to the host tier and queued
  for the store before they are freed.
- ``flush()``: sends the queued pages to the store in one ``batch_set``; the
  bench calls it at the end of each step, never on the match path.
- ``pools()`` / ``cached_sizes()`` / ``iter_owned_slots()`` add the ``host`` pool.

A page's bytes are ``(2 * layers, page_size, heads, head_dim)`` of the cache's
``kv_pool`` (K of every layer, then V), so a page read back is byte-identical
to the page written.  Store keys are :class:`kvcore.stores.StoreNamespace` keys:
the K/V shape, dtype, page size and ``store_layout`` name the namespace.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvcore.cache import BasePrefixCache, MatchResult, SlotOwner
from kvcore.capabilities import Capability
from kvcore.config import CacheInitParams
from kvcore.keys import RadixKey
from kvcore.pools import PoolView
from kvcore.record import floor_align
from kvcore.stores import KVStore, StoreNamespace, open_store
from kvcore.tiers.config import TieredCacheConfig
from kvcore.tiers.host import HostTier

__all__ = ["TierCounters", "TieredCacheMixin", "page_codec_layout", "tiered"]

# Store keys remembered as written when there is no host tier (so a page is not sent twice).
_WRITTEN_MEMORY = 1 << 16
# Bytes queued for the store before a write-through flushes by itself (bounds the queue's host memory
# when the engine does not call flush() every step).
_MAX_PENDING_BYTES = 64 << 20


def page_codec_layout(kv_pool: Any, name: str = "") -> str:
    """The namespace layout of ``kv_pool``'s pages: ``name:L<layers>:H<heads>:D<head_dim>``."""
    return f"{name}:L{kv_pool.layer_num}:H{kv_pool.head_num}:D{kv_pool.head_dim}"


@dataclass(slots=True)
class TierCounters:
    """Tokens the host tier and the store answered matches with (past the device tree), and what moved."""

    host_hit_tokens: int = 0
    store_hit_tokens: int = 0
    host_written_pages: int = 0
    written_back_pages: int = 0
    store_queued_pages: int = 0
    store_written_pages: int = 0
    store_failed_pages: int = 0
    loads_short_of_slots: int = 0
    bytes_host_to_device: int = 0
    bytes_device_to_host: int = 0


class TieredCacheMixin:
    """The calls a tiered backend changes; listed before the backend class in the bases (see :func:`tiered`)."""

    kv_pool: Any
    page_size: int
    token_to_kv_pool_allocator: Any
    disable: bool

    def _init_tiers(self, config: TieredCacheConfig) -> None:
        pool = self.kv_pool
        self._layers = int(pool.layer_num)
        self._page_elems = 2 * self._layers * self.page_size * int(pool.head_num) * int(pool.head_dim)
        self._dtype = pool.dtype
        self.page_bytes = self._page_elems * torch.empty((), dtype=pool.dtype).element_size()
        self.namespace = StoreNamespace(page_codec_layout(pool, config.store_layout), str(pool.dtype).removeprefix(
            "torch."), self.page_size)
        self.host: HostTier | None = HostTier(config.host_size, self.page_size, self.page_bytes) \
            if config.host_size else None
        self.store: KVStore | None = open_store(config.store) if config.store else None
        self.tier_counters = TierCounters()
        # A disabled tree caches nothing, so there is nothing to write through.
        self._tiers_off = config.disable
        self._resetting = False
        self._pending_keys: list[str] = []
        self._pending_values: list[bytes] = []
        self._written: OrderedDict[str, None] = OrderedDict()
        # write_through_selective: calls that cached each page not written yet (SGLang's node.hit_count).
        self._threshold = config.write_threshold()
        self._write_back = config.host_write_policy == "write_back"
        self._hits: OrderedDict[str, int] = OrderedDict()
        # write_back: the store key of each page the device tree holds, by the page's first slot (and back).
        self._key_at: dict[int, str] = {}
        self._page_of: dict[str, int] = {}

    # -- page bytes -------------------------------------------------------------

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The pages at device ``slots`` (page-aligned, whole pages) as ``(pages, page_bytes)`` uint8 on the CPU."""
        pool, ps = self.kv_pool, self.page_size
        n = slots.numel() // ps
        parts = [pool.get_key_buffer(i)[slots] for i in range(self._layers)]
        parts += [pool.get_value_buffer(i)[slots] for i in range(self._layers)]
        # (2L, n*ps, H, D) -> (n, 2L, ps, H, D): one row per page.
        stacked = torch.stack(parts).view(2 * self._layers, n, ps, *parts[0].shape[1:]).transpose(0, 1)
        return stacked.contiguous().view(n, -1).view(torch.uint8).cpu()

    def _scatter(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``(pages, page_bytes)`` uint8 rows into device ``slots``."""
        pool, ps = self.kv_pool, self.page_size
        n = slots.numel() // ps
        k0 = pool.get_key_buffer(0)
        shaped = pages.view(self._dtype).view(n, 2 * self._layers, ps, *k0.shape[1:]).transpose(0, 1)
        shaped = shaped.to(k0.device)
        for i in range(self._layers):
            pool.get_key_buffer(i)[slots] = shaped[i].reshape(n * ps, *k0.shape[1:])
            pool.get_value_buffer(i)[slots] = shaped[self._layers + i].reshape(n * ps, *k0.shape[1:])

    # -- match: device, then host, then store -----------------------------------------

    def match_prefix(self, key: Any, *args: Any, **kwargs: Any) -> MatchResult:
        m: MatchResult = super().match_prefix(key, *args, **kwargs)  # type: ignore[misc]
        rkey = key if isinstance(key, RadixKey) else RadixKey(key)
        ps = self.page_size
        whole = floor_align(len(rkey), ps)
        have = m.prefix_len
        if have >= whole:
            return m
        keys = self.namespace.page_keys(rkey.token_ids[:whole], rkey.extra_key)[have // ps:]
        loaded = self._load(rkey, m, keys)
        if not loaded:
            return m
        return super().match_prefix(key, *args, **kwargs)  # type: ignore[misc]

    def _load(self, rkey: RadixKey, m: MatchResult, keys: list[str]) -> int:
        """Copy the pages after the device match found in host, then store, into the device tree; pages loaded."""
        c = self.tier_counters
        n_host = self.host.contiguous_hits(keys) if self.host is not None else 0
        pages = [self.host.read(keys[:n_host])] if n_host and self.host is not None else []
        from_store: list[str] = []
        if self.store is not None and n_host < len(keys):
            rest = keys[n_host:]
            n_found = self.store.batch_exists(rest)
            if n_found:
                got = self.store.batch_get(rest[:n_found])
                good = []
                for value in got:
                    if value is None or len(value) != self.page_bytes:
                        break  # a miss, or a page of another layout: the prefix stops here
                    good.append(value)
                if good:
                    from_store = rest[: len(good)]
                    pages.append(torch.frombuffer(bytearray(b"".join(good)), dtype=torch.uint8).view(len(good), -1))
        n = n_host + len(from_store)
        if not n:
            return 0
        data = torch.cat(pages) if len(pages) > 1 else pages[0]
        lock = self.inc_lock_ref(m.last_device_node)  # type: ignore[attr-defined]
        try:
            slots = self._fresh_slots(n)
            if slots is None:
                c.loads_short_of_slots += 1
                return 0
            n_got = slots.numel() // self.page_size
            self._scatter(slots, data[:n_got])
            have = m.prefix_len
            new_len = have + slots.numel()
            loaded_key = RadixKey(rkey.token_ids[:new_len], rkey.extra_key)
            res = self.insert(loaded_key, torch.cat([m.device_indices, slots]))  # type: ignore[attr-defined]
            if res.prefix_len > have and not res.duplicates_freed:
                # Someone cached part of it meanwhile: the tree kept its own slots, these are ours to free.
                self.token_to_kv_pool_allocator.free(slots[: res.prefix_len - have])
            if self._write_back:
                self._note_tree_pages(loaded_key)
        finally:
            self.dec_lock_ref(m.last_device_node, lock)  # type: ignore[attr-defined]
        host_used = min(n_host, n_got)
        c.host_hit_tokens += host_used * self.page_size
        c.store_hit_tokens += (n_got - host_used) * self.page_size
        c.bytes_host_to_device += n_got * self.page_bytes
        if self.host is not None and n_got > host_used:
            self.host.write(from_store[: n_got - host_used], data[host_used:n_got])
        return n_got

    def _fresh_slots(self, pages: int) -> torch.Tensor | None:
        """Up to ``pages`` pages of device slots, evicting unlocked device pages to make room; None when none."""
        ps = self.page_size
        alloc = self.token_to_kv_pool_allocator
        self.make_room(pages * ps)  # type: ignore[attr-defined]
        pages = min(pages, alloc.available_size() // ps)
        return alloc.alloc(pages * ps) if pages else None

    # -- write policies: cached pages to host and store ---------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        on = is_insert and not self._tiers_off
        if on and not self._write_back:
            self._write_through(req, chunked=False)
        key = self._committed_key(req) if on and self._write_back else None
        super().cache_finished_req(req, is_insert)  # type: ignore[misc]
        if key is not None:
            self._note_tree_pages(key)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        # A prefill chunk's pages are computed too: under write_through a session turn that never finishes
        # still shares them (write_through_selective counts no hit for a chunk, as SGLang).
        on = not self._tiers_off
        if on and not self._write_back:
            self._write_through(req, chunked)
        key = self._committed_key(req) if on and self._write_back else None
        super().cache_unfinished_req(req, chunked)  # type: ignore[misc]
        if key is not None:
            self._note_tree_pages(key)

    def _committed_key(self, req: Any) -> RadixKey | None:
        """The whole committed pages of ``req`` as a key (None when there are none)."""
        aligned = floor_align(req.kv.kv_committed_len, self.page_size)
        return RadixKey(req.fill_ids[:aligned], req.extra_key) if aligned and not self.disable else None

    def _write_through(self, req: Any, chunked: bool) -> None:
        kv = req.kv
        aligned = floor_align(kv.kv_committed_len, self.page_size)
        if not aligned or kv.req_pool_idx is None:
            return
        if chunked and self._threshold > 1:
            return  # SGLang counts no hit for a chunked insert
        keys = self.namespace.page_keys(req.fill_ids[:aligned], req.extra_key)
        todo = [i for i, k in enumerate(keys) if not self._has_copy(k)]
        if self._threshold > 1:
            todo = [i for i in todo if self._hit(keys[i])]
        if not todo:
            return
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]  # type: ignore[attr-defined]
        ps = self.page_size
        slots = torch.cat([row[i * ps:(i + 1) * ps] for i in todo]).to(torch.int64)
        self._copy_out([keys[i] for i in todo], slots)

    def _has_copy(self, key: str) -> bool:
        """Whether the page under ``key`` is in the host tier (or, without one, was sent to the store)."""
        return key in self.host.pages if self.host is not None else key in self._written

    def _hit(self, key: str) -> bool:
        """Count one more caching of the page under ``key``; True when that reaches the write threshold."""
        n = self._hits.pop(key, 0) + 1
        if n >= self._threshold:
            return True
        self._hits[key] = n
        if len(self._hits) > _WRITTEN_MEMORY:
            self._hits.popitem(last=False)
        return False

    def _copy_out(self, keys: list[str], slots: torch.Tensor) -> None:
        """Copy the device pages at ``slots`` (whole pages, one per key) to the host tier and the store's queue."""
        pages = self._gather(slots)
        c = self.tier_counters
        c.bytes_device_to_host += pages.numel()
        if self.host is not None:
            new = self.host.write(keys, pages)
            c.host_written_pages += sum(new)
        if self.store is not None:
            for k, page in zip(keys, pages, strict=True):
                self._pending_keys.append(k)
                self._pending_values.append(page.numpy().tobytes())
                self._remember_written(k)
            c.store_queued_pages += len(keys)
            if len(self._pending_keys) * self.page_bytes >= _MAX_PENDING_BYTES:
                self.flush()

    # -- write-back: pages the device tree evicts ---------------------------------------

    def _note_tree_pages(self, key: RadixKey) -> None:
        """Note the store key of each device page the tree holds for ``key`` (write_back)."""
        m: MatchResult = super().match_prefix(key)  # type: ignore[misc]
        ps = self.page_size
        n = m.prefix_len // ps
        if not n:
            return
        firsts = m.device_indices[::ps].tolist()
        keys = self.namespace.page_keys(key.token_ids[: n * ps], key.extra_key)
        key_at, page_of = self._key_at, self._page_of
        for first, k in zip(firsts, keys, strict=True):
            old = page_of.get(k)
            if old is not None and old != first:
                key_at.pop(old, None)  # the tree holds a page once: that slot was freed meanwhile
            prev = key_at.get(first)
            if prev is not None and prev != k:
                page_of.pop(prev, None)
            key_at[first] = k
            page_of[k] = first

    def evicting(self, values: Sequence[torch.Tensor]) -> None:
        super().evicting(values)  # type: ignore[misc]
        if not self._write_back or not self._key_at:
            return
        ps = self.page_size
        keys: list[str] = []
        firsts: list[int] = []
        for v in values:
            for first in v[::ps].tolist():
                k = self._key_at.pop(first, None)
                if k is None:
                    continue  # a page that entered the tree by a plain insert: its key is not known here
                self._page_of.pop(k, None)
                if not self._has_copy(k):
                    keys.append(k)
                    firsts.append(first)
        if not keys:
            return
        base = torch.tensor(firsts, dtype=torch.int64)
        slots = (base[:, None] + torch.arange(ps, dtype=torch.int64)).reshape(-1)
        self.tier_counters.written_back_pages += len(keys)
        self._copy_out(keys, slots)

    def _remember_written(self, key: str) -> None:
        self._written[key] = None
        if len(self._written) > _WRITTEN_MEMORY:
            self._written.popitem(last=False)

    def flush(self) -> int:
        """Send the queued pages to the store in one batch; how many it accepted."""
        if self.store is None or not self._pending_keys:
            return 0
        keys, values = self._pending_keys, self._pending_values
        self._pending_keys, self._pending_values = [], []
        ok = self.store.batch_set(keys, values)
        accepted = sum(ok)
        self.tier_counters.store_written_pages += accepted
        self.tier_counters.store_failed_pages += len(ok) - accepted
        for k, good in zip(keys, ok, strict=True):
            if not good:
                self._written.pop(k, None)  # try again when the page finishes again
        return accepted

    # -- pools and counters -----------------------------------------------------------

    def pools(self) -> list[PoolView]:
        views: list[PoolView] = super().pools()  # type: ignore[misc]
        return views + [self.host.view()] if self.host is not None else views

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        sizes: dict[str, tuple[int, int]] = super().cached_sizes()  # type: ignore[misc]
        if self.host is not None:
            sizes = {**sizes, "host": (self.host.cached_tokens(), 0)}
        return sizes

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        yield from super().iter_owned_slots()  # type: ignore[misc]
        if self.host is not None and not self._resetting:
            yield from self.host.owned_slots()

    def tier_stats(self) -> dict[str, Any]:
        """The tier counters, and the store's own ``stats()`` under ``store``."""
        out: dict[str, Any] = asdict(self.tier_counters)
        if self.host is not None:
            out["host_cached_tokens"] = self.host.cached_tokens()
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def stats(self) -> dict[str, int]:
        base: dict[str, int] = super().stats()  # type: ignore[misc]
        return {**base, **{k: v for k, v in asdict(self.tier_counters).items() if v}}

    def reset(self) -> None:
        # A backend's reset may free every slot iter_owned_slots() yields: hide the host pool's meanwhile.
        self._resetting = True
        try:
            super().reset()  # type: ignore[misc]
        finally:
            self._resetting = False
        if self.host is not None:
            self.host.clear()
        self._pending_keys, self._pending_values = [], []
        self._key_at.clear()
        self._page_of.clear()

    def close(self) -> None:
        """Send what is queued, then close the store."""
        self.flush()
        if self.store is not None:
            self.store.close()


def tiered(backend: type[BasePrefixCache],
           check: Callable[[CacheInitParams], None] | None = None) -> Callable[[CacheInitParams], Any]:
    """A factory that builds ``backend``, or ``Tiered<backend>`` when the config asks for a tier.

    ``check(params)`` may refuse a tiered configuration the backend cannot serve
    (``ValueError`` with a message naming the option).
    """
    cls = type(f"Tiered{backend.__name__}", (TieredCacheMixin, backend), {"__module__": __name__})

    def factory(params: CacheInitParams) -> Any:
        config = params.config
        if not (isinstance(config, TieredCacheConfig) and config.tiers_enabled()):
            return backend(params)
        if check is not None:
            check(params)
        if params.kv_pool is None:
            raise ValueError("host_size and store need kv_buffer")
        cache = cls(params)
        # Declared per instance (a component set may or may not report): asked of the built cache.
        if config.host_write_policy == "write_back" and Capability.EVICTION_REPORTS not in cache.capabilities:
            raise ValueError(f"host_write_policy='write_back' needs a backend whose evict reports what it frees; "
                             f"{backend.__name__} does not (Capability.EVICTION_REPORTS)")
        cache._init_tiers(config)
        return cache

    factory.__doc__ = backend.__doc__
    factory.__qualname__ = f"tiered({backend.__qualname__})"
    return factory

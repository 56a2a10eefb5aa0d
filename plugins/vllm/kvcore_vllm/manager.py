"""The scheduler side: vLLM's ``OffloadingManager`` over kvcore's books, a host region and a kvcore store.

How a block becomes loadable (vLLM 0.32's offloading worker cannot report a
failed transfer: ``OffloadingConnectorWorker.get_finished`` asserts every
result's ``success``, so a load vLLM has scheduled must succeed):

- It is offloaded by this engine: ``prepare_store`` reserves a host slot
  (pinned), the worker copies the block there and writes it to the store, and
  ``complete_store`` makes it readable.
- It is in the store: ``lookup`` answers ``RETRY`` for a block the host tier
  lacks, and queues it; at the end of the scheduler step the queued blocks of
  every request are read in one ``batch_get`` on a background thread (one round
  trip, never one per block); the scheduler waits for it at most ``read_wait_ms``.  When the read is
  back, each value whose frame holds (kvcore's length and checksum, checked by
  the store) and whose length is one block is copied into a host slot and
  becomes readable; the others are misses.  The request's next lookup answers
  ``HIT`` or ``MISS``.

So a value that is absent, corrupted, foreign (another model's key) or unreachable
is a miss before vLLM schedules anything, and vLLM computes the block itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found,unused-ignore]
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found,unused-ignore]

from kvcore.stores import KVStore
from kvcore_vllm.books import HostBooks
from kvcore_vllm.region import HostRegion

__all__ = ["KvcoreLoadStoreSpec", "KvcoreOffloadingManager", "ManagerCounters"]

log = logging.getLogger("kvcore_vllm")


class KvcoreLoadStoreSpec(LoadStoreSpec):
    """Host slots of the blocks of one transfer, and (stores only) their store keys, for the worker."""

    def __init__(self, slots: list[int], store_keys: list[str] | None = None) -> None:
        self.slots = slots
        self.store_keys = store_keys

    def __repr__(self) -> str:
        return f"KvcoreLoadStoreSpec(slots={self.slots}, store={self.store_keys is not None})"


@dataclass(slots=True)
class ManagerCounters:
    """What the manager did: lookups by answer, blocks read from the store, loads and stores."""

    lookups: int = 0
    host_hits: int = 0
    retries: int = 0
    misses: int = 0
    store_reads: int = 0
    store_blocks_asked: int = 0
    store_blocks_found: int = 0
    store_blocks_bad: int = 0
    store_blocks_dropped: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    store_bytes_found: int = 0
    store_read_s: float = 0.0


@dataclass(slots=True)
class _RequestFetches:
    """Blocks this request already asked the store for: a second lookup of one that did not come is a miss."""

    owner: object
    asked: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class _Fetch:
    keys: list[bytes]
    future: Future[list[bytes | bytearray | memoryview | None]]


class KvcoreOffloadingManager(OffloadingManager):
    """See the module doc.  ``store_key(key)`` names a block in the store (None: no store)."""

    def __init__(
        self,
        books: HostBooks,
        region: Callable[[], HostRegion],
        store: KVStore | None,
        store_key: Callable[[bytes], str],
        *,
        write_to_store: bool = True,
        max_fetch_blocks: int = 4096,
        read_wait_ms: float = 0.0,
        verify_values: bool = True,
        enable_events: bool = False,
    ) -> None:
        self.books = books
        # Opened now, while the worker (built first by vLLM) holds the same file open.
        self._region: HostRegion | None = region()
        self.store = store
        self.store_key = store_key
        self.write_to_store = write_to_store
        self.max_fetch_blocks = max_fetch_blocks
        self.read_wait_s = read_wait_ms / 1e3
        self.verify_values = verify_values
        self.enable_events = enable_events
        self.counters = ManagerCounters()
        self._want: dict[bytes, None] = {}
        self._fetching: set[bytes] = set()
        self._fetches: list[_Fetch] = []
        self._pool: ThreadPoolExecutor | None = None

    @property
    def region(self) -> HostRegion:
        if self._region is None:
            raise RuntimeError("the kvcore-vllm manager was shut down")
        return self._region

    # -- lookups --------------------------------------------------------------

    def _request(self, ctx: ReqContext) -> _RequestFetches:
        st = ctx.get_state(_RequestFetches)
        if st is None or st.owner is not self:
            st = _RequestFetches(owner=self)
            ctx.set_state(st)
        return st

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain()
        self.counters.lookups += 1
        e = self.books.get(key)
        if e is not None:
            if e.ready:
                self.counters.host_hits += 1
                return LookupResult.HIT
            return LookupResult.HIT_PENDING
        if self.store is None:
            self.counters.misses += 1
            return LookupResult.MISS
        st = self._request(req_context)
        if key in self._want or key in self._fetching:
            st.asked.add(key)
            self.counters.retries += 1
            return LookupResult.RETRY
        if key in st.asked or len(self._want) >= self.max_fetch_blocks:
            self.counters.misses += 1
            return LookupResult.MISS
        st.asked.add(key)
        self._want[key] = None
        self.counters.retries += 1
        return LookupResult.RETRY

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request(req_context)
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        self._drain()
        if not self._want or self.store is None:
            return
        keys = list(self._want)
        self._want.clear()
        self._fetching.update(keys)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcore-vllm-fetch")
        names = [self.store_key(k) for k in keys]
        self.counters.store_reads += 1
        self.counters.store_blocks_asked += len(keys)
        fetch = _Fetch(keys, self._pool.submit(self._read, names))
        self._fetches.append(fetch)
        if self.read_wait_s > 0:
            # Waiting here releases the GIL to the read (the engine's busy loop would otherwise share it with the
            # read thread in 5 ms slices); a read back in time is installed now and hits at the next step.
            wait([fetch.future], timeout=self.read_wait_s)
            self._drain()

    def has_pending_work(self) -> bool:
        return bool(self._want or self._fetches)

    def _read(self, names: list[str]) -> list[bytes | bytearray | memoryview | None]:
        """The background read: payloads, None for a miss.  Never raises (the store answers misses)."""
        store = self.store
        assert store is not None
        t0 = time.perf_counter()
        try:
            if self.verify_values:
                # Views of the frames: the one copy is into the host row.
                return list(store.batch_get_views(names))
            # Test-only: the payload after the frame header, its checksum unchecked.
            return list(store.batch_get_unchecked(names))
        finally:
            self.counters.store_read_s += time.perf_counter() - t0

    def _drain(self) -> None:
        """Install the reads that are back: checked values into host slots, the rest are misses."""
        if not self._fetches:
            return
        done = [f for f in self._fetches if f.future.done()]
        if not done:
            return
        self._fetches = [f for f in self._fetches if not f.future.done()]
        row = self.region.row_bytes
        for f in done:
            try:
                payloads = f.future.result()
            except Exception as exc:  # a store's bug must not reach the engine: its blocks are misses
                log.warning("kvcore-vllm: store read failed (%s: %s); answering misses", type(exc).__name__, exc)
                payloads = [None] * len(f.keys)
            self._fetching.difference_update(f.keys)
            good = [(k, p) for k, p in zip(f.keys, payloads, strict=True)
                    if p is not None and len(p) == row and self.books.get(k) is None]
            bad = sum(1 for p in payloads if p is not None and len(p) != row)
            self.counters.store_blocks_bad += bad
            if not good:
                continue
            keys = [k for k, _ in good]
            got = self.books.reserve(keys)
            if got is None:
                # No room even after evicting every idle block: keep what fits.
                n = self.books.allocator.available_size() + sum(
                    1 for e in self.books.entries.values() if e.ready and e.pins == 0)
                self.counters.store_blocks_dropped += len(good) - n
                good = good[:n]
                keys = keys[:n]
                got = self.books.reserve(keys) if keys else ([], [])
                assert got is not None
            slots, _ = got
            rows = self.region.data.numpy()
            for (_, payload), slot in zip(good, slots, strict=True):
                rows[slot] = np.frombuffer(payload, dtype=np.uint8)
            self.books.commit(keys)
            self.counters.store_blocks_found += len(keys)
            self.counters.store_bytes_found += len(keys) * row

    # -- loads ------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        slots = self.books.pin_for_load(keys)
        self.counters.blocks_loaded += len(keys)
        return KvcoreLoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.books.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.books.unpin(keys)

    # -- stores -----------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        new = [k for k in dict.fromkeys(keys) if self.books.get(k) is None]
        got = self.books.reserve(new, protected=set(keys))
        if got is None:
            return None
        slots, evicted = got
        names = [self.store_key(k) for k in new] if (self.store is not None and self.write_to_store) else None
        self.counters.blocks_stored += len(new)
        return PrepareStoreOutput(keys_to_store=list(new), store_spec=KvcoreLoadStoreSpec(slots, names),
                                  evicted_keys=[OffloadKey(k) for k in evicted])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        if success:
            self.books.commit(keys)
        else:
            self.books.abort(keys)

    # -- the rest of the contract -------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.books.take_events()
        if not self.enable_events:
            return ()
        return [OffloadingEvent(keys=[OffloadKey(k) for k in ev.keys], medium=Medium.CPU, removed=ev.removed)
                for ev in events if ev.keys]

    def reset_cache(self) -> None:
        self.books.clear()

    def stats(self) -> dict[str, Any]:
        from dataclasses import asdict

        out: dict[str, Any] = asdict(self.counters)
        out["host"] = self.books.stats()
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._fetches.clear()
        if self.store is not None:
            self.store.close()
        if self._region is not None:
            self._region.close()
            self._region = None

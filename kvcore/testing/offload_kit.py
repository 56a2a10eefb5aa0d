"""The conformance kit of an offload tier's manager: the scheduler-side books of blocks kept below an engine.

An engine's offloading seam (vLLM's ``OffloadingManager``, SGLang's HiCache
controller) asks a manager whether a block is offloaded, pins blocks while they
load, reserves room for blocks being stored, evicts under pressure and reads a
shared store.  The kit drives one through a thin adapter, so any tier is checked
the same way without this package importing an engine::

    from kvcore.testing.offload_kit import OffloadManagerConformance


    class TestMyTier(OffloadManagerConformance):
        def make_driver(self, capacity, tmp_path):
            return MyDriver(capacity, tmp_path)  # an OffloadDriver

Scenarios: lookups of unknown, stored, in-flight and evicted blocks; a store that
fails is dropped; pinned and in-flight blocks are never evicted and a store that
finds no room changes nothing; eviction under pressure keeps the capacity and
follows recency; blocks another engine put in the shared store are found after
one batched read; corrupted values and a store that went away are misses, never
exceptions.  ``driver.check()`` (kvcore's InvariantChecker, for a tier that keeps
its books in a kvcore pool) runs after every scenario.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol

import pytest

__all__ = ["LookupAnswer", "OffloadDriver", "OffloadManagerConformance", "block_keys"]

#: ``hit``: readable now; ``pending``: present, not readable yet (being stored); ``retry``: not known yet
#: (a store read was queued: ask again after ``settle()``); ``miss``: not there.
LookupAnswer = Literal["hit", "pending", "retry", "miss"]


def block_keys(n: int, tag: str = "") -> list[bytes]:
    """``n`` distinct block keys (32 bytes each, like a sha256 block hash)."""
    base = f"{tag}{os.getpid()}".encode()
    return [(base + b":" + str(i).encode()).ljust(32, b".") for i in range(n)]


class OffloadDriver(Protocol):
    """The adapter a tier supplies: the manager's calls in the kit's words."""

    capacity: int
    has_store: bool

    def lookup(self, keys: Sequence[bytes]) -> list[LookupAnswer]:
        """One request's lookups, in order (a request looks its blocks up front to back)."""

    def settle(self) -> None:
        """End the engine's step and wait for the manager's background work (store reads) to be back."""

    def prepare_store(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]] | None:
        """(keys to store, keys evicted to make room), or None when there is no room."""

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None: ...

    def prepare_load(self, keys: Sequence[bytes]) -> None: ...

    def complete_load(self, keys: Sequence[bytes]) -> None: ...

    def write_store(self, keys: Sequence[bytes]) -> None:
        """Put whole values of ``keys`` in the shared store, as another engine would."""

    def corrupt_store(self, keys: Sequence[bytes]) -> None:
        """Replace the stored values of ``keys`` with garbage of the same length."""

    def break_store(self) -> None:
        """Make the store unreachable."""

    def store_round_trips(self) -> int: ...

    def check(self) -> None:
        """Raise unless the books are sound (kvcore's InvariantChecker)."""

    def close(self) -> None: ...


class OffloadManagerConformance:
    """Subclass with ``make_driver(capacity, tmp_path)``; ``has_store`` drivers run the store scenarios too."""

    capacity = 8

    def make_driver(self, capacity: int, tmp_path: Path) -> OffloadDriver:  # pragma: no cover - abstract
        raise NotImplementedError

    @pytest.fixture
    def driver(self, tmp_path: Path) -> Iterator[OffloadDriver]:
        d = self.make_driver(self.capacity, tmp_path)
        yield d
        d.check()
        d.close()

    @staticmethod
    def _store(d: OffloadDriver, keys: Sequence[bytes]) -> list[bytes]:
        out = d.prepare_store(keys)
        assert out is not None, f"no room to store {len(keys)} blocks"
        d.complete_store(out[0])
        return out[1]

    @staticmethod
    def _settled(d: OffloadDriver, keys: Sequence[bytes]) -> list[LookupAnswer]:
        first = d.lookup(keys)
        if "retry" not in first:
            return first
        d.settle()
        again = d.lookup(keys)
        assert "retry" not in again, f"still 'retry' after settle(): {again}"
        return again

    # -- lookups ---------------------------------------------------------------------

    def test_unknown_blocks_miss(self, driver: OffloadDriver) -> None:
        assert self._settled(driver, block_keys(3, "unknown")) == ["miss"] * 3

    def test_stored_blocks_hit_and_in_flight_ones_are_pending(self, driver: OffloadDriver) -> None:
        keys = block_keys(3, "stored")
        out = driver.prepare_store(keys)
        assert out is not None and list(out[0]) == keys and out[1] == []
        assert driver.lookup(keys) == ["pending"] * 3
        driver.check()
        driver.complete_store(keys)
        assert driver.lookup(keys) == ["hit"] * 3
        again = driver.prepare_store(keys)
        assert again is not None and again[0] == [], "a block held already is not stored twice"

    def test_failed_store_is_dropped(self, driver: OffloadDriver) -> None:
        keys = block_keys(2, "failed")
        assert driver.prepare_store(keys) is not None
        driver.complete_store(keys, success=False)
        driver.check()
        assert self._settled(driver, keys) == ["miss", "miss"]
        assert self._store(driver, block_keys(self.capacity, "refill")) == [], "the failed blocks' room came back"

    # -- pinning and eviction ------------------------------------------------------------

    def test_eviction_under_pressure_keeps_capacity_and_recency(self, driver: OffloadDriver) -> None:
        cap = self.capacity
        old = block_keys(cap, "old")
        assert self._store(driver, old) == []
        driver.lookup(old[cap // 2:])  # a lookup alone does not reorder; a load does
        driver.prepare_load(old[cap // 2:])
        driver.complete_load(old[cap // 2:])
        new = block_keys(cap // 2, "new")
        evicted = self._store(driver, new)
        assert sorted(evicted) == sorted(old[: cap // 2]), "the least recently used blocks go first"
        assert driver.lookup(new + old[cap // 2:]) == ["hit"] * cap
        assert set(self._settled(driver, old[: cap // 2])) == {"miss"}

    def test_pinned_and_in_flight_blocks_are_never_evicted(self, driver: OffloadDriver) -> None:
        cap = self.capacity
        loaded = block_keys(cap // 2, "loaded")
        assert self._store(driver, loaded) == []
        driver.prepare_load(loaded)
        storing = block_keys(cap - cap // 2, "storing")
        assert driver.prepare_store(storing) is not None
        driver.check()
        assert driver.prepare_store(block_keys(1, "nospace")) is None, "every block is pinned: no room"
        driver.check()
        assert driver.lookup(loaded) == ["hit"] * len(loaded)
        assert driver.lookup(storing) == ["pending"] * len(storing)
        driver.complete_load(loaded)
        driver.complete_store(storing)
        evicted = self._store(driver, block_keys(1, "room"))
        assert len(evicted) == 1 and evicted[0] in loaded + storing

    def test_a_store_larger_than_the_tier_is_refused_whole(self, driver: OffloadDriver) -> None:
        assert driver.prepare_store(block_keys(self.capacity + 1, "huge")) is None
        driver.check()
        assert self._store(driver, block_keys(self.capacity, "fits")) == []

    # -- the shared store ---------------------------------------------------------------

    def _need_store(self, d: OffloadDriver) -> None:
        if not d.has_store:
            pytest.skip("this tier has no shared store")

    def test_blocks_in_the_store_are_found_in_one_batched_read(self, driver: OffloadDriver) -> None:
        self._need_store(driver)
        keys = block_keys(self.capacity // 2, "shared")
        driver.write_store(keys)
        before = driver.store_round_trips()
        first = driver.lookup(keys)
        assert "hit" not in first, "a block read from the store is not readable before the read is back"
        assert self._settled(driver, keys) == ["hit"] * len(keys)
        assert driver.store_round_trips() - before == 1, "one round trip for the request's blocks"
        driver.prepare_load(keys)
        driver.complete_load(keys)

    def test_a_missing_block_ends_the_prefix(self, driver: OffloadDriver) -> None:
        self._need_store(driver)
        keys = block_keys(4, "gap")
        driver.write_store(keys[:2] + keys[3:])
        got = self._settled(driver, keys)
        assert got[:3] == ["hit", "hit", "miss"]

    def test_corrupted_values_are_misses(self, driver: OffloadDriver) -> None:
        self._need_store(driver)
        keys = block_keys(3, "corrupt")
        driver.write_store(keys)
        driver.corrupt_store(keys[1:2])
        assert self._settled(driver, keys)[:2] == ["hit", "miss"]

    def test_an_unreachable_store_is_a_miss_never_an_exception(self, driver: OffloadDriver) -> None:
        self._need_store(driver)
        keys = block_keys(3, "gone")
        driver.write_store(keys)
        driver.break_store()
        assert self._settled(driver, keys) == ["miss"] * 3
        assert self._store(driver, block_keys(2, "after")) == [], "the host tier still works"

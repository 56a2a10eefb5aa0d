"""The host tier's books: which block lives in which host slot, kept with kvcore's pool, policies and checker.

Slots come from a :class:`kvcore.TokenToKVPoolAllocator` (page size 1, one slot
per offloaded block; slot 0 is padding), exposed as the ``host`` pool so
:class:`kvcore.InvariantChecker` proves every slot is free or held by exactly
one block.  The eviction order is a policy from kvcore's registry
(:func:`kvcore.tree.policies.resolve_policy`): each entry carries the fields the
built-in policies read.  An entry is pinned while a load or a store of it is in
flight and is never evicted then.  Nothing here knows vLLM: keys are bytes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvcore.cache import SlotOwner
from kvcore.pools import PoolView, ReqToTokenPool, TokenToKVPoolAllocator
from kvcore.tree.policies import resolve_policy

__all__ = ["BookEvent", "HostBooks", "HostEntry"]

_NONE = torch.empty(0, dtype=torch.int64)


def _no_slots(kv: object) -> tuple[torch.Tensor, int]:
    return _NONE, 0


@dataclass(slots=True)
class HostEntry:
    """One block in the host tier.  ``ready``: its bytes are whole (stored, or read and checked);
    ``pins``: loads and stores in flight.  The last four fields are what kvcore's policies read."""

    slot: int
    ready: bool
    pins: int
    last_access_time: int
    creation_time: int
    hit_count: int = 0
    priority: int = 0


@dataclass(frozen=True, slots=True)
class BookEvent:
    """Blocks that became readable in the host tier (``removed=False``) or left it."""

    keys: tuple[bytes, ...]
    removed: bool


class HostBooks:
    """The books of ``num_blocks`` host slots (see the module doc)."""

    page_size = 1

    def __init__(self, num_blocks: int, eviction_policy: str = "lru", events: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got num_blocks={num_blocks!r}")
        self.num_blocks = num_blocks
        self.policy = resolve_policy(eviction_policy)
        self.allocator = TokenToKVPoolAllocator(num_blocks, page_size=1, device="cpu")
        # The invariant checker walks request rows; the host tier has none.
        self.req_to_token_pool = ReqToTokenPool(1, 1)
        self.entries: dict[bytes, HostEntry] = {}
        self._clock = itertools.count(1)
        # Off when nobody drains them (vLLM without KV events), so they cannot pile up.
        self.record_events = events
        self._events: list[BookEvent] = []
        self.evicted_blocks = 0

    # -- lookups --------------------------------------------------------------

    def get(self, key: bytes) -> HostEntry | None:
        return self.entries.get(key)

    def ready(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e.ready

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            e = self.entries.get(k)
            if e is not None:
                e.last_access_time = next(self._clock)

    # -- loads: pin while in flight ------------------------------------------

    def pin_for_load(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of ``keys`` (all ready), each pinned until :meth:`unpin`."""
        missing = [k for k in keys if not self.ready(k)]
        if missing:
            raise KeyError(f"{len(missing)} of {len(keys)} blocks asked to load are not ready in the host tier")
        slots = []
        now = next(self._clock)
        for k in keys:
            e = self.entries[k]
            e.pins += 1
            e.hit_count += 1
            e.last_access_time = now
            slots.append(e.slot)
        return slots

    def unpin(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.pins > 0:
                e.pins -= 1

    # -- stores: reserve (pinned, not ready), then commit or abort ----------

    def reserve(self, keys: Sequence[bytes], protected: Collection[bytes] = ()) -> tuple[list[int], list[bytes]] | None:
        """Slots for new ``keys`` (none may be held yet), evicting unpinned ready blocks by the policy
        (never one of ``protected``).  Returns (slots, evicted keys), or None with nothing changed
        when there is no room."""
        if not keys:
            return [], []
        if len(set(keys)) != len(keys) or any(k in self.entries for k in keys):
            raise ValueError("reserve() takes distinct keys that the host tier does not hold")
        short = len(keys) - self.allocator.available_size()
        evicted: list[bytes] = []
        if short > 0:
            victims = self._victims(short, protected)
            if victims is None:
                return None
            evicted = self._remove(victims)
        slots_t = self.allocator.alloc(len(keys))
        assert slots_t is not None, "the allocator had room after eviction"
        slots = slots_t.tolist()
        now = next(self._clock)
        for k, s in zip(keys, slots, strict=True):
            self.entries[k] = HostEntry(slot=s, ready=False, pins=1, last_access_time=now, creation_time=now)
        return slots, evicted

    def commit(self, keys: Iterable[bytes]) -> list[bytes]:
        """Reserved blocks whose bytes are now whole become readable; returns those keys."""
        done = []
        for k in keys:
            e = self.entries.get(k)
            if e is not None and not e.ready:
                e.ready = True
                e.pins -= 1
                done.append(k)
        if done and self.record_events:
            self._events.append(BookEvent(tuple(done), removed=False))
        return done

    def abort(self, keys: Iterable[bytes]) -> None:
        """Reserved blocks whose bytes never came: their slots go back."""
        drop = [k for k in keys if (e := self.entries.get(k)) is not None and not e.ready]
        if drop:
            self.allocator.free(torch.tensor([self.entries.pop(k).slot for k in drop], dtype=torch.int64))

    def clear(self) -> None:
        """Forget every block (vLLM's reset_cache: it guarantees no transfer of the old ones completes)."""
        if self.entries:
            if self.record_events:
                self._events.append(BookEvent(tuple(k for k, e in self.entries.items() if e.ready), removed=True))
            self.allocator.free(torch.tensor([e.slot for e in self.entries.values()], dtype=torch.int64))
            self.entries.clear()

    def take_events(self) -> list[BookEvent]:
        out, self._events = self._events, []
        return out

    # -- eviction -------------------------------------------------------------

    def _victims(self, n: int, protected: Collection[bytes]) -> list[bytes] | None:
        prot = protected if isinstance(protected, set | frozenset | dict) else set(protected)
        cands = [(k, e) for k, e in self.entries.items() if e.ready and e.pins == 0 and k not in prot]
        if len(cands) < n:
            return None
        prio = self.policy.get_priority
        if self.policy.newest_first:
            chosen = heapq.nsmallest(n, cands, key=lambda ke: (prio(ke[1]), -ke[1].creation_time))
        else:
            chosen = heapq.nsmallest(n, cands, key=lambda ke: (prio(ke[1]), ke[1].creation_time))
        return [k for k, _ in chosen]

    def _remove(self, keys: list[bytes]) -> list[bytes]:
        slots = [self.entries.pop(k).slot for k in keys]
        self.allocator.free(torch.tensor(slots, dtype=torch.int64))
        self.evicted_blocks += len(keys)
        if self.record_events:
            self._events.append(BookEvent(tuple(keys), removed=True))
        return keys

    def evict(self, n: int) -> list[bytes]:
        """Evict up to ``n`` unpinned ready blocks by the policy; returns their keys."""
        cands = sum(1 for e in self.entries.values() if e.ready and e.pins == 0)
        victims = self._victims(min(n, cands), ())
        return self._remove(victims) if victims else []

    # -- what kvcore's InvariantChecker reads ------------------------------------

    def pools(self) -> list[PoolView]:
        return [PoolView("host", self.allocator, record_slots=_no_slots)]

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        evictable = sum(1 for e in self.entries.values() if e.pins == 0)
        return {"host": (evictable, len(self.entries) - evictable)}

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        for k, e in self.entries.items():
            yield SlotOwner("host", f"host block {k.hex()[:16]}", torch.tensor([e.slot], dtype=torch.int64))

    def session_slots(self) -> list[object]:
        return []

    def sanity_check(self) -> None:
        slots = [e.slot for e in self.entries.values()]
        assert len(set(slots)) == len(slots), "two host blocks share a slot"
        assert all(e.pins >= 0 for e in self.entries.values()), "a host block has negative pins"
        assert all(e.pins >= 1 for e in self.entries.values() if not e.ready), "a reserved block is not pinned"

    def stats(self) -> dict[str, int]:
        pinned = sum(1 for e in self.entries.values() if e.pins)
        return {"blocks": len(self.entries), "capacity": self.num_blocks, "pinned": pinned,
                "evicted": self.evicted_blocks}

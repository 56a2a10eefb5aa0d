"""The ``swa`` tree component (SGLang's SWAComponent): sliding-window slots on the core's one tree.

Window values may be tombstoned; a lock holds the window only as far as the window
reaches; eviction keeps its own window LRU.  See :mod:`kvcore.components` for the
contract every component follows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvcore.cache import LockResult, SlotOwner
from kvcore.capabilities import Capability
from kvcore.tree.node import iter_subtree
from kvcore.tree.value_component import LRUValueComponent
from kvcore_swa.config import check_window, check_window_pool

if TYPE_CHECKING:
    from kvcore.pool_builder import Placement
    from kvcore.tree.unified import InsertArgs, UnifiedRadixCache

__all__ = ["SWAComponent", "SWAOptions"]


class SWAOptions(BaseModel):
    """Options of the ``swa`` component: the window and the window pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sliding_window_size: int = Field(1024, strict=True, description="attention window W in tokens")
    swa_size: int | None = Field(None, strict=True, description="window-pool token slots (default: size)")

    @field_validator("sliding_window_size")
    @classmethod
    def _check_window(cls, value: int) -> int:
        return check_window(value)


class SWAComponent(LRUValueComponent):
    """Sliding-window slots: tombstones, window locks, window-only recency (SGLang's SWAComponent)."""

    name = "swa"
    pool = "swa"
    internal_priority = 1
    options = SWAOptions
    capabilities = frozenset({Capability.WINDOWED, Capability.WINDOW_LOCK_RELEASE})
    lru_label = "window LRU"
    node_fields = {"swa_value": None, "swa_lock_ref": 0, "swa_uuid": None, "swa_prev": None, "swa_next": None}
    cache: UnifiedRadixCache

    # -- config hooks ------------------------------------------------------------------
    @staticmethod
    def check_options(config: Any, opts: SWAOptions) -> None:
        swa = config.size if opts.swa_size is None else opts.swa_size
        check_window_pool(swa, opts.sliding_window_size, config.page_size)

    @staticmethod
    def build_allocator(config: Any, opts: SWAOptions, at: Placement) -> Any:
        from kvcore.pools import SWATokenToKVPoolAllocator

        swa = config.size if opts.swa_size is None else opts.swa_size
        return SWATokenToKVPoolAllocator(config.size, swa, config.page_size, at.torch_device)

    def __init__(self, cache: Any, options: BaseModel | None) -> None:
        super().__init__(cache, options)
        opts = options if isinstance(options, SWAOptions) else SWAOptions.model_validate({})
        self.window = int(opts.sliding_window_size)
        alloc = cache.token_to_kv_pool_allocator
        # What the allocator declares about its pools (a window pool), not its class: kvcore's own
        # SWATokenToKVPoolAllocator and a view of SGLang's (kvcore-sglang) both declare one.
        if not any(view.windowed for view in alloc.pool_views()):
            raise TypeError(f"the swa component needs an SWATokenToKVPoolAllocator (full and window pools), "
                            f"got {type(alloc).__name__}, whose pools have no window")
        self.alloc = alloc
        self._uuids = itertools.count(1)

    def cache_attrs(self) -> dict[str, Any]:
        return {**super().cache_attrs(), "sliding_window_size": self.window}

    # -- per node ----------------------------------------------------------------------
    def has_value(self, node: Any) -> bool:
        return node.swa_value is not None

    def value_len(self, node: Any) -> int:
        return 0 if node.swa_value is None else len(node.swa_value)

    def lock_ref(self, node: Any) -> int:
        return node.swa_lock_ref

    def owned_slots(self, node: Any) -> Iterator[SlotOwner]:
        yield SlotOwner("swa", f"tree node {node.id} ({len(node.key)} tokens)", node.swa_value)

    def free_value(self, node: Any) -> int:
        """Tombstone ``node``: its window slots go back (its full slots stay)."""
        self.alloc.free_swa(node.value)
        return self.forget_value(node)

    def on_split(self, upper: Any, child: Any) -> None:
        has = child.swa_value is not None
        upper.swa_lock_ref = child.swa_lock_ref
        if has:
            k = len(upper.key)
            upper.swa_value = child.swa_value[:k]
            child.swa_value = child.swa_value[k:]
        else:
            upper.swa_value = None
        upper.swa_uuid = child.swa_uuid
        child.swa_uuid = None
        if has:
            self.requeue_split(upper, child)

    # -- match -------------------------------------------------------------------------
    def validator(self) -> Callable[[Any], bool]:
        window = self.window
        state = [float("inf")]

        def valid(node: Any) -> bool:
            if node.swa_value is None:
                state[0] = 0
                return False
            state[0] += len(node.key)
            return state[0] >= window

        return valid

    def _touch_window(self, node: Any) -> None:
        """SGLang's reset_node_and_window_ancestors_mru: the last W + page tokens of the path, deepest first."""
        # The nodes with a window value are exactly the ones in the window LRU.
        self.lru.touch_path(node, self.cache.root_node, self.window + self.cache.page_size)

    def after_match(self, node: Any) -> None:
        self._touch_window(node)

    def after_insert(self, node: Any) -> None:
        self._touch_window(node)

    # -- insert ------------------------------------------------------------------------
    def prepare_insert(self, req: Any, ins: InsertArgs, finished: bool) -> int | None:
        kv = req.kv
        ins.swa_evicted_seqlen = kv.swa_evicted_seqlen
        # Window slots the record says are gone but may still be mapped (a floor jump).
        lo = kv.cache_protected_len
        hi = min(kv.swa_evicted_seqlen, kv.kv_committed_len, kv.swa_dead_lo(self.cache.page_size))
        if hi > lo:
            self.alloc.free_swa(self.cache.row(kv)[lo:hi].to(torch.int64))
        return None

    def before_insert(self, value: Any, ins: Any) -> None:
        """A direct insert: the window slots below ``swa_evicted_seqlen`` are gone; make sure they are."""
        prev, sev = ins.prev_prefix_len, ins.swa_evicted_seqlen
        if sev > prev:
            part = value[prev : min(sev, value.numel())]
            if part.numel():
                self.alloc.free_swa(part)

    def _recover_locked(self, node: Any, kept: torch.Tensor, incoming: torch.Tensor) -> None:
        """A tombstone whose full slots a request reads: keep them, map them onto the incoming window slots."""
        alloc = self.alloc
        swa = alloc.translate_loc_from_full_to_swa(incoming)
        mapping = alloc.full_to_swa_index_mapping
        mapping[kept] = swa
        mapping[incoming] = 0
        # After the walk's duplicates so far, as SGLang applies its deferred actions in order.
        self.cache.flush_duplicates()
        alloc.free_full(incoming)
        self.set_value(node, swa)

    def on_insert_overlap(self, node: Any, prefix_len: int, total_prefix_len: int, value_slice: Any,
                          ins: InsertArgs) -> int:
        if ins.prev_prefix_len >= total_prefix_len + prefix_len or node.swa_value is not None:
            return prefix_len
        sev = ins.swa_evicted_seqlen
        cache = self.cache
        if sev <= total_prefix_len:
            if node.lock_ref > 0:
                self._recover_locked(node, node.value, value_slice)
                return 0
            cache.replace_full(node, value_slice)
            self.set_value(node, self.alloc.translate_loc_from_full_to_swa(node.value))
            return 0
        if sev < total_prefix_len + prefix_len:
            start = sev - total_prefix_len
            locked = node.lock_ref > 0
            cache.split(node, start)
            new_full = value_slice[start:]
            if locked:
                self._recover_locked(node, node.value, new_full)
                return start
            cache.replace_full(node, new_full)
            self.set_value(node, self.alloc.translate_loc_from_full_to_swa(node.value))
            return start
        return prefix_len

    def on_insert_commit(self, node: Any, is_new_leaf: bool, ins: InsertArgs) -> None:
        if not is_new_leaf:
            return
        split_pos = ins.swa_evicted_seqlen - ins.prefix_len
        if split_pos >= len(node.key):
            return  # wholly outside the window: the leaf lives on its full value alone
        cache = self.cache
        if split_pos > 0:
            cache.split(node, split_pos)
        capped = self._cap_leaf(node)
        translate = self.alloc.translate_loc_from_full_to_swa
        if capped is not None:
            self.set_value(capped, translate(capped.value))
        self.set_value(node, translate(node.value))

    def _cap_leaf(self, leaf: Any) -> Any:
        """Cut a fresh in-window leaf to its last page-aligned window, so a lock on it pins one window."""
        if leaf.swa_lock_ref > 0:
            return None
        ps = self.cache.page_size
        tail = (self.window + ps - 1) // ps * ps
        n = len(leaf.key)
        if n <= tail:
            return None
        split_at = n - tail
        if ps > 1 and (split_at % ps or n % ps):
            return None
        return self.cache.split(leaf, split_at)

    # -- locks -------------------------------------------------------------------------
    def lock(self, node: Any, lock: LockResult) -> None:
        root = self.cache.root_node
        window = self.window
        size = 0
        stop = None
        skip: set[int] = set()
        x = node
        while x is not root and size < window:
            if x.swa_value is None:
                skip.add(x.id)
                x = x.parent
                continue
            if x.swa_lock_ref == 0:
                n = len(x.key)
                self._evictable -= n
                self._protected += n
            x.swa_lock_ref += 1
            size += len(x.swa_value)
            if size >= window:
                if x.swa_uuid is None:
                    x.swa_uuid = next(self._uuids)
                stop = x.swa_uuid
            x = x.parent
        lock.stop = stop
        lock.extras["swa_skip"] = skip
        # How many window tokens it took: a lock that took none has no window lock to give back early.
        lock.extras["swa_tokens"] = size

    def unlock(self, node: Any, lock: LockResult | None) -> None:
        root = self.cache.root_node
        stop = lock.stop if lock is not None else None
        skip = lock.extras.get("swa_skip", ()) if lock is not None else ()
        x = node
        while x is not root:
            if x.id in skip or x.swa_lock_ref == 0:
                x = x.parent
                continue
            if x.swa_lock_ref == 1:
                n = len(x.swa_value)
                self._evictable += n
                self._protected -= n
            x.swa_lock_ref -= 1
            if stop and x.swa_uuid == stop:
                return
            x = x.parent

    def window_locked(self, node: Any, lock: LockResult | None) -> list[Any]:
        """The nodes whose window lock ``release_window(node, lock)`` gives back (leaf first): those holding
        one on ``node``'s path, up to the lock's stop marker, less the tombstones the lock passed over."""
        root = self.cache.root_node
        stop = lock.stop if lock is not None else None
        skip = lock.extras.get("swa_skip", ()) if lock is not None else ()
        out = []
        x = node
        while x is not root:
            if x.swa_value is not None and x.swa_lock_ref > 0 and x.id not in skip:
                out.append(x)
            if stop and x.swa_uuid == stop:
                return out
            x = x.parent
        if stop:
            # A stop marker not on the path: the lock is not one inc_lock_ref(node) returned.
            raise ValueError(f"the window lock's stop marker {stop!r} is not on the path of {node!r}: pass the "
                             "lock that inc_lock_ref returned for this node (nothing was changed)")
        return out

    def release_window(self, node: Any, lock: LockResult | None) -> None:
        """SGLang's release_window_lock: drop the window lock, tombstoning leaves nothing else locks."""
        cache = self.cache
        for x in self.window_locked(node, lock):
            x.swa_lock_ref -= 1
            if x.swa_lock_ref == 0:
                n = len(x.key)
                self._protected -= n
                self._evictable += n
                if cache.is_leaf(x):
                    self.free_value(x)

    # -- checks ------------------------------------------------------------------------
    def check(self, node: Any) -> None:
        if node.swa_value is None:
            assert node not in self.lru and node.swa_lock_ref == 0, node
        else:
            assert node in self.lru and len(node.swa_value) == len(node.key), node
            assert torch.equal(node.swa_value, self.alloc.translate_loc_from_full_to_swa(node.value)), node

    def check_totals(self, root: Any) -> None:
        ev = pr = cnt = 0
        for x in iter_subtree(root):
            if x.swa_value is not None:
                cnt += 1
                if x.swa_lock_ref:
                    pr += len(x.key)
                else:
                    ev += len(x.key)
        assert (ev, pr) == (self._evictable, self._protected), ((ev, pr), (self._evictable, self._protected))
        assert cnt == self.lru.count, (cnt, self.lru.count)

"""The ``mamba`` tree component (SGLang's MambaComponent): one recurrent-state slot per node, or a tombstone.

A node's state is the model's state after the node's last token; a match may end only
on a node that holds one.  Locks cover the node itself; a split leaves the state on
the lower half.  Its own eviction takes states from the state LRU: a leaf goes whole,
an internal node keeps its full slots (priority 0: nothing cascades from it).

Requests (``page_size == 1``, SGLang's default mode): a finished request's own state
slot goes to the tree with its tokens (unless the tree has one there already); a
chunked prefill donates a copy.  The state pool and the request table are the core's
:class:`kvcore.pools.mamba_pool.MambaPool` / ``HybridReqToTokenPool``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvcore.cache import LockResult, SlotOwner
from kvcore.components import TreeComponent
from kvcore.pools.mamba_pool import HybridReqToTokenPool, MambaPool, mamba_state_of
from kvcore.pools.views import PoolView
from kvcore.tree import LRUList

if TYPE_CHECKING:
    from kvcore_unified.tree import InsertArgs, UnifiedRadixCache

__all__ = ["MambaComponent", "MambaOptions"]


class MambaOptions(BaseModel):
    """Options of the ``mamba`` component: the state pool and its state shapes (as the ``mamba`` backend's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mamba_size: int | None = Field(None, gt=0, description="state slots (default: 4 x max_num_reqs)")
    mamba_cache_chunk_size: int = Field(64, gt=0, description="branching points are floored to this many tokens")
    mamba_num_layers: int = Field(2, gt=0, description="Mamba layers (each keeps one state per slot)")
    mamba_conv_shapes: tuple[tuple[int, ...], ...] = Field(((6, 3),), description="conv state shape(s) per layer")
    mamba_temporal_shape: tuple[int, ...] = Field((2, 4, 4), description="temporal (SSM) state shape per layer")
    mamba_dtype: Literal["float16", "bfloat16", "float32"] = Field("float32", description="state dtype")


class MambaComponent(TreeComponent):
    """Recurrent-state slots: one per node, single-node locks, tombstones (SGLang's MambaComponent)."""

    name = "mamba"
    pool = "mamba"
    internal_priority = 0
    options = MambaOptions
    node_fields = {"mamba_value": None, "mamba_lock_ref": 0, "mamba_prev": None, "mamba_next": None}
    cache: UnifiedRadixCache

    # -- config hooks ------------------------------------------------------------------
    @staticmethod
    def check_options(config: Any, opts: MambaOptions) -> None:
        if not opts.mamba_conv_shapes or any(not s or min(s) <= 0 for s in opts.mamba_conv_shapes):
            raise ValueError(f"mamba_conv_shapes={opts.mamba_conv_shapes!r}: give one or more positive shapes")
        if not opts.mamba_temporal_shape or min(opts.mamba_temporal_shape) <= 0:
            raise ValueError(f"mamba_temporal_shape={opts.mamba_temporal_shape!r} must be a positive shape")

    @staticmethod
    def build_req_to_token_pool(config: Any, opts: MambaOptions) -> Any:
        size = opts.mamba_size if opts.mamba_size is not None else 4 * config.max_num_reqs
        pool = MambaPool(size, num_layers=opts.mamba_num_layers, conv_shapes=opts.mamba_conv_shapes,
                         temporal_shape=opts.mamba_temporal_shape, dtype=getattr(torch, opts.mamba_dtype),
                         device=config.torch_device())
        return HybridReqToTokenPool(config.max_num_reqs, config.max_context_len, device=config.torch_device(),
                                    mamba_pool=pool)

    def __init__(self, cache: Any, options: BaseModel | None) -> None:
        super().__init__(cache, options)
        opts = options if isinstance(options, MambaOptions) else MambaOptions.model_validate({})
        r2t = cache.req_to_token_pool
        if not isinstance(r2t, HybridReqToTokenPool):
            raise TypeError(f"the mamba component needs a HybridReqToTokenPool, got {type(r2t).__name__}")
        self.r2t = r2t
        self.mamba_pool: MambaPool = r2t.mamba_pool
        self.chunk = int(opts.mamba_cache_chunk_size)
        # SGLang's mamba_checkpoint_grid: where a branching checkpoint may sit.
        self.grid = math.lcm(self.chunk, int(cache.page_size))
        # The request table asks the tree for states when it runs short, and lets it fill a new slot.
        r2t.evict_states = lambda n: cache.evict(0, mamba_num=n)
        r2t.prepare_state = self._prepare_admitted_state
        self.cow_copies = 0

    def cache_attrs(self) -> dict[str, Any]:
        return {**super().cache_attrs(), "mamba_pool": self.mamba_pool,
                "mamba_cache_chunk_size": self.chunk}

    def pool_views(self) -> list[Any]:
        return [PoolView("mamba", self.mamba_pool.allocator, record_slots=_record_slots)]

    def reset_state(self) -> None:
        from kvcore_unified.tree import UnifiedNode

        def sentinel() -> UnifiedNode:
            n = UnifiedNode()
            setattr(n, "mamba_lock_ref", 0)  # noqa: B010  (a component field, set on every node)
            return n

        self.lru = LRUList(sentinel, "mamba_prev", "mamba_next", "mamba_lock_ref", "mamba LRU")
        self._evictable = 0
        self._protected = 0

    # -- per node ----------------------------------------------------------------------
    def has_value(self, node: Any) -> bool:
        return node.mamba_value is not None

    def value_len(self, node: Any) -> int:
        return 0 if node.mamba_value is None else len(node.mamba_value)

    def lock_ref(self, node: Any) -> int:
        return node.mamba_lock_ref

    def owned_slots(self, node: Any) -> Iterator[SlotOwner]:
        yield SlotOwner("mamba", f"tree node {node.id} ({len(node.key)} tokens)", node.mamba_value)

    def free_value(self, node: Any) -> int:
        v = node.mamba_value
        self.mamba_pool.free(v)
        n = len(v)
        if node.mamba_lock_ref:
            self._protected -= n
        else:
            self._evictable -= n
        node.mamba_value = None
        if node in self.lru:
            self.lru.remove(node)
        return n

    def _set(self, node: Any, value: torch.Tensor) -> None:
        node.mamba_value = value
        self.lru.add_mru(node)
        self._evictable += len(value)

    def on_split(self, upper: Any, child: Any) -> None:
        upper.mamba_value = None
        upper.mamba_lock_ref = 0
        if child.mamba_value is not None:
            # SGLang re-inserts the split child at the front of each component's LRU.
            self.lru.remove(child)
            self.lru.add_mru(child)

    # -- match -------------------------------------------------------------------------
    def validator(self):
        return self.has_value

    def after_match(self, node: Any) -> None:
        if node.mamba_value is not None:
            self.lru.touch(node)

    def finish_match(self, result: Any, cow: bool, req: Any) -> Any:
        extras = dict(result.extras or {})
        aligned = extras.get("matched_len", 0) // self.grid * self.grid
        branching = aligned if aligned > result.device_indices.numel() else None
        extras["mamba_branching_seqlen"] = branching
        result = result._replace(extras=extras)
        comp = None
        if cow:
            if req is None:
                raise ValueError("match_prefix(cow_mamba=True) needs the request (req=...)")
            comp = mamba_state_of(req.kv, create=True)
        best = result.last_device_node
        if comp is not None:
            comp.mamba_branching_seqlen = branching
            src = best.mamba_value
            if src is not None:
                if not comp.holds_mamba:
                    dst = self.mamba_pool.alloc(1)
                    if dst is None:
                        lock = self.cache.inc_lock_ref(best)
                        self.cache.evict(0, mamba_num=1)
                        dst = self.mamba_pool.alloc(1)
                        self.cache.dec_lock_ref(best, lock)
                        if dst is None:
                            raise RuntimeError("match_prefix(cow_mamba=True): no state slot free or evictable")
                    comp.mamba_pool_idx = dst[0]
                comp.mamba_cow_src_index = src
                comp.mamba_needs_clear = False
        return result

    def on_match_request(self, req: Any, result: Any) -> None:
        comp = mamba_state_of(req.kv, create=True)
        assert comp is not None
        if not comp.holds_mamba:
            node = result.last_device_node
            comp.cow_node = node if node.mamba_value is not None else None
            comp.mamba_branching_seqlen = result.mamba_branching_seqlen

    def _prepare_admitted_state(self, kv: Any) -> None:
        """A request just got its state slot: copy the matched node's state (COW) or zero it."""
        comp = mamba_state_of(kv)
        assert comp is not None and comp.mamba_pool_idx is not None
        node, comp.cow_node = comp.cow_node, None
        dst = comp.mamba_pool_idx.reshape(1)
        if node is not None and node.mamba_value is not None and node.parent is not None:
            self.mamba_pool.copy_from(node.mamba_value, dst)
            self.cow_copies += 1
        else:
            self.mamba_pool.clear_slots(dst)
        comp.mamba_cow_src_index = None
        comp.mamba_needs_clear = False

    # -- insert ------------------------------------------------------------------------
    def request_state_slots(self, kv: Any) -> int:
        comp = mamba_state_of(kv)
        return 0 if comp is None else int(comp.slots().numel())

    def stats(self) -> dict[str, int]:
        return {"cow_copies": self.cow_copies}

    def check_insert(self, n: int, ins: InsertArgs) -> None:
        v = ins.mamba_value
        if v is None:
            return  # before_insert takes a fresh zeroed slot (as the mamba backend does)
        if not isinstance(v, torch.Tensor) or v.numel() != 1 or v.is_floating_point() or v.dtype == torch.bool:
            raise ValueError(f"insert: mamba_value must be a one-slot integer tensor, got {v!r}")
        v = v.reshape(1).to(torch.int64)
        if self.cache.strict:
            self.mamba_pool.allocator.check_claimable(v, what="insert mamba_value")
        ins.mamba_value = v

    def before_insert(self, value: Any, ins: Any) -> None:
        if ins.mamba_value is not None:
            return
        slot = self.mamba_pool.alloc(1)
        if slot is None:
            self.cache.evict(0, mamba_num=1)
            slot = self.mamba_pool.alloc(1)
            if slot is None:
                raise ValueError("insert: mamba_value is missing and no state slot is free or evictable")
        self.mamba_pool.clear_slots(slot)
        ins.mamba_value = slot
        ins.own_state = True

    def on_insert_commit(self, node: Any, is_new_leaf: bool, ins: InsertArgs) -> None:
        value = ins.mamba_value
        assert value is not None
        if is_new_leaf:
            self._set(node, value.clone())
            return
        if node.mamba_value is None:
            self._set(node, value.clone())
            node.last_access_time = self.cache.tick()
            return
        self.lru.touch(node)
        node.last_access_time = self.cache.tick()
        ins.mamba_exist = True
        if ins.own_state:
            self.mamba_pool.free(value)

    # -- requests (page_size 1) -------------------------------------------------------------
    def prepare_insert(self, req: Any, ins: InsertArgs, finished: bool) -> int | None:
        if self.cache.page_size > 1:
            raise NotImplementedError(
                "unified with a mamba component caches requests at page_size=1 only (SGLang's extra-buffer mode, "
                "page_size > 1, is not implemented here; the mamba backend has it)")
        comp = mamba_state_of(req.kv)
        if comp is None or comp.mamba_pool_idx is None:
            raise ValueError(
                f"request {req.rid!r} holds no state slot; admit it through kvcore.Engine or a HybridReqToTokenPool")
        if finished:
            ins.mamba_value = comp.mamba_pool_idx.reshape(1).clone()
            return None
        donated = self.mamba_pool.alloc(1)
        if donated is None:
            self.cache.evict(0, mamba_num=1)
            donated = self.mamba_pool.alloc(1)
            if donated is None:
                raise RuntimeError("cache_unfinished_req: no state slot free or evictable for the snapshot")
        self.mamba_pool.copy_from(comp.mamba_pool_idx.reshape(1), donated)
        ins.mamba_value = donated
        return None

    def after_cache_req(self, req: Any, finished: bool, ins: Any, result: Any) -> None:
        comp = mamba_state_of(req.kv)
        if finished:
            if comp is None or not comp.holds_mamba:
                return
            inserted = ins is not None and result is not None and not ins.mamba_exist
            if inserted:
                # Donated: the tree owns the slot now.
                comp.mamba_pool_idx = None
                comp.mamba_cow_src_index = None
                comp.cow_node = None
            else:
                self.r2t.free_mamba_cache(req.kv)
            return
        if ins is not None and ins.mamba_value is not None and (result is None or ins.mamba_exist):
            self.mamba_pool.free(ins.mamba_value)

    # -- locks -------------------------------------------------------------------------
    def lock(self, node: Any, lock: LockResult) -> None:
        if node.mamba_value is None:
            lock.extras.setdefault("mamba_skip", set()).add(node.id)
            return
        if node.mamba_lock_ref == 0:
            self._evictable -= 1
            self._protected += 1
        node.mamba_lock_ref += 1

    def unlock(self, node: Any, lock: LockResult | None) -> None:
        if lock is not None and node.id in lock.extras.get("mamba_skip", ()):
            return
        if node.mamba_lock_ref > 0:
            if node.mamba_lock_ref == 1:
                n = len(node.mamba_value)
                self._evictable += n
                self._protected -= n
            node.mamba_lock_ref -= 1

    # -- eviction ----------------------------------------------------------------------
    def evict(self, target: int, tracker: dict[str, int]) -> None:
        cache = self.cache
        lru = self.lru
        leaves = cache.leaves
        cursor = lru.lru_unlocked()
        while True:
            if cursor is not None and cursor not in lru:
                cursor = lru.lru_unlocked()
            if tracker["mamba"] >= target or cursor is None:
                return
            x = cursor
            cursor = lru.prev_unlocked(x)
            if x in leaves:
                cache.delete_leaf(x, tracker)
            else:
                cache.drop_value(x, self, tracker)

    # -- sizes -------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def check(self, node: Any) -> None:
        if node.mamba_value is None:
            assert node not in self.lru and node.mamba_lock_ref == 0, node
        else:
            assert node in self.lru, node

    def check_totals(self, root: Any) -> None:
        from kvcore.tree import iter_subtree

        ev = pr = cnt = 0
        for x in iter_subtree(root):
            if x.mamba_value is not None:
                cnt += 1
                if x.mamba_lock_ref:
                    pr += 1
                else:
                    ev += 1
        assert (ev, pr) == (self._evictable, self._protected), ((ev, pr), (self._evictable, self._protected))
        assert cnt == self.lru.count, (cnt, self.lru.count)


def _record_slots(kv: Any) -> tuple[torch.Tensor, int]:
    """The state slots a request record holds (its own one), for the invariant checker."""
    comp = mamba_state_of(kv)
    if comp is None:
        return torch.empty((0,), dtype=torch.int64), 0
    slots = comp.slots()
    return slots, int(slots.numel())

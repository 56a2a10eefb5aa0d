"""The ``mamba`` tree component (SGLang's MambaComponent): one recurrent-state slot per node, or a tombstone.

A node's state is the model's state after the node's last token; a match may end only
on a node that holds one.  Locks cover the node itself; a split leaves the state on
the lower half.  Its own eviction takes states from the state LRU: a leaf goes whole,
an internal node keeps its full slots (priority 0: nothing cascades from it).

Requests at ``page_size == 1`` (SGLang's default mode): a finished request's own state
slot goes to the tree with its tokens (unless the tree has one there already); a
chunked prefill donates a copy.  At ``page_size > 1`` (SGLang's extra-buffer mode) every
request also holds two ping-pong tracking slots, and only tracked snapshots go to the
tree (``track_mamba_state``: chunk boundaries of a prefill, the branching point, every
``lcm(chunk, page, mamba_track_interval)`` decoded tokens): an unfinished request donates
the tracked slot (taking a fresh one in its place), a finished one caches up to the last
tracked length.  The state pool, the request table and that request-side logic are the
core's (:mod:`kvcore.pools.mamba_pool`), shared with the ``mamba`` backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict

from kvcore.cache import InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.capabilities import Capability
from kvcore.pools.mamba_pool import (
    MambaRequestStates,
    MambaRequestTable,
    MambaStateOptions,
    mamba_state_of,
)
from kvcore.pools.views import PoolView
from kvcore.tree.value_component import LRUValueComponent

if TYPE_CHECKING:
    from kvcore.pool_builder import Placement
    from kvcore.record import Req, ReqKvInfo
    from kvcore.tree.unified import InsertArgs, UnifiedNode, UnifiedRadixCache

__all__ = ["MambaComponent", "MambaOptions"]


class MambaOptions(MambaStateOptions):
    """Options of the ``mamba`` component: the state pool and its state shapes (the ``mamba`` backend's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class MambaComponent(LRUValueComponent):
    """Recurrent-state slots: one per node, single-node locks, tombstones (SGLang's MambaComponent)."""

    name = "mamba"
    pool = "mamba"
    internal_priority = 0
    options = MambaOptions
    lru_label = "mamba LRU"
    capabilities = frozenset({Capability.REQUEST_STATE})
    node_fields = {"mamba_value": None, "mamba_lock_ref": 0, "mamba_prev": None, "mamba_next": None}
    cache: UnifiedRadixCache

    # -- config hooks ------------------------------------------------------------------
    @staticmethod
    def check_options(config: Any, opts: MambaOptions) -> None:
        if config.pre_alloc_size:
            raise ValueError(
                f"pre_alloc_size={config.pre_alloc_size} is not supported with the mamba component: its rows come "
                "from a HybridReqToTokenPool (one state slot per row) and SGLang's HybridMambaDecodeReqToTokenPool, "
                "which adds rows for pre-allocated requests, is not built; leave pre_alloc_size at 0 and count the "
                "pre-allocated requests in max_num_reqs"
            )
        opts.check_state_options(config.page_size)

    @staticmethod
    def build_req_to_token_pool(config: Any, opts: MambaOptions, at: Placement) -> Any:
        return opts.build_hybrid_req_to_token_pool(max_num_reqs=config.max_num_reqs,
                                                   max_context_len=config.max_context_len,
                                                   page_size=config.page_size, device=at.torch_device)

    def __init__(self, cache: Any, options: BaseModel | None) -> None:
        super().__init__(cache, options)
        opts = options if isinstance(options, MambaOptions) else MambaOptions.model_validate({})
        r2t = cache.req_to_token_pool
        if not isinstance(r2t, MambaRequestTable):
            raise TypeError(f"the mamba component needs a request table with state slots (a HybridReqToTokenPool), "
                            f"got {type(r2t).__name__}")
        self.r2t = r2t
        # kvcore's MambaPool, or an engine's state pool behind its table (kvcore-sglang's view of SGLang's).
        self.mamba_pool: Any = r2t.mamba_pool
        self.mamba_allocator: Any = r2t.mamba_allocator
        self.chunk = int(opts.mamba_cache_chunk_size)
        if cache.page_size > 1 and not r2t.extra_buffer:
            raise ValueError(f"page_size={cache.page_size}: the mamba component needs the extra-buffer request "
                             "table (HybridReqToTokenPool(extra_buffer=True)) for pages larger than one token")
        # Admission copies, extra-buffer tracking, donations and backups (shared with the mamba backend).
        self.states = MambaRequestStates(
            r2t, page_size=int(cache.page_size), chunk_size=self.chunk,
            track_interval=int(opts.mamba_track_interval), evict_states=lambda n: cache.evict(0, mamba_num=n))
        # SGLang's mamba_checkpoint_grid: where a branching checkpoint may sit.
        self.grid = self.states.checkpoint_grid

    def cache_attrs(self) -> dict[str, Any]:
        return {**super().cache_attrs(), "mamba_pool": self.mamba_pool,
                "mamba_cache_chunk_size": self.chunk, "track_mamba_state": self.states.track}

    def pool_views(self) -> list[Any]:
        return [PoolView("mamba", self.mamba_allocator, record_slots=_record_slots)]

    # -- per node ----------------------------------------------------------------------
    def has_value(self, node: UnifiedNode) -> bool:
        return node.mamba_value is not None

    def value_len(self, node: UnifiedNode) -> int:
        return 0 if node.mamba_value is None else len(node.mamba_value)

    def lock_ref(self, node: UnifiedNode) -> int:
        return node.mamba_lock_ref

    def owned_slots(self, node: UnifiedNode) -> Iterator[SlotOwner]:
        yield SlotOwner("mamba", f"tree node {node.id} ({len(node.key)} tokens)", node.mamba_value)

    def free_value(self, node: UnifiedNode) -> int:
        v = node.mamba_value
        if self.cache.strict:
            self.mamba_allocator.disown(v)
        self.mamba_pool.free(v)
        return self.forget_value(node)

    def set_value(self, node: UnifiedNode, value: torch.Tensor) -> None:
        # Under strict the tree claims every state slot it keeps, so a second node (or a
        # caller's free) offering it again is refused, as for the full pool's slots.
        if self.cache.strict:
            self.mamba_allocator.claim(value, checked=False)
        super().set_value(node, value)

    def on_split(self, upper: UnifiedNode, child: UnifiedNode) -> None:
        upper.mamba_value = None
        upper.mamba_lock_ref = 0
        if child.mamba_value is not None:
            self.requeue_split(upper, child)  # the upper part holds no state: only the child's place changes

    # -- match -------------------------------------------------------------------------
    def validator(self) -> Callable[[Any], bool]:
        return self.has_value

    def after_match(self, node: UnifiedNode) -> None:
        if node.mamba_value is not None:
            self.lru.touch(node)

    def finish_match(self, result: MatchResult, cow: bool, req: Req | None) -> MatchResult:
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
            if comp is not None and comp.holds_mamba:
                # Its running state would be overwritten by the copy (as the mamba backend refuses).
                raise ValueError(
                    f"match_prefix(cow_mamba=True): request {req.rid!r} already holds state slot "
                    f"{comp.mamba_pool_idx!r}; free it first (nothing was changed)")
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

    def on_match_request(self, req: Req, result: MatchResult) -> None:
        comp = mamba_state_of(req.kv, create=True)
        assert comp is not None
        if not comp.holds_mamba:
            node = result.last_device_node
            comp.cow_node = node if node.mamba_value is not None else None
            comp.mamba_branching_seqlen = result.mamba_branching_seqlen

    # -- insert ------------------------------------------------------------------------
    def request_state_slots(self, kv: ReqKvInfo) -> int:
        return self.states.slots_held(kv)

    def backup_request_state(self, req: Req) -> Any:
        return self.states.backup(req)

    def restore_request_state(self, req: Req, state: Any) -> None:
        self.states.restore(req, state)

    def stats(self) -> dict[str, int]:
        return self.states.stats()

    def check_insert(self, n: int, ins: InsertArgs) -> None:
        v = ins.mamba_value
        if v is None:
            return  # before_insert takes a fresh zeroed slot (as the mamba backend does)
        if not isinstance(v, torch.Tensor) or v.is_floating_point() or v.dtype == torch.bool:
            raise TypeError(f"insert: mamba_value must be an integer tensor of one state slot, got {v!r}")
        if v.numel() != 1:
            raise ValueError(f"insert: mamba_value must hold one state slot, got {v.numel()}: {v!r}")
        if ins.key_len != n:
            # The state is the model's after the key's last token: it can only sit on a node ending there.
            raise ValueError(f"insert: a key with a mamba_value must be page-aligned: {ins.key_len} tokens at "
                             f"page_size={self.cache.page_size}; cut the key to {n} tokens with the state after them")
        v = v.reshape(1).to(torch.int64)
        if self.cache.strict:
            self.mamba_allocator.check_claimable(v, what="insert mamba_value")
        ins.mamba_value = v

    def before_insert(self, value: torch.Tensor | None, ins: InsertArgs) -> None:
        if ins.mamba_value is not None:
            return
        slot = self.states.alloc_slot()
        if slot is None:
            raise ValueError("insert: mamba_value is missing and no state slot is free or evictable")
        self.mamba_pool.clear_slots(slot)
        ins.mamba_value = slot
        ins.own_state = True

    def on_insert_commit(self, node: UnifiedNode, is_new_leaf: bool, ins: InsertArgs) -> None:
        value = ins.mamba_value
        assert value is not None
        if is_new_leaf:
            self.set_value(node, value.clone())
            return
        if node.mamba_value is None:
            self.set_value(node, value.clone())
            node.last_access_time = self.cache.tick()
            return
        self.lru.touch(node)
        node.last_access_time = self.cache.tick()
        ins.mamba_exist = True
        if ins.own_state:
            self.mamba_pool.free(value)

    # -- requests ----------------------------------------------------------------------
    def prepare_insert(self, req: Req, ins: InsertArgs, finished: bool) -> int | None:
        comp = mamba_state_of(req.kv)
        if self.states.extra_buffer:
            return self._prepare_tracked(req, comp, ins, finished)
        if comp is None or comp.mamba_pool_idx is None:
            raise ValueError(
                f"request {req.rid!r} holds no state slot; admit it through kvcore.Engine or a HybridReqToTokenPool")
        if finished:
            ins.mamba_value = comp.mamba_pool_idx.reshape(1).clone()
            if self.cache.strict:
                # The state the tree will own, refused before anything changes (as an insert's mamba_value).
                self.mamba_allocator.check_claimable(ins.mamba_value.to(torch.int64), what=f"request {req.rid!r}")
            return None
        donated = self.states.alloc_slot()
        if donated is None:
            # Every state slot is a running request's: this chunk stays uncached (SGLang asserts here).
            self.states.snapshot_skips += 1
            return 0
        self.mamba_pool.copy_from(comp.mamba_pool_idx.reshape(1), donated)
        self.states.state_snapshots += 1
        ins.mamba_value = donated
        return None

    def _prepare_tracked(self, req: Req, comp: Any, ins: InsertArgs, finished: bool) -> int:
        """Extra-buffer mode (SGLang's ``prepare_for_caching_req``): cache up to the last tracked snapshot."""
        if comp is None or comp.mamba_ping_pong_track_buffer is None:
            raise ValueError(
                f"request {req.rid!r} holds no ping-pong tracking slots; admit it through kvcore.Engine or a "
                "HybridReqToTokenPool(extra_buffer=True)")
        cache_len = self.states.track(req)
        if finished:
            ins.mamba_value = self.states.tracked_slot(comp)
            return cache_len or 0
        if cache_len is None:
            return 0
        donated = self.states.donate_tracked(req.kv)
        if donated is None:
            return 0  # no slot for the tracking buffer: this snapshot stays uncached
        ins.mamba_value = donated
        return cache_len

    def after_cache_req(self, req: Req, finished: bool, ins: InsertArgs | None, result: InsertResult | None) -> None:
        comp = mamba_state_of(req.kv)
        extra = self.states.extra_buffer
        if finished:
            if comp is None or (comp.mamba_pool_idx is None and comp.mamba_ping_pong_track_buffer is None):
                return
            inserted = ins is not None and result is not None and not ins.mamba_exist
            if extra:
                # The tree keeps the tracked ping-pong slot it took; the rest go back.
                self.r2t.free_mamba_cache(req.kv, keep=comp.mamba_last_track_idx if inserted else None)
            elif inserted:
                # Donated: the tree owns the slot now.
                comp.mamba_pool_idx = None
                comp.mamba_cow_src_index = None
                comp.cow_node = None
            else:
                self.r2t.free_mamba_cache(req.kv)
            return
        if ins is not None and ins.mamba_value is not None and (result is None or ins.mamba_exist):
            self.mamba_pool.free(ins.mamba_value)
        if extra and comp is not None and ins is not None and ins.mamba_value is not None:
            comp.mamba_last_track_seqlen = None

    # -- locks -------------------------------------------------------------------------
    def lock(self, node: UnifiedNode, lock: LockResult) -> None:
        if node.mamba_value is None:
            lock.extras.setdefault("mamba_skip", set()).add(node.id)
            return
        if node.mamba_lock_ref == 0:
            self._evictable -= 1
            self._protected += 1
        node.mamba_lock_ref += 1

    def unlock(self, node: UnifiedNode, lock: LockResult | None) -> None:
        if lock is not None and node.id in lock.extras.get("mamba_skip", ()):
            return
        if node.mamba_lock_ref > 0:
            if node.mamba_lock_ref == 1:
                n = len(node.mamba_value)
                self._evictable += n
                self._protected -= n
            node.mamba_lock_ref -= 1

    # -- checks ------------------------------------------------------------------------
    def check(self, node: UnifiedNode) -> None:
        if node.mamba_value is None:
            assert node not in self.lru and node.mamba_lock_ref == 0, node
        else:
            assert node in self.lru, node

    def check_totals(self, root: UnifiedNode) -> None:
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


def _record_slots(kv: ReqKvInfo) -> tuple[torch.Tensor, int]:
    """The state slots a request record holds (its own one), for the invariant checker."""
    comp = mamba_state_of(kv)
    if comp is None:
        return torch.empty((0,), dtype=torch.int64), 0
    slots = comp.slots()
    return slots, int(slots.numel())

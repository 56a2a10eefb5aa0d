"""The state pool of a hybrid model and the request table that hands out a state slot with each row.

SGLang keeps a Mamba layer's recurrent state per sequence in a ``MambaPool`` and
hands a request its state slot together with its req_to_token row
(``HybridReqToTokenPool``).  kvcore does the same: :class:`MambaPool` holds the
state tensors and a slot allocator (SGLang's free-list order: slot 0 is padding,
slots are taken from the front and freed slots go to the back);
:class:`HybridReqToTokenPool` takes a row *and* a state slot for every request
that holds none (``alloc``) and gives both back (``free``).  What a request holds
lives in its record, ``req.kv.components["mamba"]`` (:class:`MambaReqState`), so
a streaming session that adopts the record adopts the state slot with it.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, field_validator

from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.req_to_token import ReqToTokenPool

__all__ = ["COMPONENT", "MambaPool", "MambaState", "MambaReqState", "HybridReqToTokenPool", "MambaRequestStates",
           "MambaRequestTable", "MambaStateOptions", "mamba_state_of"]

#: The key of the per-request state in ``ReqKvInfo.components``.
COMPONENT = "mamba"


@dataclass(slots=True, eq=False)
class MambaReqState:
    """What a request (or a session slot) holds of the state pool; SGLang's ``ReqKvInfo`` mamba fields.

    ``mamba_pool_idx``: the request's own state slot (a 0-d int64 tensor) or None.
    ``mamba_cow_src_index``: the tree node's slot (a one-slot tensor) whose state must be
    copied into ``mamba_pool_idx`` before the next forward (``match_prefix(cow_mamba=True)``);
    ``mamba_needs_clear``: the slot is fresh and must be zeroed first.  ``mamba_branching_seqlen``:
    the last match's branching point (the mamba component's ``finish_match``: the matched full KV,
    floored to the chunk grid, when that lies past the matched state; else None).
    """

    mamba_pool_idx: torch.Tensor | None = None
    mamba_cow_src_index: torch.Tensor | None = None
    mamba_needs_clear: bool = False
    mamba_branching_seqlen: int | None = None
    # Extra-buffer mode (page_size > 1): two ping-pong tracking slots (a 2-slot int64 tensor),
    # which of them the next snapshot goes to, which holds the latest one and its length.
    mamba_ping_pong_track_buffer: torch.Tensor | None = None
    mamba_next_track_idx: int | None = None
    mamba_last_track_idx: int | None = None
    mamba_last_track_seqlen: int | None = None
    # kvcore has no forward: how far the cache has replayed SGLang's tracking rules (None: from
    # ``cache_protected_len``, the admission prefix).
    mamba_tracked_len: int | None = None
    # Set by the mamba component's on_match_request (the tree's match_request): the locked node
    # whose state the request copies when HybridReqToTokenPool.alloc gives it its slot (the engine's COW).
    cow_node: Any = None

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None

    def slots(self) -> torch.Tensor:
        """The state slots this record holds (its own, then its ping-pong slots), as a 1-D int64 tensor."""
        parts = []
        if self.mamba_pool_idx is not None:
            parts.append(self.mamba_pool_idx.reshape(1).to(torch.int64))
        if self.mamba_ping_pong_track_buffer is not None:
            parts.append(self.mamba_ping_pong_track_buffer.reshape(-1).to(torch.int64))
        if not parts:
            return torch.empty((0,), dtype=torch.int64)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def clear_tracking(self) -> None:
        self.mamba_ping_pong_track_buffer = None
        self.mamba_next_track_idx = None
        self.mamba_last_track_idx = None
        self.mamba_last_track_seqlen = None
        self.mamba_tracked_len = None


def mamba_state_of(kv: Any, create: bool = False) -> MambaReqState | None:
    """The record's :class:`MambaReqState` (made on demand with ``create``)."""
    comp = kv.components.get(COMPONENT)
    if comp is None and create:
        comp = kv.components[COMPONENT] = MambaReqState()
    return comp


@dataclass(slots=True)
class MambaState:
    """The state tensors: ``conv[i]`` is ``[layer, slot, *conv_shapes[i]]``, ``temporal`` ``[layer, slot, ...]``."""

    conv: list[torch.Tensor]
    temporal: torch.Tensor


class MambaPool:
    """``size`` fixed-size recurrent states (slot 0 is padding), and their slot allocator."""

    def __init__(
        self,
        size: int,
        *,
        num_layers: int = 2,
        conv_shapes: Sequence[Sequence[int]] = ((6, 3),),
        temporal_shape: Sequence[int] = (2, 4, 4),
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if size <= 0:
            raise ValueError(f"mamba_size={size} must be positive")
        self.size = size
        self.device = device
        self.allocator = TokenToKVPoolAllocator(size, page_size=1, device=device)
        self.mamba_cache = MambaState(
            conv=[torch.zeros((num_layers, size + 1, *s), dtype=dtype, device=device) for s in conv_shapes],
            temporal=torch.zeros((num_layers, size + 1, *temporal_shape), dtype=dtype, device=device),
        )
        self.num_layers = num_layers

    # -- slots ----------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` state slots (int64), or None with nothing taken."""
        return self.allocator.alloc(need_size)

    def free(self, free_index: Any) -> None:
        """Give slots back; ValueError (nothing freed) for padding, out-of-range or already free slots."""
        self.allocator.free(free_index)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def clear(self) -> None:
        self.allocator.clear()

    # -- state data -----------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's state, all layers."""
        tensors = [*self.mamba_cache.conv, self.mamba_cache.temporal]
        return sum(t[:, 0].numel() * t.element_size() for t in tensors)

    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> None:
        """Copy whole states (every layer, conv and temporal) slot to slot."""
        src = src_indices.reshape(-1).to(torch.int64)
        dst = dst_indices.reshape(-1).to(torch.int64)
        for t in self.mamba_cache.conv:
            t[:, dst] = t[:, src]
        t = self.mamba_cache.temporal
        t[:, dst] = t[:, src]

    def clear_slots(self, indices: torch.Tensor) -> None:
        """Zero the states of ``indices`` (a fresh request starts from a zero state)."""
        idx = indices.reshape(-1).to(torch.int64)
        for t in self.mamba_cache.conv:
            t[:, idx] = 0
        self.mamba_cache.temporal[:, idx] = 0


class MambaRequestTable(abc.ABC):
    """What a Mamba tree needs of its request table, declared by the tables that have it.

    kvcore's :class:`HybridReqToTokenPool` is one; an engine's own table can be another
    (kvcore-sglang's view of SGLang's ``HybridReqToTokenPool``), by subclassing this.  The
    trees check ``isinstance(r2t, MambaRequestTable)``: a capability declared, not probed.

    ``req_to_token`` (rows of full-pool slots); ``extra_buffer`` (SGLang's
    ``enable_mamba_extra_buffer``: ping-pong tracking slots per request); ``mamba_pool``
    (``alloc`` / ``free`` / ``available_size`` / ``size`` of state slots, ``copy_from`` /
    ``clear_slots`` / ``mamba_cache`` of their contents); ``mamba_allocator`` (the same slots
    as a pool the invariant checker and the strict claims read); ``free_mamba_cache(kv,
    keep)``.  ``evict_states`` and ``prepare_state`` are set by the tree: a table that hands
    out state slots itself (kvcore's) calls them when slots run short and on each new slot.
    """

    # req_to_token is the table's own (a tensor attribute or property of every request table).
    extra_buffer: bool
    #: Extra-buffer mode: True when the engine's scheduler sets the tracking fields of each record
    #: and its kernels write the snapshots (SGLang); False when the tree replays the scheduler's
    #: rules itself (kvcore's own tables: kvcore has no forward).
    tracks_states: bool = False
    mamba_pool: Any
    mamba_allocator: Any
    evict_states: Callable[[int], Any] | None
    prepare_state: Callable[[Any], None] | None

    @abc.abstractmethod
    def free_mamba_cache(self, kv: Any, keep: int | None = None) -> None:
        """Give back the state slots ``kv`` holds, except ping-pong position ``keep`` (the tree took it)."""

    def set_ping_pong_slot(self, kv: Any, idx: int, slot: torch.Tensor) -> None:
        """Point ping-pong position ``idx`` of ``kv`` at ``slot`` (a table with a device-side copy updates it too)."""
        comp = mamba_state_of(kv)
        assert comp is not None and comp.mamba_ping_pong_track_buffer is not None
        comp.mamba_ping_pong_track_buffer[idx] = slot


class HybridReqToTokenPool(ReqToTokenPool, MambaRequestTable):
    """A req_to_token row and a state slot per request (SGLang's ``HybridReqToTokenPool``).

    ``alloc(reqs)`` gives every request that holds no row a row, and every one that holds no
    state slot a slot; when slots run short it asks ``evict_states(n)`` (set by the cache)
    first, and returns None with no row or slot taken if they still do not fit.
    ``prepare_state(kv)`` (set by the cache) sees each new slot: the copy-on-write from the
    matched node, or a clear.  ``free(owner)`` gives back the row and the state slot.

    ``extra_buffer`` (SGLang's ``enable_mamba_extra_buffer``, page_size > 1): every request
    also takes two ping-pong tracking slots (``mamba_ping_pong_track_buffer``), after its own
    slot, in SGLang's order; ``free_mamba_cache(kv, keep)`` gives them back except ``keep``
    (the one the tree took).
    """

    ping_pong_size = 2  # SGLang's mamba_ping_pong_track_buffer_size with the overlap scheduler

    def __init__(
        self, size: int, max_context_len: int, device: str | torch.device = "cpu", *, mamba_pool: MambaPool,
        extra_buffer: bool = False,
    ) -> None:
        self.extra_buffer = extra_buffer
        self.mamba_pool = mamba_pool
        self.mamba_allocator = mamba_pool.allocator
        self.evict_states: Callable[[int], Any] | None = None
        self.prepare_state: Callable[[Any], None] | None = None
        super().__init__(size, max_context_len, device)

    def clear(self) -> None:
        super().clear()
        self.mamba_pool.clear()

    def alloc(self, reqs: Sequence[Any]) -> list[int] | None:
        rows_needed: dict[int, Any] = {}
        states_needed: dict[int, Any] = {}
        buffers_needed: dict[int, Any] = {}
        for r in reqs:
            kv = r.kv
            if kv.req_pool_idx is None:
                rows_needed.setdefault(id(kv), kv)
            comp = kv.components.get(COMPONENT)
            if comp is None or comp.mamba_pool_idx is None:
                states_needed.setdefault(id(kv), kv)
            if self.extra_buffer and (comp is None or comp.mamba_ping_pong_track_buffer is None):
                buffers_needed.setdefault(id(kv), kv)
        if len(rows_needed) > self.available_size():
            return None
        pool = self.mamba_pool
        need = len(states_needed) + self.ping_pong_size * len(buffers_needed)
        short = need - pool.available_size()
        if short > 0 and self.evict_states is not None:
            self.evict_states(short)
        if need > pool.available_size():
            return None
        rows = super().alloc(reqs)
        assert rows is not None
        if self.extra_buffer:
            # SGLang's order: per request, its own slot, then its two ping-pong slots.
            seen: set[int] = set()
            for r in reqs:
                kv = r.kv
                if id(kv) in seen:
                    continue
                seen.add(id(kv))
                if id(kv) in states_needed:
                    self._give_state(kv, pool.alloc(1))
                if id(kv) in buffers_needed:
                    buf = pool.alloc(self.ping_pong_size)
                    assert buf is not None
                    comp = mamba_state_of(kv, create=True)
                    assert comp is not None
                    comp.mamba_ping_pong_track_buffer = buf
                    comp.mamba_next_track_idx = 0
                    comp.mamba_last_track_idx = 1
                    comp.mamba_last_track_seqlen = None
                    comp.mamba_tracked_len = None
            return rows
        if states_needed:
            slots = pool.alloc(len(states_needed))
            assert slots is not None
            for kv, slot in zip(states_needed.values(), slots):
                comp = mamba_state_of(kv, create=True)
                assert comp is not None
                comp.mamba_pool_idx = slot
                comp.mamba_needs_clear = True
                if self.prepare_state is not None:
                    self.prepare_state(kv)
        return rows

    def _give_state(self, kv: Any, slot: torch.Tensor | None) -> None:
        assert slot is not None
        comp = mamba_state_of(kv, create=True)
        assert comp is not None
        comp.mamba_pool_idx = slot[0]
        comp.mamba_needs_clear = True
        if self.prepare_state is not None:
            self.prepare_state(kv)

    def free_mamba_cache(self, kv: Any, keep: int | None = None) -> None:
        """Give back the state slots ``kv`` holds (SGLang's ``free_mamba_cache``).

        Its own slot first, then its ping-pong slots except position ``keep`` (the slot the
        tree took over).  ValueError, nothing freed, when the record holds no state slot.
        """
        comp = kv.components.get(COMPONENT)
        if comp is None or (comp.mamba_pool_idx is None and comp.mamba_ping_pong_track_buffer is None):
            raise ValueError("free_mamba_cache: the record holds no state slot (double free?)")
        buf = comp.mamba_ping_pong_track_buffer
        if keep is not None and (buf is None or not 0 <= keep < buf.numel()):
            raise ValueError(f"free_mamba_cache: keep={keep} names no ping-pong slot of this record")
        if comp.mamba_pool_idx is not None:
            self.mamba_pool.free(comp.mamba_pool_idx.reshape(1))
        comp.mamba_pool_idx = None
        comp.mamba_cow_src_index = None
        comp.mamba_needs_clear = False
        comp.cow_node = None
        if buf is not None:
            rest = buf if keep is None else torch.cat([buf[:keep], buf[keep + 1 :]])
            if rest.numel():
                self.mamba_pool.free(rest)
            comp.clear_tracking()

    def free(self, owner: Any) -> None:
        super().free(owner)
        comp = owner.kv.components.get(COMPONENT)
        if comp is not None and (comp.mamba_pool_idx is not None or comp.mamba_ping_pong_track_buffer is not None):
            self.free_mamba_cache(owner.kv)


class MambaRequestStates:
    """What a Mamba tree does with the state slots its requests hold, whichever tree it is.

    Shared by the ``mamba`` backend and the ``unified`` backend's mamba component: the
    state a newly admitted request starts from (:meth:`prepare_admitted_state`), SGLang's
    extra-buffer tracking (:meth:`track`, page_size > 1), the tracked slot donated to the
    tree (:meth:`donate_tracked`), a fresh slot with eviction (:meth:`alloc_slot`) and the
    host copies of a retraction backup (:meth:`backup` / :meth:`restore`).
    ``evict_states(n)``: the tree's state eviction.  Counters: ``cow_copies``,
    ``state_clears``, ``state_snapshots``, ``snapshot_skips``.
    """

    def __init__(self, r2t: MambaRequestTable, *, page_size: int, chunk_size: int, track_interval: int,
                 evict_states: Callable[[int], Any]) -> None:
        self.r2t = r2t
        self.pool = r2t.mamba_pool
        self.page_size = int(page_size)
        self.chunk_size = int(chunk_size)
        self.extra_buffer = bool(r2t.extra_buffer)
        # SGLang's mamba_checkpoint_grid (prefill) and mamba_track_grid (decode).
        self.checkpoint_grid = math.lcm(self.chunk_size, self.page_size)
        self.decode_track_grid = math.lcm(self.checkpoint_grid, int(track_interval))
        self.evict_states = evict_states
        self.cow_copies = 0
        self.state_clears = 0
        self.state_snapshots = 0
        self.snapshot_skips = 0
        # The request table asks the tree for room in the state pool and lets it fill a new slot.
        r2t.evict_states = evict_states
        r2t.prepare_state = self.prepare_admitted_state

    def stats(self) -> dict[str, int]:
        return {"cow_copies": self.cow_copies, "state_clears": self.state_clears,
                "state_snapshots": self.state_snapshots, "snapshot_skips": self.snapshot_skips}

    def alloc_slot(self) -> torch.Tensor | None:
        """One fresh state slot, evicting one unlocked tree state if none is free; None if none can be had."""
        slot = self.pool.alloc(1)
        if slot is None:
            self.evict_states(1)
            slot = self.pool.alloc(1)
        return slot

    def prepare_admitted_state(self, kv: Any) -> None:
        """A request just got its state slot: copy the matched node's state (COW) or zero it."""
        comp = mamba_state_of(kv)
        assert comp is not None and comp.mamba_pool_idx is not None
        node, comp.cow_node = comp.cow_node, None
        dst = comp.mamba_pool_idx.reshape(1)
        if node is not None and node.mamba_value is not None and node.parent is not None:
            self.pool.copy_from(node.mamba_value, dst)
            self.cow_copies += 1
        else:
            self.pool.clear_slots(dst)
            self.state_clears += 1
        comp.mamba_cow_src_index = None
        comp.mamba_needs_clear = False

    # -- extra-buffer mode (page_size > 1) -------------------------------------------
    def track(self, req: Any) -> int | None:
        """Replay SGLang's scheduler tracking over what ``req`` computed since the last call.

        SGLang's scheduler decides, around each forward, whether the kernel writes a state
        snapshot into the request's next ping-pong slot (``mamba_next_track_idx``): a prefill
        extend of at least one checkpoint grid (``lcm(chunk, page)``) snapshots at
        ``start + L // grid * grid`` (or at ``mamba_branching_seqlen`` when that lies inside the
        extend, a whole number of chunks from its start), a decode step that reaches a multiple of
        ``lcm(grid, mamba_track_interval)`` snapshots there; each snapshot records
        ``mamba_last_track_idx`` / ``mamba_last_track_seqlen`` and flips the next index.
        kvcore has no forward: a scheduler may call this after each forward, and the caches'
        ``cache_unfinished_req`` / ``cache_finished_req`` call it first to catch up: the span
        computed since the previous call counts as one prefill extend (the part inside the
        prompt) followed by decode steps.  The snapshot's contents are the request's running
        state at this call.  Returns the latest tracked length, or None.  No-op at page size 1.
        """
        comp = mamba_state_of(req.kv)
        if not self.extra_buffer or comp is None or comp.mamba_ping_pong_track_buffer is None:
            return None
        if self.r2t.tracks_states:
            # The engine tracked (and its kernels wrote the snapshot): nothing to replay.
            return comp.mamba_last_track_seqlen
        kv = req.kv
        start = comp.mamba_tracked_len if comp.mamba_tracked_len is not None else kv.cache_protected_len
        end = kv.kv_committed_len
        if end <= start:
            return comp.mamba_last_track_seqlen
        tracked = False
        prompt_end = min(end, len(req.origin_input_ids))
        grid = self.checkpoint_grid
        # SGLang: an extend of L >= grid tokens snapshots at start + L // grid * grid (its chunks
        # start on pages; kvcore's may not, so the start is floored to its page first).
        if prompt_end - start >= grid:
            seqlen = start - start % self.page_size + (prompt_end - start) // grid * grid
            br = comp.mamba_branching_seqlen
            if br is not None and start < br < prompt_end and (br - start) % self.chunk_size == 0:
                seqlen = br
            nxt = comp.mamba_next_track_idx
            assert nxt is not None
            comp.mamba_last_track_idx = nxt
            comp.mamba_next_track_idx = 1 - nxt
            comp.mamba_last_track_seqlen = seqlen
            tracked = True
        dstart = max(start, len(req.origin_input_ids))
        dgrid = self.decode_track_grid
        crossings = end // dgrid - dstart // dgrid if end > dstart else 0
        if crossings > 0:
            nxt = comp.mamba_next_track_idx
            assert nxt is not None
            last = nxt if crossings % 2 else 1 - nxt
            comp.mamba_last_track_idx = last
            comp.mamba_next_track_idx = 1 - last
            comp.mamba_last_track_seqlen = end // dgrid * dgrid
            tracked = True
        comp.mamba_tracked_len = end
        if tracked and comp.mamba_pool_idx is not None:
            keep = comp.mamba_last_track_idx
            assert keep is not None
            self.pool.copy_from(comp.mamba_pool_idx.reshape(1), comp.mamba_ping_pong_track_buffer[keep].reshape(1))
            self.state_snapshots += 1
        return comp.mamba_last_track_seqlen

    def tracked_slot(self, comp: MambaReqState) -> torch.Tensor:
        """A copy of the ping-pong slot holding the latest tracked snapshot (one-slot tensor)."""
        keep = comp.mamba_last_track_idx
        assert keep is not None and comp.mamba_ping_pong_track_buffer is not None
        return comp.mamba_ping_pong_track_buffer[keep].reshape(1).clone()

    def donate_tracked(self, kv: Any) -> torch.Tensor | None:
        """SGLang's ``donate_mamba_ping_pong_slot``: hand the tracked slot over, a fresh one in its place.

        None (``snapshot_skips`` counted, nothing changed) when no slot is free or evictable:
        SGLang asserts there; kvcore leaves the snapshot uncached.
        """
        comp = mamba_state_of(kv)
        assert comp is not None
        new_slot = self.alloc_slot()
        if new_slot is None:
            self.snapshot_skips += 1
            return None
        donated = self.tracked_slot(comp)
        keep = comp.mamba_last_track_idx
        assert keep is not None
        self.r2t.set_ping_pong_slot(kv, keep, new_slot[0])
        return donated

    # -- retraction backups ------------------------------------------------------------
    def backup(self, req: Any) -> Any:
        """A host copy of the request's own state slot (conv states, temporal state), or None without one."""
        comp = mamba_state_of(req.kv)
        if comp is None or comp.mamba_pool_idx is None:
            return None
        idx = comp.mamba_pool_idx.reshape(1).to(torch.int64)
        cache = self.pool.mamba_cache
        return {"conv": [t[:, idx].to("cpu", copy=True) for t in cache.conv],
                "temporal": cache.temporal[:, idx].to("cpu", copy=True)}

    def restore(self, req: Any, state: Any) -> None:
        """Write a :meth:`backup` copy into the state slot the request holds now (ValueError without one)."""
        comp = mamba_state_of(req.kv)
        if comp is None or comp.mamba_pool_idx is None:
            raise ValueError(
                f"restore_request_state: request {req.rid!r} holds no state slot "
                "(req.kv.components['mamba'].mamba_pool_idx); admit it through kvcore.Engine or a "
                "HybridReqToTokenPool first"
            )
        idx = comp.mamba_pool_idx.reshape(1).to(torch.int64)
        cache = self.pool.mamba_cache
        for t, saved in zip(cache.conv, state["conv"]):
            t[:, idx] = saved.to(t.device)
        cache.temporal[:, idx] = state["temporal"].to(cache.temporal.device)
        # The slot holds the backed-up state now: nothing to copy or clear before the next forward.
        comp.mamba_cow_src_index = None
        comp.mamba_needs_clear = False
        comp.cow_node = None

    @staticmethod
    def slots_held(kv: Any) -> int:
        """State slots the record holds: its own and its ping-pong tracking slots."""
        comp = mamba_state_of(kv)
        return 0 if comp is None else int(comp.slots().numel())


class MambaStateOptions(BaseModel):
    """The state pool's options: the ``mamba`` backend's config and the ``unified`` mamba component take these.

    ``mamba_size`` state slots (default four per request row, six with pages: each request
    then also holds two ping-pong tracking slots), ``mamba_cache_chunk_size`` (where a
    branching snapshot is taken), the state shapes (``mamba_num_layers`` layers, one conv
    state per entry of ``mamba_conv_shapes`` and one temporal state of
    ``mamba_temporal_shape``, in ``mamba_dtype``) and ``mamba_track_interval`` (page_size > 1:
    decode keeps a snapshot every this many tokens).
    """

    mamba_size: int | None = Field(None, description="state slots (default: 4 x max_num_reqs; 6 x with page_size > 1)")
    mamba_cache_chunk_size: int = Field(64, gt=0, description="branching snapshots are floored to this many tokens")
    mamba_num_layers: int = Field(2, gt=0, description="Mamba layers (each keeps one state per slot)")
    mamba_conv_shapes: tuple[tuple[int, ...], ...] = Field(((6, 3),), description="conv state shape(s) per layer")
    mamba_temporal_shape: tuple[int, ...] = Field((2, 4, 4), description="temporal (SSM) state shape per layer")
    mamba_dtype: Literal["float16", "bfloat16", "float32"] = Field("float32", description="state dtype")
    mamba_track_interval: int = Field(
        256, gt=0, description="page_size > 1: decode keeps a state snapshot every this many tokens (SGLang's default)"
    )

    @field_validator("mamba_size")
    @classmethod
    def _check_mamba_size(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"mamba_size must be a positive number of state slots, got {value}")
        return value

    def check_state_options(self, page_size: int) -> None:
        """ValueError naming the option when the state options do not fit ``page_size`` or are not shapes."""
        if page_size > 1 and self.mamba_cache_chunk_size % page_size:
            raise ValueError(
                f"mamba_cache_chunk_size={self.mamba_cache_chunk_size} must be a multiple of page_size="
                f"{page_size}: with pages the state snapshots (SGLang's extra-buffer mode) are taken at "
                "chunk boundaries, which must be page boundaries (SGLang's chunk size is max(model chunk, page))"
            )
        if not self.mamba_conv_shapes or any(not s or min(s) <= 0 for s in self.mamba_conv_shapes):
            raise ValueError(f"mamba_conv_shapes={self.mamba_conv_shapes!r}: give one or more positive shapes")
        if not self.mamba_temporal_shape or min(self.mamba_temporal_shape) <= 0:
            raise ValueError(f"mamba_temporal_shape={self.mamba_temporal_shape!r} must be a positive shape")

    def build_hybrid_req_to_token_pool(self, *, max_num_reqs: int, max_context_len: int, page_size: int,
                                       device: str | torch.device) -> HybridReqToTokenPool:
        """The state pool and the request table over it (extra-buffer mode with pages, SGLang's)."""
        extra = page_size > 1
        size = self.mamba_size if self.mamba_size is not None else (6 if extra else 4) * max_num_reqs
        pool = MambaPool(size, num_layers=self.mamba_num_layers, conv_shapes=self.mamba_conv_shapes,
                         temporal_shape=self.mamba_temporal_shape, dtype=getattr(torch, self.mamba_dtype),
                         device=device)
        return HybridReqToTokenPool(max_num_reqs, max_context_len, device=device, mamba_pool=pool,
                                    extra_buffer=extra)

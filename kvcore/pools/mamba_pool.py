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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.req_to_token import ReqToTokenPool

__all__ = ["COMPONENT", "MambaPool", "MambaState", "MambaReqState", "HybridReqToTokenPool", "mamba_state_of"]

#: The key of the per-request state in ``ReqKvInfo.components``.
COMPONENT = "mamba"


@dataclass(slots=True, eq=False)
class MambaReqState:
    """What a request (or a session slot) holds of the state pool; SGLang's ``ReqKvInfo`` mamba fields.

    ``mamba_pool_idx``: the request's own state slot (a 0-d int64 tensor) or None.
    ``mamba_cow_src_index``: the tree node's slot (a one-slot tensor) whose state must be
    copied into ``mamba_pool_idx`` before the next forward (``match_prefix(cow_mamba=True)``);
    ``mamba_needs_clear``: the slot is fresh and must be zeroed first.  ``mamba_branching_seqlen``:
    the last match's branching point (see ``MambaRadixCache.match_prefix``).
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
    # Set by MambaRadixCache.match_request: the locked node whose state the request
    # copies when HybridReqToTokenPool.alloc gives it its slot (the engine's COW).
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


class HybridReqToTokenPool(ReqToTokenPool):
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

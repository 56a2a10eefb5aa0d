"""The ownership record of a request's device KV, and the request as the cache sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvcore.cache import LockResult

__all__ = ["ReqKvInfo", "Req", "RetractionBackup", "ceil_align", "floor_align"]


def ceil_align(value: int, page_size: int) -> int:
    return -(-value // page_size) * page_size


def floor_align(value: int, page_size: int) -> int:
    return (value // page_size) * page_size


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (a tensor, or lists / tuples / dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


@dataclass(slots=True)
class RetractionBackup:
    """A host copy of a retracted request's device KV (SGLang's ``RetractionBackup``, ``cpu_tensors`` mode).

    ``num_tokens``: the row positions ``[0, num_tokens)`` it covers (``seqlen - 1``).
    ``cpu_tensors``: the K and V of those positions, one ``(k, v)`` pair of host
    tensors per layer, or None when the cache has no K/V buffer (bookkeeping only).
    ``state``: what the cache keeps per request beside its token slots (a
    recurrent state, say), from ``cache.backup_request_state``; None for most backends.
    """

    num_tokens: int
    cpu_tensors: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    state: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes the backup moved from the device (K/V and state)."""
        return _tensor_bytes(self.cpu_tensors) + _tensor_bytes(self.state)


@dataclass(slots=True, kw_only=True)
class ReqKvInfo:
    """Everything a request (or a session slot) owns of the device KV, in one place.

    The request owns ``[cache_protected_len, kv_allocated_len)`` of its req_to_token
    row; the prefix cache owns ``[0, cache_protected_len)``.  Pools, caches and
    sessions read these fields; none of them keeps a second copy.
    """

    # The req_to_token row this record registers; None when it holds no row.
    req_pool_idx: int | None = None
    # The prefix cache owns [0, here): matched or inserted.
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    # [0, here) is never window-evicted (prefill-aware SWA).
    swa_evict_floor: int = 0
    # Window slots in [swa_dead_lo(page), here) were freed while decoding.
    swa_evicted_seqlen: int = 0
    # Backend-specific per-request state (mamba slots, host buffers), keyed by the
    # backend's component name, so a session hand-over moves it with the rest.
    components: dict[str, Any] = field(default_factory=dict)
    # Host-side KV backup the request holds across a retraction (``kvcore.retraction.offload_kv_cache``).
    retraction_backup: RetractionBackup | None = None

    def swa_dead_lo(self, page_size: int) -> int:
        """Lowest position whose window slot this record may free itself."""
        lo = max(self.cache_protected_len, self.swa_evict_floor)
        # Round up only above the tree's part: the tree already owns an aligned prefix.
        if page_size > 1 and lo > self.cache_protected_len:
            lo = ceil_align(lo, page_size)
        return lo

    def check_fields(self, owner: str, page_size: int = 1, row_width: int | None = None, *,
                     windowed: bool = True) -> None:
        """Refuse a record whose lengths a release path or a window free cannot trust; nothing changes.

        The one place that validates a record before kvcore frees through it: every
        length an int (not a bool or a float) and not negative, ``protected <=
        committed <= allocated <= row_width``, and the window cursor not past what
        the request committed (or, under prefill-aware SWA, its page-rounded floor) where
        a window free runs (``windowed``).  TypeError or ValueError naming ``owner`` and
        the field.
        """
        lengths = (
            ("cache_protected_len", self.cache_protected_len),
            ("kv_committed_len", self.kv_committed_len),
            ("kv_allocated_len", self.kv_allocated_len),
            ("swa_evict_floor", self.swa_evict_floor),
            ("swa_evicted_seqlen", self.swa_evicted_seqlen),
        )
        for name, value in lengths:
            if type(value) is not int:
                raise TypeError(f"{owner}: {name}={value!r} is not an int (nothing was changed)")
            if value < 0:
                raise ValueError(f"{owner}: {name}={value} is negative (nothing was changed)")
        if not self.cache_protected_len <= self.kv_committed_len <= self.kv_allocated_len:
            raise ValueError(
                f"{owner}: needs cache_protected_len <= kv_committed_len <= kv_allocated_len, got "
                f"{self.cache_protected_len}, {self.kv_committed_len}, {self.kv_allocated_len} (nothing was changed)"
            )
        if row_width is not None and self.kv_allocated_len > row_width:
            raise ValueError(
                f"{owner}: kv_allocated_len={self.kv_allocated_len} exceeds the row width {row_width} "
                "(nothing was changed)"
            )
        if windowed and self.swa_evicted_seqlen > max(self.kv_committed_len, self.swa_dead_lo(page_size)):
            raise ValueError(
                f"{owner}: the window cursor swa_evicted_seqlen={self.swa_evicted_seqlen} is past what the request "
                f"committed ({self.kv_committed_len}); window slots in between would leak (nothing was changed)"
            )

    @property
    def is_held(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def is_released(self) -> bool:
        return self.kv_allocated_len == 0 and self.swa_evicted_seqlen == 0

    def mark_released(self) -> None:
        self.kv_allocated_len = 0
        self.swa_evicted_seqlen = 0


_EMPTY_INDICES = torch.empty((0,), dtype=torch.int64)


@dataclass(slots=True, eq=False)
class Req:
    """A request as the KV cache sees it.

    ``fill_ids`` is the prompt followed by the generated tokens; ``kv`` is never
    None.  ``lock`` keeps what ``inc_lock_ref`` returned so that ``dec_lock_ref``
    can give exactly that back.
    """

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY_INDICES)
    last_node: Any = None  # a node of the backend's tree (None until matched)
    lock: LockResult | None = None
    extra_key: str | None = None
    session_id: str | None = None
    # Feeds the ``priority`` eviction policy: what this request inserts is kept longer.
    priority: int = 0
    # How often it was retracted (never reset, SGLang's ``retraction_count``) and whether it waits to resume.
    retraction_count: int = 0
    is_retracted: bool = False
    # Outputs past this many are an overshoot (speculative decoding can pass max_new_tokens); None: all count.
    finished_len: int | None = None
    # Reasoning tokens generated; with ``strip_thinking_cache`` only the prompt is cached at finish (SGLang #22373).
    reasoning_tokens: int = 0
    strip_thinking_cache: bool = False

    def __post_init__(self) -> None:
        if self.kv is None:
            raise TypeError(f"Req {self.rid!r}: kv must be a ReqKvInfo, not None")
        self.origin_input_ids = list(self.origin_input_ids)
        self.output_ids = list(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        """The prompt followed by the generated tokens.  Read it, never change it: while nothing
        was generated it is ``origin_input_ids`` itself, so that a chunked prefill's loop
        (``while kv.kv_committed_len < len(req.fill_ids)``) costs nothing per chunk; after that a
        new list (``fill_slice`` reads a range without building it)."""
        if not self.output_ids:
            return self.origin_input_ids
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` (``0 <= start <= end``) without building ``fill_ids``: a chunk costs its length."""
        prompt = self.origin_input_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return prompt[start:] + self.output_ids[: end - n]

    def detach_kv(self) -> ReqKvInfo:
        """Hand the record over (to a session slot) and leave a fresh one behind."""
        kv, self.kv = self.kv, ReqKvInfo()
        return kv

    def effective_kv_committed_len(self) -> int:
        """The committed length the cache keeps at finish; the rest is freed as over-allocation.

        With ``strip_thinking_cache`` and reasoning tokens, only the prompt (SGLang #22373);
        engines with another rule override this.
        """
        if self.strip_thinking_cache and self.reasoning_tokens > 0:
            return min(self.kv.kv_committed_len, len(self.origin_input_ids))
        return self.kv.kv_committed_len

    def reset_for_retract(self) -> None:
        """Forget the match and the committed KV after a retraction (SGLang's ``reset_for_retract``).

        The record must be released first (AssertionError otherwise).  Kept: the
        record itself with ``swa_evict_floor`` (the prefill-aware window floor) and
        ``retraction_backup``, ``output_ids`` and ``retraction_count`` (one more).
        Reset: ``prefix_indices``, ``last_node``, ``lock``, ``cache_protected_len``,
        ``kv_committed_len`` and the backend components the release left behind.
        """
        self.retraction_count += 1
        kv = self.kv
        assert not kv.is_held, f"request {self.rid!r}: reset_for_retract before its KV was released"
        self.prefix_indices = _EMPTY_INDICES
        self.last_node = None
        self.lock = None
        kv.cache_protected_len = 0
        kv.kv_committed_len = 0
        kv.components.clear()
        self.is_retracted = True

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, seqlen={self.seqlen}, kv={self.kv})"

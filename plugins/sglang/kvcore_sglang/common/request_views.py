"""SGLang's ``Req`` and ``ReqKvInfo`` as kvcore's release and tree code reads them, writing through.

Version-neutral: the record fields and request attributes read here (``req_pool_idx``,
``cache_protected_len``, ``kv_committed_len``, ``kv_allocated_len``, ``swa_evict_floor``,
``swa_dead_lo``, ``holds_kv``, ``is_kv_released``, ``mark_kv_released``, the Mamba fields;
``rid``, ``seqlen``, ``extra_key``, ``cache_salt``, ``priority``, ``last_node``) are the same in
SGLang 0.5.19 and 0.5.23.  Where a version differs (0.5.19's ``swa_evicted_seqlen`` field and
``prefix_indices``, 0.5.23's per-component evicted lengths and ``req.lock``), its contract
module's request views override these.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.pools.mamba_pool import COMPONENT as MAMBA
from kvcore.pools.mamba_pool import MambaReqState
from kvcore.record import ReqKvInfo
from kvcore_sglang.common.fill_ids import FillIds, RequestTables, namespace

__all__ = ["KvRecordView", "MambaStateView", "ReqView", "owner_of"]

class KvRecordView:
    """SGLang's ``ReqKvInfo`` under kvcore's names, writing through.

    ``committed`` overrides ``kv_committed_len`` for one call: SGLang hands
    ``cache_finished_req`` the length to cache (``kv_len_to_handle``, which
    ``strip_thinking_cache`` shortens) and caches ``len(fill_ids)`` in
    ``cache_unfinished_req``; kvcore's backends read it from the record.  (kvcore's
    resume points are the tree's own, by row: the record needs no field for them.)
    """

    __slots__ = ("sglang", "_committed")

    def __init__(self, kv: Any, committed: int | None = None):
        self.sglang = kv
        self._committed = committed

    @property
    def req_pool_idx(self) -> int | None:
        return self.sglang.req_pool_idx

    @req_pool_idx.setter
    def req_pool_idx(self, value: int | None) -> None:
        self.sglang.req_pool_idx = value

    @property
    def cache_protected_len(self) -> int:
        return int(self.sglang.cache_protected_len)

    @cache_protected_len.setter
    def cache_protected_len(self, value: int) -> None:
        self.sglang.cache_protected_len = value

    @property
    def kv_committed_len(self) -> int:
        return int(self.sglang.kv_committed_len) if self._committed is None else self._committed

    @property
    def kv_allocated_len(self) -> int:
        return int(self.sglang.kv_allocated_len)

    @property
    def swa_evict_floor(self) -> int:
        return int(self.sglang.swa_evict_floor)

    @property
    def swa_evicted_seqlen(self) -> int:
        return int(self.sglang.swa_evicted_seqlen)

    @swa_evicted_seqlen.setter
    def swa_evicted_seqlen(self, value: int) -> None:
        self.sglang.swa_evicted_seqlen = value

    def swa_dead_lo(self, page_size: int) -> int:
        return int(self.sglang.swa_dead_lo(page_size))

    @property
    def components(self) -> dict[str, Any]:
        """kvcore's per-backend parts of the record: SGLang's record holds the Mamba fields of every request."""
        return {MAMBA: MambaStateView(self.sglang)}

    # kvcore's one check of a record's lengths (BasePrefixCache.check_req), on SGLang's record.
    check_fields = ReqKvInfo.check_fields

    @property
    def is_held(self) -> bool:
        return bool(self.sglang.holds_kv)

    @property
    def is_released(self) -> bool:
        return bool(self.sglang.is_kv_released)

    def mark_released(self) -> None:
        self.sglang.mark_kv_released()


def _record_field(name: str) -> Any:
    """A field of SGLang's ``ReqKvInfo`` under the same name, written through."""
    return property(lambda self: getattr(self.sglang, name), lambda self, value: setattr(self.sglang, name, value),
                    doc=f"SGLang's ``ReqKvInfo.{name}``")


#: A field of kvcore's record that SGLang's does not keep: reads None, writes are dropped.
_NOT_KEPT: Any = property(lambda self: None, lambda self, value: None)


class MambaStateView:
    """The Mamba fields of SGLang's ``ReqKvInfo`` as kvcore's :class:`~kvcore.pools.mamba_pool.MambaReqState`.

    The names are SGLang's (kvcore kept them), written through.  Three of kvcore's fields
    have no SGLang counterpart on the record: ``mamba_branching_seqlen`` lives on the view
    only (SGLang's ``Req`` takes it from the ``MatchResult``); ``mamba_tracked_len`` (kvcore's
    replay of the scheduler's tracking; SGLang's scheduler tracks itself) and ``cow_node``
    (kvcore's own admission; SGLang copies from ``mamba_cow_src_index`` in the forward) are
    not kept.
    """

    __slots__ = ("sglang", "mamba_branching_seqlen")

    mamba_pool_idx = _record_field("mamba_pool_idx")
    mamba_cow_src_index = _record_field("mamba_cow_src_index")
    mamba_needs_clear = _record_field("mamba_needs_clear")
    mamba_ping_pong_track_buffer = _record_field("mamba_ping_pong_track_buffer")
    mamba_next_track_idx = _record_field("mamba_next_track_idx")
    mamba_last_track_idx = _record_field("mamba_last_track_idx")
    mamba_last_track_seqlen = _record_field("mamba_last_track_seqlen")
    mamba_tracked_len = _NOT_KEPT
    cow_node = _NOT_KEPT

    def __init__(self, kv: Any):
        self.sglang = kv
        self.mamba_branching_seqlen: int | None = None

    @property
    def holds_mamba(self) -> bool:
        return bool(self.sglang.holds_mamba)

    slots = MambaReqState.slots
    clear_tracking = MambaReqState.clear_tracking


class ReqView:
    """SGLang's ``Req`` as kvcore's tree code reads it, writing ``last_node`` and ``prefix_indices`` through.

    ``fill_ids`` are the tokens SGLang caches in this call (:class:`FillIds`), as a list made
    on first use: a resumed chunk reads only its own part (``fill_slice``).  kvcore keeps the
    lock and the resume point of a request in the cache's tables (``tables``), not on SGLang's ``Req``.
    """

    __slots__ = ("sglang", "kv", "_fill", "_fill_list", "_locks")

    def __init__(self, req: Any, fill_ids: FillIds, committed: int | None, tables: RequestTables):
        self.sglang = req
        self.kv = KvRecordView(req.kv, committed)
        self._fill = fill_ids
        self._fill_list: list[int] | None = None
        self._locks = tables.locks

    @property
    def fill_ids(self) -> list[int]:
        if self._fill_list is None:
            self._fill_list = self._fill.slice(0, len(self._fill))
        return self._fill_list

    @property
    def rid(self) -> str:
        return self.sglang.rid

    @property
    def seqlen(self) -> int:
        return int(self.sglang.seqlen)

    def fill_slice(self, start: int, end: int) -> list[int]:
        if self._fill_list is not None:
            return self._fill_list[start:end]
        return self._fill.slice(start, end)

    @property
    def extra_key(self) -> Any:
        return namespace(self.sglang.extra_key, self.sglang.cache_salt)

    @property
    def priority(self) -> int:
        return int(self.sglang.priority or 0)

    @property
    def last_node(self) -> Any:
        return self.sglang.last_node

    @last_node.setter
    def last_node(self, node: Any) -> None:
        self.sglang.last_node = node

    @property
    def lock(self) -> Any:
        return self._locks.get(self.sglang)

    @lock.setter
    def lock(self, lock: Any) -> None:
        if lock is None:
            self._locks.pop(self.sglang, None)
        else:
            self._locks[self.sglang] = lock

    @property
    def prefix_indices(self) -> torch.Tensor:
        return self.sglang.prefix_indices

    @prefix_indices.setter
    def prefix_indices(self, value: torch.Tensor) -> None:
        self.sglang.prefix_indices = value


class _Owner:
    """A running SGLang request as :class:`kvcore.InvariantChecker` names and reads it."""

    __slots__ = ("rid", "kv")

    def __init__(self, req: Any, record_view: type[KvRecordView] = KvRecordView):
        self.rid = req.rid
        self.kv = record_view(req.kv)


def owner_of(req: Any, record_view: type[KvRecordView] = KvRecordView) -> Any:
    """``req`` (SGLang's) as an owner for ``kvcore.InvariantChecker(cache.kvcore_cache).check(owners=...)``.

    ``record_view``: how the running SGLang's record reads under kvcore's names.
    """
    return _Owner(req, record_view)

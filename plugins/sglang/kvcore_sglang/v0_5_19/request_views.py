"""SGLang 0.5.19's ``Req`` and ``ReqKvInfo`` as kvcore's release and tree code reads them, writing through.

``is_held`` for ``holds_kv``, the committed length SGLang hands over, the window fields
(``swa_evicted_seqlen``, ``swa_dead_lo``), the Mamba fields, and the window lock SGLang keeps
on the request (``swa_uuid_for_lock``, ``swa_prefix_lock_released``, ``skip_lock_node_ids``).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.unified_cache.component_type import (  # type: ignore[import-not-found,unused-ignore]
    ComponentType,
)

from kvcore.cache import LockResult
from kvcore_sglang.common.request_views import KvRecordView, MambaStateView, ReqView, owner_of

__all__ = ["UNIFIED_SWA_SKIP", "KvRecordView", "MambaStateView", "ReqView", "UnifiedSWAReqView",
           "fill_len", "owner_of", "skip_ids"]


def fill_len(req: Any) -> int:
    """``len(req.get_fill_ids())`` without its copy (0.5.19: ``full_untruncated_fill_ids[:extend_range.end]``)."""
    return min(len(req.full_untruncated_fill_ids), req.extend_range.end)


#: Where kvcore's unified swa component keeps the tombstones its window lock passed over (LockResult.extras).
UNIFIED_SWA_SKIP = "swa_skip"


class UnifiedSWAReqView(ReqView):
    """A request of a hybrid SWA model on SGLang's ``UnifiedRadixCache``: its lock is SGLang's own fields.

    SGLang's scheduler keeps where a request's window lock stopped in
    ``req.swa_uuid_for_lock`` (from ``inc_lock_ref``), the tombstones the window lock passed
    over in ``req.skip_lock_node_ids[ComponentType.SWA]`` (so a tombstone healed since is not
    unlocked) and whether the window part went back early in ``req.swa_prefix_lock_released``
    (``dec_swa_lock_only``); the kvcore lock handed to the tree is made from them (the skipped
    tombstones in its extras, as kvcore's unified swa component keeps them), and a new lock is
    written back to them, so the scheduler's own calls and the cache's agree.
    """

    __slots__ = ()

    @staticmethod
    def lock_from(swa_uuid_for_lock: int | None, skip_lock_node_ids: Any = None,
                  swa_released: bool = False) -> LockResult:
        """The kvcore lock SGLang's lock handle stands for."""
        lock = LockResult(stop=swa_uuid_for_lock)
        if swa_released:
            lock.released_early.add("swa")
        lock.extras[UNIFIED_SWA_SKIP] = set((skip_lock_node_ids or {}).get(ComponentType.SWA, ()))
        return lock

    @staticmethod
    def store(req: Any, lock: LockResult) -> None:
        """Write a new kvcore lock back to SGLang's fields of ``req``."""
        req.swa_uuid_for_lock = lock.stop
        req.skip_lock_node_ids = skip_ids(lock)

    @property
    def lock(self) -> Any:
        req = self.sglang
        if req.last_node is None:
            return None
        return self.lock_from(req.swa_uuid_for_lock, req.skip_lock_node_ids, req.swa_prefix_lock_released)

    @lock.setter
    def lock(self, lock: Any) -> None:
        req = self.sglang
        # SGLang's cache_finished_req / cache_unfinished_req clear the early-release mark.
        req.swa_prefix_lock_released = False
        if lock is not None:
            self.store(req, lock)


def skip_ids(lock: LockResult) -> dict:
    """SGLang's ``skip_lock_node_ids`` of a kvcore unified lock (empty when no tombstone was passed over)."""
    skip = lock.extras.get(UNIFIED_SWA_SKIP)
    return {ComponentType.SWA: set(skip)} if skip else {}

"""SGLang 0.5.23's ``Req`` and ``ReqKvInfo`` as kvcore's release and tree code reads them, writing through.

What changed since 0.5.19: the record keeps evicted lengths per component
(``component_evicted_seqlens``: kvcore's ``swa_evicted_seqlen`` is its SWA entry) and the
request holds its tree lock itself (``req.lock``, a ``TreeLock``); there is no
``prefix_indices`` on the request (SGLang reads the prefix off the tree:
``prefix_device_indices``), so kvcore's writes of it are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found,unused-ignore]
    DecLockRefParams,
    TreeLock,
)
from sglang.srt.mem_cache.unified_cache.component_type import (  # type: ignore[import-not-found,unused-ignore]
    ComponentType,
)

from kvcore_sglang.common.fill_ids import FillIds, RequestTables
from kvcore_sglang.common.request_views import KvRecordView, ReqView
from kvcore_sglang.common.request_views import owner_of as common_owner_of

__all__ = ["KvRecordView023", "KvcoreTreeLock", "ReqView023", "owner_of", "tree_lock"]


@dataclasses.dataclass
class KvcoreTreeLock(TreeLock):
    """SGLang's ``TreeLock`` (what ``req.lock`` holds) carrying the kvcore lock it stands for.

    ``node`` is the node the lock holds (kvcore's lock is always on the request's
    ``last_node``); ``receipt`` stays empty: the kvcore lock is the receipt.
    """

    kvcore: Any = None


def tree_lock(node: Any, lock: Any) -> KvcoreTreeLock:
    """SGLang's lock object for kvcore ``lock`` on ``node``."""
    return KvcoreTreeLock(node, DecLockRefParams(), kvcore=lock)


class KvRecordView023(KvRecordView):
    """SGLang 0.5.23's ``ReqKvInfo`` under kvcore's names: the window cursor is its SWA entry."""

    __slots__ = ()

    @property
    def swa_evicted_seqlen(self) -> int:
        return int(self.sglang.get_evicted_seqlen(ComponentType.SWA))

    @swa_evicted_seqlen.setter
    def swa_evicted_seqlen(self, value: int) -> None:
        self.sglang.set_evicted_seqlen(ComponentType.SWA, value)


class ReqView023(ReqView):
    """SGLang 0.5.23's ``Req`` as kvcore's tree code reads it.

    The lock is ``req.lock`` (a :class:`KvcoreTreeLock` around kvcore's lock); its ``node``
    is set once the call set ``last_node`` (:meth:`settle_lock`).
    """

    __slots__ = ()

    def __init__(self, req: Any, fill_ids: FillIds, committed: int | None, tables: RequestTables):
        super().__init__(req, fill_ids, committed, tables)
        self.kv = KvRecordView023(req.kv, committed)

    @property
    def lock(self) -> Any:
        held = self.sglang.lock
        return None if held is None else held.kvcore

    @lock.setter
    def lock(self, lock: Any) -> None:
        self.sglang.lock = None if lock is None else tree_lock(None, lock)

    def settle_lock(self) -> None:
        """Point the request's new lock at its node (kvcore sets the lock before ``last_node``)."""
        held = self.sglang.lock
        if held is not None and held.node is None:
            held.node = self.sglang.last_node

    @property
    def prefix_indices(self) -> Any:
        return None

    @prefix_indices.setter
    def prefix_indices(self, value: Any) -> None:
        pass


def owner_of(req: Any) -> Any:
    """``req`` (SGLang's) as an owner for ``kvcore.InvariantChecker(cache.kvcore_cache).check(owners=...)``."""
    return common_owner_of(req, KvRecordView023)

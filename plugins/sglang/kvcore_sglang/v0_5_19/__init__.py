"""SGLang 0.5.19's tree-cache contract, met by kvcore backends built on SGLang's own pools.

The contract module :func:`kvcore_sglang.plugin.contract_module` returns for SGLang 0.5.19:
its :func:`build_tree_cache` is the factory behind every kvcore name.  Everything that names
an SGLang 0.5.19 class or field lives in this package; what SGLang 0.5.23 kept lives in
:mod:`kvcore_sglang.common`.

* pool views (:mod:`kvcore_sglang.common.pool_views`): kvcore's pool protocol over SGLang's
  allocator and ``ReqToTokenPool`` objects, holding no state of their own.
* request views (:mod:`.request_views`): SGLang's ``Req`` and ``ReqKvInfo`` as kvcore's
  release and tree code reads them, writing through.
* the tree caches (:mod:`.tree_cache`): SGLang's ``BasePrefixCache`` over one kvcore backend,
  translating SGLang's params and results, lock results and KV events (:mod:`.events`).
* the build (:mod:`.build`): refusals and the factory.
"""

from kvcore_sglang.common.build import STRICT_ENV, UnsupportedContext, strict_slots
from kvcore_sglang.common.fill_ids import NO_IDS, FillIds, MatchedIds, RequestTables, namespace
from kvcore_sglang.common.pool_views import (
    AllocatorView,
    HybridReqToTokenPoolView,
    MambaStatePoolView,
    ReqToTokenPoolView,
    SWAAllocatorView,
)
from kvcore_sglang.v0_5_19.build import build_tree_cache
from kvcore_sglang.v0_5_19.events import EventTranslator, salt_namespace_hash, salt_of
from kvcore_sglang.v0_5_19.request_views import (
    UNIFIED_SWA_SKIP,
    KvRecordView,
    MambaStateView,
    ReqView,
    UnifiedSWAReqView,
    fill_len,
    owner_of,
    skip_ids,
)
from kvcore_sglang.v0_5_19.tree_cache import (
    KvcoreTreeCache,
    KvcoreUnifiedMambaTreeCache,
    KvcoreUnifiedSWATreeCache,
    KvcoreUnifiedTreeCache,
)
from kvcore_sglang.v0_5_19.version import SGLANG_VERSION

__all__ = [
    "NO_IDS",
    "SGLANG_VERSION",
    "STRICT_ENV",
    "UNIFIED_SWA_SKIP",
    "AllocatorView",
    "EventTranslator",
    "FillIds",
    "HybridReqToTokenPoolView",
    "KvRecordView",
    "KvcoreTreeCache",
    "KvcoreUnifiedMambaTreeCache",
    "KvcoreUnifiedSWATreeCache",
    "KvcoreUnifiedTreeCache",
    "MambaStatePoolView",
    "MambaStateView",
    "MatchedIds",
    "ReqToTokenPoolView",
    "ReqView",
    "RequestTables",
    "SWAAllocatorView",
    "UnifiedSWAReqView",
    "UnsupportedContext",
    "build_tree_cache",
    "fill_len",
    "namespace",
    "owner_of",
    "salt_namespace_hash",
    "salt_of",
    "skip_ids",
    "strict_slots",
]

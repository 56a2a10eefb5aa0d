"""SGLang 0.5.23's tree-cache contract, met by kvcore backends built on SGLang's own pools.

The contract module :func:`kvcore_sglang.plugin.contract_module` returns for SGLang 0.5.23:
its :func:`build_tree_cache` is the factory behind every kvcore name.  Everything that names
an SGLang 0.5.23 class or field lives in this package; what SGLang 0.5.19 and 0.5.23 share
lives in :mod:`kvcore_sglang.common`.

* request views (:mod:`.request_views`): 0.5.23's record (evicted lengths per component) and
  its request (the lock on the request, no ``prefix_indices``).
* the tree caches (:mod:`.tree_cache`): ``checkpoint`` / ``lock`` / ``unlock`` /
  ``path_device_indices`` / ``supports_prefix_sharing`` over one kvcore backend, and SGLang's
  own event recorder fed with kvcore's pages (:mod:`.events`).
* the build (:mod:`.build`): what 0.5.23 serves (``kvcore-radix``, ``kvcore-unified`` with component
  ``full``, ``kvcore-chunk`` and declared full-attention names), one error naming the name and the
  version for the rest.
"""

from kvcore_sglang.common.build import STRICT_ENV, UnsupportedContext, strict_slots
from kvcore_sglang.v0_5_23.build import SERVED, build_tree_cache
from kvcore_sglang.v0_5_23.events import EventTranslator
from kvcore_sglang.v0_5_23.request_views import KvcoreTreeLock, KvRecordView023, ReqView023, owner_of
from kvcore_sglang.v0_5_23.tree_cache import KvcoreChunkCache, KvcoreTreeCache, KvcoreUnifiedTreeCache
from kvcore_sglang.v0_5_23.version import SGLANG_VERSION

__all__ = [
    "SERVED",
    "SGLANG_VERSION",
    "STRICT_ENV",
    "EventTranslator",
    "KvRecordView023",
    "KvcoreChunkCache",
    "KvcoreTreeCache",
    "KvcoreTreeLock",
    "KvcoreUnifiedTreeCache",
    "ReqView023",
    "UnsupportedContext",
    "build_tree_cache",
    "owner_of",
    "strict_slots",
]

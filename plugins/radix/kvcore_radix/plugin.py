"""Entry point of kvcore-radix (group ``kvcore``): the ``radix`` backend.

The tree is the core's (:class:`kvcore.tree.unified.UnifiedRadixCache`), built as the
component set ``("full",)`` with SGLang RadixCache's answers (:class:`kvcore_radix.RadixConfig`).
Its eviction policies are the core's (``kvcore.tree.policies``), registered by kvcore itself.
"""

from collections.abc import Callable

from kvcore import hookimpl
from kvcore.tiers import tiered
from kvcore.tree.unified import UnifiedRadixCache
from kvcore.tree.unified_config import require_full_only
from kvcore_radix.config import RadixConfig


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "radix",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=RadixConfig,
        description="Radix-tree prefix cache with page-aligned reuse, locks and pluggable eviction (SGLang RadixCache)",
    )

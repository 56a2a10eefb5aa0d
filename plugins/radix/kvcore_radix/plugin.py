"""Entry point of kvcore-radix (group ``kvcore``): the ``radix`` backend.

Its eviction policies are the core's (``kvcore.tree.policies``), registered by kvcore itself.
"""

from collections.abc import Callable

from kvcore import hookimpl
from kvcore.tiers import tiered
from kvcore_radix.config import RadixConfig
from kvcore_radix.radix_cache import RadixCache


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "radix",
        tiered(RadixCache),
        config=RadixConfig,
        description="Radix-tree prefix cache with page-aligned reuse, locks and pluggable eviction (SGLang RadixCache)",
    )


"""Entry point of kvcore-radix (group ``kvcore``): the ``radix`` backend and the tree eviction policies."""

from kvcore import hookimpl
from kvcore.tree.policies import BUILTIN_POLICIES
from kvcore_radix.config import RadixConfig
from kvcore_radix.radix_cache import RadixCache


@hookimpl
def kvcore_register_backends(register):
    register(
        "radix",
        RadixCache,
        config=RadixConfig,
        description="Radix-tree prefix cache with page-aligned reuse, locks and pluggable eviction (SGLang RadixCache)",
    )


@hookimpl
def kvcore_register_eviction_policies(register):
    for name, factory in BUILTIN_POLICIES.items():
        register(name, factory)

"""Entry point ``example-component`` in group ``kvcore``: the ``stamp`` component and the ``example-component``
backend (the core's tree with components full and stamp)."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore.tiers import tiered
from kvcore.tree.unified import UnifiedRadixCache
from kvcore.tree.unified_config import UnifiedPools, require_full_only
from kvcore_example_component.component import StampComponent, StampOptions
from kvcore_example_component.config import ExampleComponentConfig


@hookimpl
def kvcore_register_components(register: Callable[..., None]) -> None:
    register("stamp", StampComponent, options=StampOptions,
             description="a stamp per request boundary: matches end only there, LRU eviction of stamps")


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "example-component",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=ExampleComponentConfig,
        pools=UnifiedPools(),
        description="The guide's component example: the one tree with components (full, stamp) "
                    "(docs/writing-a-backend.md)",
    )

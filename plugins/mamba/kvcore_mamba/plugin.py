"""Entry point ``mamba`` in group ``kvcore``: registers the ``mamba`` backend."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore_mamba.config import MambaConfig, MambaPools
from kvcore_mamba.mamba_cache import MambaRadixCache


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "mamba",
        MambaRadixCache,
        config=MambaConfig,
        pools=MambaPools(),
        description=(
            "Hybrid full-attention + Mamba radix tree: a state pool, state snapshots per node, mamba "
            "tombstones, two LRU orders, copy-on-write states (SGLang MambaRadixCache)"
        ),
    )

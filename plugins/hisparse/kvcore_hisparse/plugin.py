"""Entry point ``hisparse`` in group ``kvcore``: registers the ``hisparse`` backend."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore_hisparse.cache import HiSparseCache
from kvcore_hisparse.config import HiSparseConfig, HiSparsePools


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "hisparse",
        HiSparseCache,
        config=HiSparseConfig,
        pools=HiSparsePools(),
        description=(
            "Sparse-attention decode with full KV on the host and a small per-request device buffer "
            "(top-k swap-in with a per-layer LRU; SGLang HiSparseCoordinator)"
        ),
        reference="chunk",
    )

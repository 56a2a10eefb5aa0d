"""kvcore-mamba: prefix caching for hybrid full-attention + Mamba (state-space) models.

``mamba``  the core's one tree (:class:`kvcore.tree.unified.UnifiedRadixCache`) with components
(full, mamba), SGLang's UnifiedRadixCache, on a :class:`HybridReqToTokenPool` (a req_to_token
row and a state slot per request) and a :class:`MambaPool` (the states).  This distribution
contributes the ``mamba`` component (:class:`MambaComponent`).
"""

from importlib.metadata import version

from kvcore.pools.mamba_pool import (
    COMPONENT,
    HybridReqToTokenPool,
    MambaPool,
    MambaReqState,
    MambaState,
    mamba_state_of,
)
from kvcore_mamba.component import MambaComponent, MambaOptions
from kvcore_mamba.config import MambaConfig

__version__ = version("kvcore-mamba")

__all__ = [
    "COMPONENT",
    "HybridReqToTokenPool",
    "MambaConfig",
    "MambaPool",
    "MambaComponent",
    "MambaOptions",
    "MambaReqState",
    "MambaState",
    "mamba_state_of",
    "__version__",
]

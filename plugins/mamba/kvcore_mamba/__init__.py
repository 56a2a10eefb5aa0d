"""kvcore-mamba: prefix caching for hybrid full-attention + Mamba (state-space) models.

``mamba``  :class:`MambaRadixCache`, SGLang's MambaRadixCache, on a
:class:`HybridReqToTokenPool` (a req_to_token row and a state slot per request) and a
:class:`MambaPool` (the states).  Built on kvcore's public tree kit, :mod:`kvcore.tree`.
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
from kvcore_mamba.config import MambaConfig
from kvcore_mamba.mamba_cache import MambaRadixCache, MambaTreeNode

__version__ = version("kvcore-mamba")

__all__ = [
    "COMPONENT",
    "HybridReqToTokenPool",
    "MambaConfig",
    "MambaPool",
    "MambaRadixCache",
    "MambaReqState",
    "MambaState",
    "MambaTreeNode",
    "mamba_state_of",
    "__version__",
]

"""The Mamba state pool and the hybrid request table: moved to :mod:`kvcore.pools.mamba_pool` (shared with
the ``unified`` backend's mamba component); re-exported here for compatibility."""

from kvcore.pools.mamba_pool import (
    COMPONENT,
    HybridReqToTokenPool,
    MambaPool,
    MambaReqState,
    MambaState,
    mamba_state_of,
)

__all__ = ["COMPONENT", "MambaPool", "MambaState", "MambaReqState", "HybridReqToTokenPool", "mamba_state_of"]

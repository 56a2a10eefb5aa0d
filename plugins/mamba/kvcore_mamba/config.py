"""Options of the ``mamba`` backend: the state pool and its state shapes."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from kvcore.config import TreeCacheConfig
from kvcore.pool_builder import Placement, PoolBuilder
from kvcore.pools import ReqToTokenPool
from kvcore.pools.mamba_pool import MambaStateOptions

__all__ = ["MambaConfig", "MambaPools"]


class MambaConfig(TreeCacheConfig, MambaStateOptions):
    """Options of the ``mamba`` backend (SGLang's MambaRadixCache).

    On top of the common pool options: ``mamba_size`` state slots (default four per
    request row), ``mamba_cache_chunk_size`` (where a branching state snapshot is
    taken, 64) and the state shapes: ``mamba_num_layers`` Mamba layers, each with one
    conv state per entry of ``mamba_conv_shapes`` and one temporal (SSM) state of
    ``mamba_temporal_shape``, in ``mamba_dtype``.  Small defaults; the bench raises
    them to a real model's.

    ``page_size > 1`` runs SGLang's extra-buffer mode: every request also holds two
    ping-pong tracking slots, prefill keeps a snapshot at chunk boundaries and decode
    one every ``mamba_track_interval`` tokens (rounded to the chunk), and only those
    snapshots go into the tree.  ``mamba_cache_chunk_size`` must then be a multiple of
    ``page_size``.
    """

    eviction_policies = ("lru",)
    policy_backend = "mamba"
    policy_reason = "it keeps two LRU orders, full and state, as SGLang's MambaRadixCache"

    eviction_policy: str = Field("lru", description="'lru' only: the tree keeps two LRU orders (full and state)")

    # The state options (mamba_size, mamba_cache_chunk_size, shapes, mamba_track_interval) are
    # kvcore.pools.mamba_pool.MambaStateOptions, shared with the unified backend's mamba component.

    @field_validator("pre_alloc_size")
    @classmethod
    def _no_pre_alloc(cls, value: int) -> int:
        if value:
            raise ValueError(
                f"pre_alloc_size={value} is not supported by the mamba backend: its rows come from a "
                "HybridReqToTokenPool (one state slot per row) and SGLang's HybridMambaDecodeReqToTokenPool, which "
                "adds rows for pre-allocated requests, is not built; leave pre_alloc_size at 0 and count the "
                "pre-allocated requests in max_num_reqs"
            )
        return value

    @model_validator(mode="after")
    def _check_mamba(self) -> MambaConfig:
        self.check_state_options(self.page_size)
        return self



class MambaPools(PoolBuilder[MambaConfig]):
    """The pools of ``mamba``: rows with a state slot each (HybridReqToTokenPool over a MambaPool)."""

    def req_to_token_pool(self, config: MambaConfig, at: Placement) -> ReqToTokenPool:
        return config.build_hybrid_req_to_token_pool(max_num_reqs=config.max_num_reqs,
                                                     max_context_len=config.max_context_len,
                                                     page_size=config.page_size, device=at.torch_device)

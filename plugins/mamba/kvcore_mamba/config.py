"""Options of the ``mamba`` backend: the state pool and its state shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvcore.config import TreeCacheConfig

__all__ = ["MambaConfig"]


class MambaConfig(TreeCacheConfig):
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

    mamba_size: int | None = Field(None, description="state slots (default: 4 x max_num_reqs; 6 x with page_size > 1)")
    mamba_cache_chunk_size: int = Field(64, gt=0, description="branching snapshots are floored to this many tokens")
    mamba_num_layers: int = Field(2, gt=0, description="Mamba layers (each keeps one state per slot)")
    mamba_conv_shapes: tuple[tuple[int, ...], ...] = Field(((6, 3),), description="conv state shape(s) per layer")
    mamba_temporal_shape: tuple[int, ...] = Field((2, 4, 4), description="temporal (SSM) state shape per layer")
    mamba_dtype: Literal["float16", "bfloat16", "float32"] = Field("float32", description="state dtype")
    mamba_track_interval: int = Field(
        256, gt=0, description="page_size > 1: decode keeps a state snapshot every this many tokens (SGLang's default)"
    )

    @field_validator("mamba_size")
    @classmethod
    def _check_mamba_size(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"mamba_size must be a positive number of state slots, got {value}")
        return value

    @model_validator(mode="after")
    def _check_mamba(self):
        if self.page_size > 1 and self.mamba_cache_chunk_size % self.page_size:
            raise ValueError(
                f"mamba_cache_chunk_size={self.mamba_cache_chunk_size} must be a multiple of page_size="
                f"{self.page_size}: with pages the state snapshots (SGLang's extra-buffer mode) are taken at "
                "chunk boundaries, which must be page boundaries (SGLang's chunk size is max(model chunk, page))"
            )
        if self.eviction_policy != "lru":
            raise ValueError(
                f"eviction_policy={self.eviction_policy!r} is not supported by the mamba backend: it keeps two "
                "LRU orders (full and mamba), so only 'lru' applies"
            )
        if not self.mamba_conv_shapes or any(not s or min(s) <= 0 for s in self.mamba_conv_shapes):
            raise ValueError(f"mamba_conv_shapes={self.mamba_conv_shapes!r}: give one or more positive shapes")
        if not self.mamba_temporal_shape or min(self.mamba_temporal_shape) <= 0:
            raise ValueError(f"mamba_temporal_shape={self.mamba_temporal_shape!r} must be a positive shape")
        return self

    @property
    def mamba_extra_buffer(self) -> bool:
        """SGLang's extra-buffer mode (two ping-pong tracking slots per request): on with page_size > 1."""
        return self.page_size > 1

    @property
    def mamba_pool_size(self) -> int:
        if self.mamba_size is not None:
            return self.mamba_size
        # With pages each request also holds two ping-pong tracking slots.
        return (6 if self.mamba_extra_buffer else 4) * self.max_num_reqs

    def build_mamba_pool(self):
        import torch

        from kvcore.pools.mamba_pool import MambaPool

        return MambaPool(
            self.mamba_pool_size,
            num_layers=self.mamba_num_layers,
            conv_shapes=self.mamba_conv_shapes,
            temporal_shape=self.mamba_temporal_shape,
            dtype=getattr(torch, self.mamba_dtype),
            device=self.device,
        )

    def build_req_to_token_pool(self):
        from kvcore.pools.mamba_pool import HybridReqToTokenPool

        return HybridReqToTokenPool(
            self.max_num_reqs, self.max_context_len, device=self.device, mamba_pool=self.build_mamba_pool(),
            extra_buffer=self.mamba_extra_buffer,
        )

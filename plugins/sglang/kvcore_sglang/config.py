"""The names kvcore-sglang registers with SGLang and what each one serves.

Plain data: reading it imports neither SGLang nor torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ModelKind", "TARGETS", "Target", "SUPPORTED_SGLANG"]

ModelKind = Literal["full", "hybrid-swa", "hybrid-ssm"]

# SGLang versions with a contract module here (kvcore_sglang/v<major>_<minor>_<patch>).
SUPPORTED_SGLANG = ("0.5.19", "0.5.23")


class Target(BaseModel):
    """One ``--radix-cache-backend`` name: the kvcore backend it builds and the model kinds it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the name given to --radix-cache-backend")
    backend: str = Field(description="the kvcore backend built on SGLang's pools")
    serves: tuple[ModelKind, ...] = Field(description="model kinds (TreeCacheBuildContext) it accepts")
    description: str
    builder: str | None = Field(
        default=None, description="'module:function' that builds it from a TreeCacheBuildContext; None: the contract "
        "module of the running SGLang (kvcore_sglang.v0_5_19.build_tree_cache)")


TARGETS: tuple[Target, ...] = (
    Target(name="kvcore-radix", backend="radix", serves=("full",),
           description="kvcore's radix tree (SGLang's RadixCache) for full-attention models"),
    Target(name="kvcore-swa", backend="swa", serves=("hybrid-swa",),
           description="kvcore's one tree with components full + swa (SGLang's UnifiedRadixCache) for hybrid SWA "
           "models, on SGLang's SWATokenToKVPoolAllocator"),
    Target(name="kvcore-mamba", backend="mamba", serves=("hybrid-ssm",),
           description="kvcore's one tree with components full + mamba (SGLang's UnifiedRadixCache) for hybrid "
           "SSM models, on SGLang's HybridReqToTokenPool and MambaPool"),
    Target(name="kvcore-unified", backend="unified", serves=("full", "hybrid-swa", "hybrid-ssm"),
           description="kvcore's unified tree (SGLang's default UnifiedRadixCache): component full for "
           "full-attention models, components full + swa for hybrid SWA models (on SGLang's "
           "SWATokenToKVPoolAllocator), components full + mamba for hybrid SSM models (on SGLang's "
           "HybridReqToTokenPool)"),
    Target(name="kvcore-chunk", backend="chunk", serves=("full",),
           description="no prefix reuse (SGLang's ChunkCache): chunked prefill only"),
)

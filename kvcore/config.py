"""Validated backend options and what a backend factory receives."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from kvcore.pools import MHATokenToKVPool, ReqToTokenPool, TokenAllocator

__all__ = ["CacheConfig", "TreeCacheConfig", "KvBufferConfig", "CacheInitParams", "did_you_mean"]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the known option nearest a misspelt ``name``, or ``""`` when none is near."""
    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {near[0]!r}?" if near else ""


class KvBufferConfig(BaseModel):
    """Shape of the per-layer K/V data buffers (only built when asked for)."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(2, gt=0)
    head_dim: int = Field(64, gt=0)
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"


class CacheConfig(BaseModel):
    """The options every backend takes: the pools it runs on.  Plain data: validating it
    touches no registry and builds nothing (``create_cache`` resolves ``device`` and
    builds the pools, see :mod:`kvcore.pool_builder`).

    A backend with options of its own subclasses this model; ``create_cache``
    validates the caller's keyword arguments against it.  The model is strict, and
    so are its subclasses: a field ``fanout: int = 4`` refuses ``True`` and ``"4"``
    rather than read them as ints, like kvcore's own options (a field that should
    convert its input says ``Field(strict=False)``); unknown options are refused
    (``extra="forbid"``) and a config is frozen.
    """

    # strict: a bool (or "4") is refused rather than read as an int, in every subclass's fields too.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    size: int = Field(65536, gt=0, description="token slots in the KV pool")
    page_size: int = Field(1, gt=0, description="tokens per page")
    max_num_reqs: int = Field(256, gt=0, description="req_to_token rows")
    pre_alloc_size: int = Field(
        0, ge=0, description="disaggregated decode: req_to_token rows for pre-allocated requests on "
        "top of max_num_reqs (a DecodeReqToTokenPool)"
    )
    max_context_len: int = Field(8192, gt=0, description="row width: the longest request in tokens")
    device: str = Field(
        "cpu", description="a registered device kind, with an index where it takes one (cpu, cuda, cuda:N, "
        "a plugin's; `kvcore backends` lists them); create_cache applies its defaults (e.g. page_size) to "
        "options not given"
    )
    kv_buffer: KvBufferConfig | None = Field(None, description="also allocate K/V data buffers of this shape")
    strict: bool = Field(
        True,
        description="validate slots before the cache keeps them (range, allocated, not owned by another node, "
        "no duplicates); False skips these checks for speed",
    )

    @model_validator(mode="after")
    def _check_page_alignment(self) -> CacheConfig:
        if self.size % self.page_size:
            raise ValueError(
                f"size={self.size} is not a multiple of page_size={self.page_size}; "
                f"use a size such as {(self.size // self.page_size + 1) * self.page_size}"
            )
        if self.max_context_len % self.page_size:
            raise ValueError(
                f"max_context_len={self.max_context_len} is not a multiple of page_size={self.page_size}"
            )
        return self


class TreeCacheConfig(CacheConfig):
    """Options of prefix-tree backends.

    ``eviction_policy`` means one thing on every backend: the order its tree evicts
    unlocked leaves in.  A backend whose tree keeps an order of its own (the window
    and state orders of ``swa``, ``mamba``, ``unified``) names the policies it runs in
    ``eviction_policies`` and ``policy_backend``; any other name is refused here, when
    the options are validated, before a pool is built.  With ``eviction_policies``
    None the tree resolves the name among the registered policies when it is built.
    """

    #: The policies (lower case) this backend's tree runs; None: every registered one.
    eviction_policies: ClassVar[tuple[str, ...] | None] = None
    #: The backend named in the refusal, and why it runs only ``eviction_policies``.
    policy_backend: ClassVar[str] = ""
    policy_reason: ClassVar[str] = ""

    eviction_policy: str = Field("lru", description="lru, lfu, fifo, mru, filo, priority, slru or a plugin's")
    enable_kv_events: bool = Field(False, description="record stored/removed page events for take_events()")
    disable: bool = Field(False, description="match nothing, insert nothing")

    @field_validator("eviction_policy")
    @classmethod
    def _check_eviction_policy(cls, value: str) -> str:
        allowed = cls.eviction_policies
        if allowed is not None and value.lower() not in allowed:
            takes = " or ".join(repr(p) for p in allowed)
            why = f" ({cls.policy_reason})" if cls.policy_reason else ""
            raise ValueError(
                f"the {cls.policy_backend or cls.__name__} backend takes eviction_policy {takes} only{why}; "
                f"leave eviction_policy out or set it to {allowed[0]!r}"
            )
        return value


@dataclass(slots=True)
class CacheInitParams:
    """What a backend factory is called with: the built pools and the validated config.

    ``create_cache`` builds them with the backend's :class:`kvcore.pool_builder.PoolBuilder`;
    ``kv_pool`` is the K/V data buffer, None unless the ``kv_buffer`` option asked for one.
    """

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenAllocator
    page_size: int
    config: CacheConfig
    kv_pool: MHATokenToKVPool | None = None

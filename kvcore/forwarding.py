"""``ForwardingCache``: a cache that hands every protocol call to the backend it wraps.

A wrapper that subclasses :class:`~kvcore.cache.BasePrefixCache` and forwards
through ``__getattr__`` silently answers with the base class's defaults for
every name the base defines (``__getattr__`` only fires for names it lacks):
the backend's ``sanity_check`` or ``make_room`` would never run.  So this class
forwards the whole protocol explicitly, one method each: the core calls, the
backend's declared ``capabilities`` and the calls of every capability protocol
(:mod:`kvcore.capabilities`), so one wrapper serves every capability set.
``tests/test_forwarding.py`` checks that no public name of ``BasePrefixCache``
and no protocol call is left to inheritance or to ``__getattr__``.  A wrapper
(``StreamingSession``) subclasses it and overrides only what it changes.

``__getattr__`` still reads through for backend-specific names outside the
protocol (``sliding_window_size``, ``mamba_pool``, ``full_evictable_size``):
those have no base default that could shadow them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.keys import KeyLike

if TYPE_CHECKING:
    from kvcore.capabilities import Capability, SparseCache, StatefulCache, WindowedCache, WindowLockRelease
    from kvcore.pools.views import PoolView
    from kvcore.record import Req, ReqKvInfo

__all__ = ["ForwardingCache"]


class ForwardingCache(BasePrefixCache[Any]):
    """Forwards every :class:`BasePrefixCache` call, attribute and capability to ``inner``."""

    def __init__(self, inner: BasePrefixCache) -> None:
        self.inner = inner
        # The backend's pools: a backend never swaps them after it is built.
        self.req_to_token_pool = inner.req_to_token_pool
        self.token_to_kv_pool_allocator = inner.token_to_kv_pool_allocator
        self.page_size = inner.page_size
        self.kv_pool = inner.kv_pool
        # Lifecycle calls reach the backend's own hook (its extension wrappers run once, there).
        self.hook = None
        self.plugin_manager = None

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling, a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- what the backend declares -----------------------------------------
    @property
    def backend_name(self) -> str:  # type: ignore[override]
        return self.inner.backend_name

    @property
    def disable(self) -> bool:  # type: ignore[override]
        return self.inner.disable

    @property
    def strict(self) -> bool:  # type: ignore[override]
        return self.inner.strict

    @property
    def session_page_aligned(self) -> bool:  # type: ignore[override]
        return self.inner.session_page_aligned

    @property
    def capabilities(self) -> frozenset[Capability]:  # type: ignore[override]
        return self.inner.capabilities

    @property
    def root_node(self) -> Any:
        return self.inner.root_node

    # -- lookups and updates -------------------------------------------------
    def match_prefix(self, key: KeyLike, *args: Any, **kwargs: Any) -> MatchResult:
        return self.inner.match_prefix(key, *args, **kwargs)

    def match_request(self, req: Req, key: KeyLike) -> MatchResult:
        return self.inner.match_request(req, key)

    def insert(self, key: KeyLike, value: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> InsertResult:
        return self.inner.insert(key, value, *args, **kwargs)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        self.inner.cache_finished_req(req, is_insert)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        self.inner.cache_unfinished_req(req, chunked)

    def evict(self, num_tokens: int, *args: Any, **kwargs: Any) -> EvictResult:
        return self.inner.evict(num_tokens, *args, **kwargs)

    def make_room(self, num_tokens: int) -> EvictResult:
        return self.inner.make_room(num_tokens)

    def evicting(self, values: Sequence[torch.Tensor]) -> None:
        self.inner.evicting(values)

    def inc_lock_ref(self, node: Any) -> LockResult:
        return self.inner.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any, lock: LockResult | None = None) -> LockResult:
        return self.inner.dec_lock_ref(node, lock)

    def check_req(self, req: Req, what: str) -> None:
        self.inner.check_req(req, what)

    def check_req_lock(self, req: Req, what: str) -> None:
        self.inner.check_req_lock(req, what)

    def release_req_lock(self, req: Req) -> None:
        self.inner.release_req_lock(req)

    def check_node_locked(self, node: Any, what: str) -> None:
        self.inner.check_node_locked(node, what)

    # -- sizes ---------------------------------------------------------------
    def evictable_size(self) -> int:
        return self.inner.evictable_size()

    def protected_size(self) -> int:
        return self.inner.protected_size()

    def total_size(self) -> int:
        return self.inner.total_size()

    def reset(self) -> None:
        self.inner.reset()

    def take_events(self) -> list:
        return self.inner.take_events()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def pretty_print(self, file: Any = None) -> None:
        self.inner.pretty_print(file)

    def format_tree(self) -> str:
        return self.inner.format_tree()

    # -- traits --------------------------------------------------------------
    def is_chunk_cache(self) -> bool:
        return self.inner.is_chunk_cache()

    # -- pools by name -------------------------------------------------------
    def pools(self) -> list[PoolView]:
        return self.inner.pools()

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        return self.inner.cached_sizes()

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        return self.inner.iter_owned_slots()

    def sanity_check(self) -> None:
        self.inner.sanity_check()

    def session_slots(self) -> list[Any]:
        return self.inner.session_slots()

    def rebase_on_match(self, req: Req, match: MatchResult, committed: int) -> int:
        return self.inner.rebase_on_match(req, match, committed)

    # -- the capabilities' calls (kvcore.capabilities): forwarded whatever the backend declares; callers reach
    # them only through the accessors, which read the forwarded declaration.
    def dec_swa_lock_only(self, node: Any, lock: LockResult | None = None) -> LockResult:
        return cast("WindowLockRelease", self.inner).dec_swa_lock_only(node, lock)

    def backup_request_state(self, req: Req) -> Any:
        return cast("StatefulCache", self.inner).backup_request_state(req)

    def restore_request_state(self, req: Req, state: Any) -> None:
        cast("StatefulCache", self.inner).restore_request_state(req, state)

    def request_state_slots(self, kv: ReqKvInfo) -> int:
        return cast("StatefulCache", self.inner).request_state_slots(kv)

    def free_window_slots(self, reqs: Sequence[Req], pre_lens: Sequence[int] | None = None) -> int:
        return cast("WindowedCache", self.inner).free_window_slots(reqs, pre_lens)

    def sparse_top_k(self) -> int:
        return cast("SparseCache", self.inner).sparse_top_k()

    def on_decode_step(self, reqs: Sequence[Req], selections: torch.Tensor) -> Any:
        return cast("SparseCache", self.inner).on_decode_step(reqs, selections)

    # -- release -------------------------------------------------------------
    def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None:
        self.inner.free_kv_row(kv, ranges)

"""The interface every prefix-cache backend implements, and the results it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import torch

from kvcore.capabilities import Capability
from kvcore.keys import KeyLike

if TYPE_CHECKING:
    from kvcore.config import CacheConfig, CacheInitParams
    from kvcore.pools.req_to_token import ReqToTokenPool
    from kvcore.pools.views import PoolView, TokenAllocator
    from kvcore.record import Req, ReqKvInfo

__all__ = [
    "BasePrefixCache",
    "NodeT",
    "MatchResult",
    "InsertResult",
    "EvictResult",
    "LockResult",
    "SlotOwner",
]


class MatchResult(NamedTuple):
    """What ``match_prefix`` found: the cached slots of the longest cached prefix."""

    device_indices: torch.Tensor
    last_device_node: Any = None
    # Backend extras; -1 / None when the backend has no such notion.
    best_match_node: Any = None
    cache_protected_len: int | None = None
    extras: dict | None = None

    @property
    def prefix_len(self) -> int:
        return int(self.device_indices.numel())

    @property
    def mamba_branching_seqlen(self) -> int | None:
        """Where a recurrent-state backend's match could branch a state (SGLang's name); None elsewhere."""
        return self.extras.get("mamba_branching_seqlen") if self.extras else None


@dataclass(slots=True)
class InsertResult:
    """What ``insert`` did: ``prefix_len`` tokens of the key were cached already.

    ``duplicates_freed`` is True when ``insert`` itself freed the caller's slots
    of that already-cached part (SGLang's SWA tree does); otherwise they are the
    caller's to free.  ``mamba_exist`` (recurrent-state backends): the tree already
    held a state at the key's end, so the caller keeps (frees) the one it offered.
    """

    prefix_len: int
    last_device_node: Any = None
    duplicates_freed: bool = False
    mamba_exist: bool = False


@dataclass(slots=True)
class EvictResult:
    """What ``evict`` freed: full-pool tokens, window tokens, states, and every component's count.

    ``by_component`` (component trees such as ``unified``) maps each component
    name to what it freed; None for backends without components.
    """

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0
    by_component: dict | None = None


@dataclass(slots=True)
class LockResult:
    """What ``inc_lock_ref`` took; hand it back to ``dec_lock_ref``.

    ``delta`` is the change in protected tokens; ``stop`` marks where a lock with
    a limited scope stopped (a window lock covers only the last window's nodes),
    so the unlock stops at the same node.  ``extras`` holds the backend's own
    per-component deltas and scopes (``swa_delta``, ``swa_tokens``, ...).

    ``released`` says that ``dec_lock_ref`` took this lock back; ``released_early``
    names the components given back before the rest (``dec_swa_lock_only``: ``"swa"``).
    Every backend refuses a lock given back twice (:meth:`check_not_released`).
    """

    delta: int = 0
    stop: Any = None
    extras: dict = field(default_factory=dict)
    released: bool = False
    released_early: set[str] = field(default_factory=set)

    @property
    def swa_released(self) -> bool:
        """The window part went back early (``dec_swa_lock_only``); the full part is still held."""
        return "swa" in self.released_early

    def check_not_released(self, what: str, node: Any) -> None:
        """The one rule for a lock given back twice: ValueError, before anything changes."""
        if self.released:
            raise ValueError(f"{what}: this lock on {node!r} was already given back (nothing was changed)")


class SlotOwner(NamedTuple):
    """A set of slots in one pool (by ``PoolView.name``) that one owner (a tree node) holds."""

    pool: str
    owner: str
    slots: torch.Tensor


#: A backend's node type: ``BasePrefixCache[UnifiedNode]`` takes and returns its own nodes in the lock calls.
NodeT = TypeVar("NodeT")


class BasePrefixCache(ABC, Generic[NodeT]):
    """A prefix cache over a req_to_token pool and a token-slot allocator, generic in its node type.

    Built backends expose ``req_to_token_pool``, ``token_to_kv_pool_allocator`` and
    ``page_size``.  The per-step calls (match, insert, evict, locks) are plain
    methods; the two lifecycle calls also go through ``self.hook`` so that
    extension plugins can wrap them (see ``kvcore.hookspecs``).
    """

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenAllocator
    page_size: int
    config: CacheConfig
    # The K/V data buffer built from the ``kv_buffer`` option (CacheInitParams.kv_pool), if any.
    kv_pool: Any = None
    # ``disable``: match nothing, insert nothing (SGLang's flag); ``strict``: every bad input refused
    # before anything changes (slot ownership checked on insert).
    disable: bool = False
    strict: bool = True
    # What the cache can do beyond the core calls (kvcore.capabilities): declared, never probed; the
    # accessors there (windowed(cache), stateful(cache), ...) return the cache typed as the capability's protocol.
    capabilities: frozenset[Capability] = frozenset()
    # The tree's root node (SGLang's ``root_node``, for a scheduler's DFS over ``children``); None without a tree.
    root_node: Any = None
    # Set by create_cache: the registered name, this cache's own plugin manager and its hook relay.
    backend_name: str = ""
    plugin_manager: Any = None
    hook: Any = None
    # Set by create_cache from the device its pools were built for (DeviceSpec.page_aligned_sessions):
    # a StreamingSession then reuses only whole pages of a finished turn (SGLang's NPU rule).
    session_page_aligned: bool = False

    def __init__(self, params: CacheInitParams) -> None:
        """Take the built pools, the page size and the validated config from ``params``.

        Every backend's constructor starts here (``super().__init__(params)``), so the
        pools an engine allocates from are the ones the cache frees to.
        """
        self.config = params.config
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.kv_pool = params.kv_pool
        self.page_size = int(params.page_size)
        self.strict = bool(params.config.strict)

    # -- lookups and updates ------------------------------------------------

    @abstractmethod
    def match_prefix(self, key: KeyLike) -> MatchResult: ...

    def match_request(self, req: Req, key: KeyLike) -> MatchResult:
        """``match_prefix`` for admitting ``req``: what ``kvcore.Engine`` calls.

        Backends that take per-request state when a request is admitted (Mamba's
        copy-on-write state slot, recorded in ``req.kv.components``) override this;
        the default is a plain ``match_prefix(key)``.
        """
        return self.match_prefix(key)

    @abstractmethod
    def insert(self, key: KeyLike, value: torch.Tensor | None = None) -> InsertResult: ...

    @abstractmethod
    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Hand a finished request's committed KV to the cache and drop its lock.

        Frees what the cache does not keep, except the over-allocation past the
        page-aligned committed length, which ``release_kv_cache`` frees.
        """

    @abstractmethod
    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Cache ``fill_ids[:kv_committed_len]`` of a request still running."""

    @abstractmethod
    def evict(self, num_tokens: int) -> EvictResult: ...

    def make_room(self, num_tokens: int) -> EvictResult:
        """Evict just enough that ``num_tokens`` new token slots fit in every pool a new token uses.

        Backends whose tokens take slots in more than one pool override this with
        each pool's shortfall.
        """
        short = num_tokens - self.token_to_kv_pool_allocator.available_size()
        return self.evict(short) if short > 0 else EvictResult()

    def evicting(self, values: Sequence[torch.Tensor]) -> None:
        """What ``evict`` is about to free: the device slots of the nodes it evicted, in eviction order.

        A backend that declares ``Capability.EVICTION_REPORTS`` calls it once per ``evict`` that
        evicted anything, after the nodes left the tree and before their slots go back
        to the allocator, so the K/V bytes at ``values`` are still the evicted pages'.
        It must not change the tree or the pools.  The default does nothing; the tiers'
        write-back policy (:mod:`kvcore.tiers`) copies the pages to the host tier here.
        """

    @abstractmethod
    def inc_lock_ref(self, node: NodeT) -> LockResult: ...

    @abstractmethod
    def dec_lock_ref(self, node: NodeT, lock: LockResult | None = None) -> LockResult: ...

    # -- the request's lock: one rule for every backend ---------------------

    def check_node_locked(self, node: NodeT, what: str) -> None:
        """Raise (TypeError for a foreign node, ValueError for an unlocked one) unless ``node`` is a
        node of this cache whose path a request's lock holds.  Tree backends override it; the
        default (a cache without nodes) accepts anything."""

    def check_req(self, req: Req, what: str) -> None:
        """Refuse a lifecycle call the request's state does not fit, before anything changes.

        ``cache_finished_req`` and ``cache_unfinished_req`` of every backend start here:
        the record must hold a row this cache's pool handed out (not released already,
        not another cache's), its lengths must be sound (``ReqKvInfo.check_fields``),
        and its lock must still be held (``check_req_lock``).
        """
        kv = req.kv
        pool = self.req_to_token_pool
        if pool is None:  # a tree-only cache (no pools): the caller owns rows and slots
            return
        if not pool.holds(kv):
            state = "holds no req_to_token row (released already, or never admitted)" if not kv.is_held else (
                f"holds row {kv.req_pool_idx}, which this cache's pool did not hand to it (another cache's?)")
            raise ValueError(f"{what}: request {req.rid!r} {state}; nothing was changed")
        kv.check_fields(f"{what}: request {req.rid!r}", self.page_size, pool.max_context_len,
                        windowed=Capability.WINDOWED in self.capabilities)
        self.check_req_lock(req, what)

    def check_req_lock(self, req: Req, what: str) -> None:
        """Refuse ``req`` before anything changes when its lock went back already (a ``dec_lock_ref``
        by hand) or its node is not locked in this cache.  ``cache_finished_req`` and
        ``cache_unfinished_req`` call it first."""
        node = req.last_node
        if node is None or self.disable:
            return
        lock = req.lock
        if lock is not None and lock.released:
            raise ValueError(
                f"{what}: request {req.rid!r}'s lock on {node!r} was already given back (a dec_lock_ref by hand?); "
                "nothing was changed"
            )
        self.check_node_locked(node, what)

    def release_req_lock(self, req: Req) -> None:
        """Give back ``req``'s lock (``dec_lock_ref(req.last_node, req.lock)``) and clear both fields.

        A tree that keeps resume points (``kvcore.tree.resume``) drops the request's here too.
        """
        node = req.last_node
        if node is not None:
            self.dec_lock_ref(node, req.lock)
        req.last_node = None
        req.lock = None

    # -- sizes --------------------------------------------------------------

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def reset(self) -> None:
        """Drop every cached entry (and free its slots)."""

    def format_tree(self) -> str:
        """The cache's structure as text, one node a line (tree backends override it)."""
        return f"<{type(self).__name__}: evictable={self.evictable_size()} protected={self.protected_size()}>"

    def pretty_print(self, file: Any = None) -> None:
        """Print ``format_tree()`` (to ``file``, default stdout), as SGLang's ``pretty_print`` does."""
        print(self.format_tree(), file=file)

    def take_events(self) -> list:
        return []

    def stats(self) -> dict[str, int]:
        """Backend counters worth a row in the bench report (copies made, tokens swapped in, ...)."""
        return {}

    # -- traits -------------------------------------------------------------

    def is_chunk_cache(self) -> bool:
        """True for caches without prefix reuse (SGLang's ChunkCache family)."""
        return False

    # -- pools by name: what the checker, the bench and the engine read ------

    def pools(self) -> list[PoolView]:
        """Every pool this cache runs on; a backend with a pool of its own kind appends its view."""
        return self.token_to_kv_pool_allocator.pool_views()

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        """Per pool name: the (evictable, protected) slots the cache itself holds."""
        return {"full": (self.evictable_size(), self.protected_size())}

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        """Every slot the cache itself holds, by pool and owning node."""
        return iter(())

    def sanity_check(self) -> None:
        """Recount the backend's own structures and raise AssertionError on a mismatch.

        ``InvariantChecker`` calls it after the pool checks; the default checks nothing.
        """

    def session_slots(self) -> list[Any]:
        """Records the cache keeps alive between requests (a streaming session's slots); none by default."""
        return []

    def rebase_on_match(self, req: Req, match: MatchResult, committed: int) -> int:
        """Point a running request at the tree's copy of its prefix, after ``cache_unfinished_req`` inserted it.

        Writes the matched slots into the row above ``cache_protected_len``, moves the
        request's lock from its old node to the match's node, sets ``prefix_indices``
        (the tree's slots, then the row up to ``committed``) and the new protected
        length, which it returns.  For backends whose lock is one plain path lock.
        """
        kv = req.kv
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        new_indices, new_last = match.device_indices, match.last_device_node
        new_len = int(new_indices.numel())
        protected = kv.cache_protected_len
        if new_len > protected:
            row[protected:new_len] = new_indices[protected:].to(row.dtype)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node, req.lock)
        req.lock = self.inc_lock_ref(new_last)
        req.last_node = new_last
        if new_len < committed:
            req.prefix_indices = torch.cat([new_indices, row[new_len:committed].to(torch.int64)])
        else:
            req.prefix_indices = new_indices
        kv.cache_protected_len = new_len
        return new_len

    # -- release ------------------------------------------------------------

    def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None:
        """Give back ascending, disjoint ``[start, end)`` position ranges of ``kv``'s row.

        One call frees a page shared by two ranges once.
        """
        assert kv.req_pool_idx is not None, "free_kv_row on a record that holds no row"
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        self.token_to_kv_pool_allocator.free_row_segments(
            [(row[s:e].to(torch.int64), s) for s, e in ranges if e > s],
            swa_evicted_seqlen=kv.swa_evicted_seqlen,
            swa_dead_lo=kv.swa_dead_lo(self.page_size),
        )

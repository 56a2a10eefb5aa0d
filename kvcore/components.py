"""Tree components: what one kind of per-token state adds to a shared radix tree.

The core's one tree (:mod:`kvcore.tree.unified`, SGLang 0.5.19's ``UnifiedRadixCache``)
lets *components* say what each node holds: full-attention KV slots (``full``, always
first, registered by kvcore itself), sliding-window slots (``swa``, from kvcore-swa),
recurrent-state slots (``mamba``, from kvcore-mamba), or a third party's kind.  The
backends ``radix`` (kvcore-radix: ``full`` alone, with SGLang RadixCache's answers),
``swa`` (kvcore-swa), ``mamba`` (kvcore-mamba) and ``unified`` (kvcore-unified, any
registered set) are component sets of that tree.  A distribution adds a kind with the
``kvcore_register_components`` hook::

    @kvcore.hookimpl
    def kvcore_register_components(register):
        register("sidecar", SidecarComponent, options=SidecarOptions, description="...")

and a cache built with ``create_cache("unified", components=("full", "sidecar"), ...)``
runs it, as does a backend name of the distribution's own: a
:class:`kvcore.tree.unified_config.UnifiedConfig` subclass whose ``component_set`` is
``("full", "sidecar")``.  ``full``, ``swa`` and ``mamba`` register through the same hook;
``examples/kvcore-example-component`` is a complete third-party component with its backend.

The component interface (:class:`TreeComponent`)
=================================================

A component is a class; the cache builds one instance per cache with
``factory(cache, options)``, where ``options`` is the validated instance of the
component's ``options`` model (pydantic, ``extra="forbid"``; None when it has none).
Its options are also options of ``create_cache("unified", ...)``: the backend's
config is the union of its components' fields, each validated by its own model.

**Value or tombstone per node.**  Every node carries, per component, a *value* (the
component's slots for the node's tokens, or one state slot for the whole node) or
None -- a *tombstone*: the node stays in the tree but this component holds nothing
there.  The component keeps its per-node fields on the node as attributes named in
``node_fields`` (name -> initial value, set on every new node; use a prefix unique to
the component).  ``has_value(node)`` says whether the node holds this component's
data, ``value_len(node)`` how many of the component's pool units it holds.  Only
``full`` decides whether a node exists: a node with a full value may hold no
auxiliary value (a *stateless* node, kept even as a leaf).

**Lock scope.**  ``lock(node, lock)`` / ``unlock(node, lock)`` take and give back this
component's share of a request lock (:class:`kvcore.LockResult`; the component keeps
what it needs to undo the lock in ``lock.extras[name]``).  Full locks the whole path
to the root, SWA the nodes holding the last window of tokens (stopping at a marker),
Mamba only the node itself.  A node locked by any component is not an evictable leaf.

**Match validator.**  ``validator()`` returns a fresh, stateful predicate called on
every node of a match walk, root to leaf; the match ends at the deepest node where
every component's predicate said True (all predicates are called on every node).

**Insert consumption.**  On each node an insert walks through,
``on_insert_overlap(node, prefix_len, total_prefix_len, value_slice, ins)`` returns
the index into ``value_slice`` from which the component took the caller's slots
(``prefix_len``: it took none); the tree frees the caller's duplicates
``value_slice[max(0, prev_prefix_len - total_prefix_len) : min(consumed)]``.
``on_insert_commit(node, is_new_leaf, ins)`` stores the component's value on the
insert's last node (SWA: its in-window part; Mamba: the request's state).

**Resumed inserts.**  A running request's next chunk is inserted from its locked node
(:mod:`kvcore.tree.resume`) with the same hook calls as a walk from the root: the
locked path's nodes (all below ``ins.prev_prefix_len``) still get ``touch`` and
``on_insert_overlap``, with ``value_slice`` a view of the request's row (the node's own
slots there), and the re-match runs ``validator()`` over the path's nodes from the root.

**Eviction order.**  Each component has an eviction *priority* on an internal node
(``internal_priority``: Full 2, SWA 1, Mamba 0); on a leaf every priority is 0.
``evict(target, tracker)`` runs the component's own eviction walk until
``tracker[name] >= target``: it may drop its own value from internal nodes
(``cache.drop_value(node, self, tracker)``, which also drops the components of lower
priority on that node that hold no lock) and hands unlocked leaves (``node in
cache.leaves``) to ``cache.delete_leaf(node, tracker)``, which drops every component
of the leaf.  One shared ``tracker`` counts what each component lost, whoever
triggered it; ``cache.evict`` runs the components in order (full first) and skips one
whose target earlier cascades already met.  A leaf left with only its full value stays.

**Pool accounting.**  ``evictable_size()`` / ``protected_size()`` count the component's
units held by unlocked / locked nodes (``cached_sizes()`` of the cache reports them
under ``pool``), ``owned_slots(node)`` yields the node's :class:`kvcore.SlotOwner` s for
the invariant checker, ``free_value(node)`` returns the node's units to the pool and
``on_split(upper, child)`` divides the node's data when a node is cut in two.

**Requests.**  ``prepare_insert(req, ins, finished)`` fills the insert's arguments from
the request (SWA: ``swa_evicted_seqlen``; Mamba: the state slot to donate) and may cut
the insert; ``after_cache_req`` settles what the request still holds afterwards.

**Surface.**  ``cache_attrs()`` names what the component adds to the cache
(``<name>_evictable_size()``, ``sliding_window_size``, ``mamba_pool``, ...),
``pool_views()`` its own pools, ``build_allocator`` / ``build_req_to_token_pool`` the
pools the cache must be built on, ``check_options`` cross-checks its options.

The other hooks (``touch``, ``after_match``, ``after_insert``, ``finish_match``,
``on_match_request``, ``check_insert``, ``before_insert``, ``check``, ``check_totals``,
``stats``, ``request_state_slots``, ``backup_request_state``) have do-nothing defaults; see each docstring.
``examples/kvcore-example-component`` (component ``stamp``) is a complete third-party one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from kvcore.capabilities import Capability
from kvcore.errors import PluginError
from kvcore.registrar import Kind, Origin, PluginFailure, first_doc_line

if TYPE_CHECKING:
    from kvcore.cache import LockResult, SlotOwner
    from kvcore.pool_builder import Placement
    from kvcore.tree.unified import UnifiedNode, UnifiedRadixCache

__all__ = [
    "COMPONENTS",
    "ComponentSpec",
    "TreeComponent",
    "available_components",
    "component_failures",
    "get_component",
    "reset_components",
]


class TreeComponent:
    """Base of tree components (see the module docstring for the contract)."""

    #: The registered name (``"full"``, ``"swa"``, ...).
    name: ClassVar[str] = ""
    #: The pydantic model of this component's options (``extra="forbid"``), or None.
    options: ClassVar[type[BaseModel] | None] = None
    #: Eviction priority on an internal node (higher is evicted later); 0 on a leaf.
    internal_priority: ClassVar[int] = 0
    #: The pool this component's sizes are reported under in ``cached_sizes()``.
    pool: ClassVar[str] = ""
    #: Per-node attributes (name -> initial value) the tree sets on every new node.
    node_fields: ClassVar[dict[str, Any]] = {}
    #: What the component gives the cache beyond the core calls (``kvcore.capabilities``): the cache declares the
    #: union of its components'.  ``WINDOWED``: the component has a ``window`` (tokens) that ``free_window_slots``
    #: frees behind; ``WINDOW_LOCK_RELEASE``: ``dec_swa_lock_only`` gives back its lock (``release_window``);
    #: ``REQUEST_STATE``: its ``request_state_slots``/``backup_request_state``/``restore_request_state`` answer.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    # -- options and pools (called on the class: while the config is validated; when its pools are built) --
    @staticmethod
    def check_options(config: Any, opts: Any) -> None:
        """Cross-check the component's validated options against the cache's (``size``, ``page_size``, ...)."""

    @staticmethod
    def build_allocator(config: Any, opts: Any, at: Placement) -> Any:
        """The token allocator the cache needs for this component on placement ``at``, or None (the default one)."""
        return None

    @staticmethod
    def build_req_to_token_pool(config: Any, opts: Any, at: Placement) -> Any:
        """The request table the cache needs for this component on placement ``at``, or None (the default one)."""
        return None

    def __init__(self, cache: UnifiedRadixCache, options: BaseModel | None) -> None:
        self.cache = cache
        self.opts = options

    # -- per node -------------------------------------------------------------------
    def has_value(self, node: UnifiedNode) -> bool:
        raise NotImplementedError

    def value_len(self, node: UnifiedNode) -> int:
        raise NotImplementedError

    def owned_slots(self, node: UnifiedNode) -> Iterator[SlotOwner]:
        return iter(())

    def free_value(self, node: UnifiedNode) -> int:
        """Return ``node``'s units to the pool and make it a tombstone; the units freed."""
        raise NotImplementedError

    def on_split(self, upper: UnifiedNode, child: UnifiedNode) -> None:
        """``child`` was cut: ``upper`` holds its first ``len(upper.key)`` tokens.

        A component that keeps an LRU order follows the tree's ``split_recency`` option
        (``cache.split_keeps_recency``): False (SGLang 0.5.19) puts both parts at the front,
        ``child`` first; True (SGLang 0.5.23) leaves ``child`` where it was and puts ``upper``
        right behind it.  :class:`kvcore.tree.value_component.LRUValueComponent` does it in
        ``requeue_split(upper, child)``.
        """

    # -- match ----------------------------------------------------------------------
    def validator(self) -> Callable[[Any], bool]:
        return self.has_value

    def touch(self, node: UnifiedNode) -> None:
        """An insert walked through ``node`` (recency)."""

    def after_match(self, node: UnifiedNode) -> None:
        """A match ended at ``node`` (recency of the matched path)."""

    def after_insert(self, node: UnifiedNode) -> None:
        """An insert ended at ``node`` (recency)."""

    def finish_match(self, result: Any, cow: bool, req: Any) -> Any:
        """After a match: add to ``result`` (Mamba: the branching point, the copy-on-write state slot)."""
        return result

    def on_match_request(self, req: Any, result: Any) -> None:
        """The engine's admission match of ``req`` (Mamba: remember which state the request copies)."""

    # -- insert ---------------------------------------------------------------------
    def check_insert(self, n: int, ins: Any) -> None:
        """Before a direct ``insert`` changes anything: raise ValueError on arguments this component refuses."""

    def before_insert(self, value: Any, ins: Any) -> None:
        """A direct ``insert`` is about to walk (SWA: releases the window slots below the cursor)."""

    def prepare_insert(self, req: Any, ins: Any, finished: bool) -> int | None:
        """Before a request's insert: fill ``ins``; return a length to cut the insert to, or None."""
        return None

    def on_insert_overlap(self, node: UnifiedNode, prefix_len: int, total_prefix_len: int, value_slice: Any,
                          ins: Any) -> int:
        return prefix_len

    def on_insert_commit(self, node: UnifiedNode, is_new_leaf: bool, ins: Any) -> None:
        pass

    def after_cache_req(self, req: Any, finished: bool, ins: Any, result: Any) -> None:
        """After a request's insert and lock release (Mamba frees the request's forked state)."""

    # -- locks ----------------------------------------------------------------------
    def lock(self, node: UnifiedNode, lock: LockResult) -> None:
        raise NotImplementedError

    def unlock(self, node: UnifiedNode, lock: LockResult | None) -> None:
        raise NotImplementedError

    def lock_ref(self, node: UnifiedNode) -> int:
        raise NotImplementedError

    # -- eviction -------------------------------------------------------------------
    def evict(self, target: int, tracker: dict[str, int]) -> None:
        raise NotImplementedError

    # -- sizes ----------------------------------------------------------------------
    def evictable_size(self) -> int:
        raise NotImplementedError

    def protected_size(self) -> int:
        raise NotImplementedError

    def reset_state(self) -> None:
        """The tree was (re)built empty: reset the component's lists and counters."""

    def request_state_slots(self, kv: Any) -> int:
        """Slots of the component's own pool a request record holds (Mamba: its state slots); 0 by default."""
        return 0

    def backup_request_state(self, req: Any) -> Any:
        """A host copy of what the request holds in the component's own pool, for a retraction
        (``BasePrefixCache.backup_request_state``; Mamba: its state slot); None by default."""
        return None

    def restore_request_state(self, req: Any, state: Any) -> None:
        """Write a ``backup_request_state`` copy into what the request holds now."""
        raise NotImplementedError(f"component {self.name!r} keeps no per-request state to restore")

    def stats(self) -> dict[str, int]:
        """Counters for ``cache.stats()`` (Mamba: ``cow_copies``)."""
        return {}

    def pool_views(self) -> list[Any]:
        """Views of pools of the component's own (not the token allocator's), for ``cache.pools()``."""
        return []

    def cache_attrs(self) -> dict[str, Any]:
        """Attributes the component adds to the cache (default: ``<name>_evictable_size``,
        ``<name>_protected_size`` and ``<name>_total_size``, as methods)."""
        return {
            f"{self.name}_evictable_size": self.evictable_size,
            f"{self.name}_protected_size": self.protected_size,
            f"{self.name}_total_size": lambda: self.evictable_size() + self.protected_size(),
        }

    def check(self, node: UnifiedNode) -> None:
        """``sanity_check``: assert this component's invariants on ``node``."""

    def check_totals(self, root: Any) -> None:
        """``sanity_check``: recount the component's sizes over the tree under ``root``."""


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    name: str
    factory: Callable[..., TreeComponent]
    options: type[BaseModel] | None
    description: str
    distribution: str
    plugin: str


def _make_component(
    origin: Origin,
    name: str,
    factory: Callable[..., TreeComponent],
    *,
    options: type[BaseModel] | None = None,
    description: str = "",
) -> ComponentSpec:
    """One ``register(name, factory, ...)`` call of ``kvcore_register_components``, checked."""
    if not name.isidentifier():
        raise PluginError(f"component name must be an identifier, got {name!r}")
    if not callable(factory):
        raise PluginError(f"component {name!r}: factory {factory!r} is not callable")
    if options is not None and not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise PluginError(f"component {name!r}: options must be a pydantic model, got {options!r}")
    return ComponentSpec(name, factory, options, description or first_doc_line(factory), origin.distribution,
                         origin.plugin)


COMPONENTS: Kind[ComponentSpec] = Kind(
    "component", "kvcore_register_components", _make_component, error=ValueError,
    unknown="unknown component {name!r}; registered components: {known} "
    "(a distribution adds one with the kvcore_register_components hook)",
)


def reset_components() -> None:
    """Forget the registered components (the next lookup collects them again)."""
    COMPONENTS.reset()


def available_components() -> dict[str, ComponentSpec]:
    """Every registered component kind by name."""
    return COMPONENTS.all()


def component_failures() -> list[PluginFailure]:
    """Component registrations that were refused, and why."""
    return COMPONENTS.failures()


def get_component(name: str) -> ComponentSpec:
    """The spec of component ``name``; ValueError lists the registered ones."""
    return COMPONENTS.get(name)

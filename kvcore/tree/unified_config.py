"""Options of the one tree (``unified`` and every component set): the components, plus the union of their options."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from kvcore.components import TreeComponent, get_component
from kvcore.config import did_you_mean
from kvcore.pool_builder import Placement, PoolBuilder
from kvcore.pools import ReqToTokenPool, TokenAllocator
from kvcore.tiers import TieredCacheConfig

__all__ = ["RadixTreeConfig", "UnifiedConfig", "UnifiedPools", "require_full_only"]


class UnifiedConfig(TieredCacheConfig):
    """Options of ``unified``: ``components`` (``full`` first), the tree's options and each component's.

    A component's options (``sliding_window_size`` and ``swa_size`` for ``swa``, ...) are
    accepted only when that component is in ``components``, and are validated by its own
    model; anything else is refused, naming what the chosen components take.
    """

    # The components' options arrive as extra fields; the validator below checks each one.
    model_config = ConfigDict(extra="allow", frozen=True)

    #: A backend that is one component set (``swa``, ``mamba``) names it here: ``components`` must be it.
    component_set: ClassVar[tuple[str, ...] | None] = None
    #: Whose answers the tree gives: ``"unified"`` (SGLang's UnifiedRadixCache) or ``"radix"`` (SGLang's
    #: RadixCache, for the full-only set: see :class:`RadixTreeConfig`).
    semantics: ClassVar[str] = "unified"
    #: Options of the tree itself that a preset declares as fields (not a component's).
    tree_options: ClassVar[tuple[str, ...]] = ()

    eviction_policies: ClassVar[tuple[str, ...] | None] = ("lru",)
    policy_backend = "unified"
    policy_reason = "each component keeps its own LRU order, as SGLang's UnifiedRadixCache"

    eviction_policy: str = Field("lru", description="'lru' only: each component keeps its own LRU order")
    components: tuple[str, ...] = Field(("full",), description="tree components, full first: full, swa, mamba, ...")
    split_recency: Literal["refresh", "keep"] = Field(
        "refresh",
        description="a split node's place in each component's LRU: refresh (SGLang 0.5.19's UnifiedRadixCache): "
        "both parts become the most recently used; keep (SGLang 0.5.23's): the lower part keeps its place "
        "and the upper part goes right behind it",
    )

    _component_options: dict[str, Any] = PrivateAttr(default_factory=dict)

    @field_validator("components", mode="before")
    @classmethod
    def _check_components(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, (tuple, list)) or not value or not all(isinstance(v, str) for v in value):
            raise ValueError(f"components must be a non-empty tuple of component names, got {value!r}")
        value = tuple(value)
        if value[0] != "full":
            raise ValueError(f"components={value!r}: the first component must be 'full' (it decides which nodes exist)")
        if len(set(value)) != len(value):
            raise ValueError(f"components={value!r} names a component twice")
        for name in value:
            get_component(name)  # ValueError listing the registered ones
        return value

    @model_validator(mode="after")
    def _check_component_options(self) -> UnifiedConfig:
        fixed = type(self).component_set
        if fixed is not None and tuple(self.components) != fixed:
            raise ValueError(
                f"{self.policy_backend} is the component set {fixed!r}, got components={tuple(self.components)!r}; "
                "build the unified backend for another set"
            )
        extra = dict(self.model_extra or {})
        # A preset (unified-swa, ...) declares its components' options as fields: those the caller set
        # are checked like any other component option (the rest take the component's defaults).
        for k in self.model_fields_set:
            if k not in UnifiedConfig.model_fields and k not in self.tree_options:
                extra[k] = getattr(self, k)
        taken: dict[str, Any] = {}
        for name in self.components:
            spec = get_component(name)
            model = spec.options
            if model is None:
                taken[name] = None
                continue
            mine = {k: extra.pop(k) for k in list(extra) if k in model.model_fields}
            try:
                opts = model(**mine)
            except ValidationError as exc:
                parts = []
                for err in exc.errors():
                    field = ".".join(str(p) for p in err["loc"])
                    msg = err["msg"].removeprefix("Value error, ")
                    parts.append(f"option {field!r} of component {name!r}: {msg}" if field else msg)
                raise ValueError("; ".join(parts)) from None
            cls = spec.factory
            if isinstance(cls, type) and issubclass(cls, TreeComponent):
                cls.check_options(self, opts)
            taken[name] = opts
        if extra:
            offered = sorted(
                f for n in self.components if (m := get_component(n).options) is not None for f in m.model_fields
            )
            bad = ", ".join(repr(k) + self._hint(k, offered) for k in sorted(extra))
            raise ValueError(
                f"unknown option(s) {bad} for components {self.components!r}; their own options are "
                f"{', '.join(offered) or 'none'} (add the component that takes an option to `components`)"
            )
        self._component_options = taken
        return self

    @classmethod
    def _hint(cls, key: str, offered: list[str]) -> str:
        """Which registered component takes ``key``, or the option nearest a misspelt one."""
        from kvcore.components import available_components

        owners = [n for n, spec in available_components().items()
                  if spec.options is not None and key in spec.options.model_fields]
        if owners:
            return f" (an option of component {owners[0]!r})"
        near = did_you_mean(key, [*offered, *cls.model_fields])
        return f" ({near.removeprefix('; ')})" if near else ""

    def component_options(self, name: str) -> Any:
        """The validated options instance of component ``name`` (None if it takes none)."""
        return self._component_options.get(name)


class RadixTreeConfig(UnifiedConfig):
    """The component set ``("full",)`` with SGLang RadixCache's answers (what the ``radix`` backend builds).

    Where they differ from UnifiedRadixCache's (``unified`` with ``components=("full",)``):
    every registered ``eviction_policy``; the cache's ``clock`` (``time.monotonic``,
    replaceable per cache) read once per call, every node a call touches or creates
    getting that one reading (a split's upper half: created then, the lower half's
    access time); an insert leaves the caller's duplicates to the caller
    (``InsertResult.duplicates_freed`` False) and counts a hit on its new leaf;
    ``insert(key)`` with no value takes the token ids as the values; ``key_validation``;
    ``reset`` refused while a node is locked; evicted pages given back as one segment.
    Built without an allocator (``token_to_kv_pool_allocator=None``) the tree is
    tree-only, as SGLang builds its RadixCache in its unit tests: the values are the
    caller's, ``strict`` is off, ``pools()`` is empty and evict/reset only drop them.
    """

    # Its one component takes no option: anything else is refused as by any backend's config.
    model_config = ConfigDict(extra="forbid", frozen=True)

    component_set = ("full",)
    semantics = "radix"
    tree_options = ("key_validation",)
    eviction_policies = None
    policy_backend = "radix"
    policy_reason = ""

    eviction_policy: str = Field("lru", description="lru, lfu, fifo, mru, filo, priority, slru or a plugin's")
    split_recency: Literal["refresh"] = Field(
        "refresh", description="refresh only: RadixCache keeps no component LRU for a split to keep a place in")
    key_validation: Literal["full", "stored"] = Field(
        "full",
        description="full: every key is checked (TypeError/ValueError on bad ids); "
        "stored: only ids the tree stores are checked, match_prefix skips the unmatched tail (faster)",
    )


class UnifiedPools(PoolBuilder[UnifiedConfig]):
    """The pools of ``unified``: each component may ask for its own allocator or request table
    (``TreeComponent.build_allocator`` / ``build_req_to_token_pool``); the last one asked wins."""

    def _components(self, config: UnifiedConfig) -> list[tuple[type[TreeComponent], Any]]:
        out = []
        for name in config.components:
            cls = get_component(name).factory
            if isinstance(cls, type) and issubclass(cls, TreeComponent):
                out.append((cls, config.component_options(name)))
        return out

    def allocator(self, config: UnifiedConfig, at: Placement) -> TokenAllocator:
        built = [cls.build_allocator(config, opts, at) for cls, opts in self._components(config)]
        mine = [b for b in built if b is not None]
        return mine[-1] if mine else super().allocator(config, at)

    def req_to_token_pool(self, config: UnifiedConfig, at: Placement) -> ReqToTokenPool:
        built = [cls.build_req_to_token_pool(config, opts, at) for cls, opts in self._components(config)]
        mine = [b for b in built if b is not None]
        return mine[-1] if mine else super().req_to_token_pool(config, at)


def require_full_only(params: Any) -> None:
    """The host tier and the store hold full-attention pages: refuse them on any other component set."""
    # Window and state components have no such page.
    components = tuple(params.config.components)
    if components != ("full",):
        raise ValueError(f"host_size and store need components=('full',), got {components!r}")

"""SGLang 0.5.19's ``UnifiedRadixCache`` (Python TreeCore) loaded on CPU, ready to drive.

    from tools.sglang_unified_shim import load_sglang_unified
    sg = load_sglang_unified()                      # ImportError without a source tree
    alloc = sg.make_swa_allocator(size=256, size_swa=64, page_size=1)
    cache = sg.make_unified_cache(("full", "swa"), alloc, sg.make_req_to_token_pool(8, 512), page_size=1, window=8)

Built on :mod:`tools.sglang_swa_shim` and, with ``mamba=True``, :mod:`tools.sglang_mamba_shim`.
On top of them this only:

* executes ``mem_cache/unified_radix_cache.py`` and ``mem_cache/unified_cache/**`` from
  SGLang's source as real modules (HiCache, storage, metrics and sessions stay stubs);
* gives ``msgspec`` (not a kvcore dependency) a dataclass-backed ``Struct`` when the real
  package is missing: the unified tree only uses it for plain records;
* makes the stubbed ``StreamingSession`` answer "not a session node" (None), and the
  tree-core backend env var read "python" (SGLang's default);
* answers the Mamba component's server-args lookups with the chunk size the caller picks
  and no per-path state cap.

Nothing of SGLang is copied into this repository; the source tree is read at run time.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import sys
import types
from typing import Any

from tools.sglang_loader import Stub, default_src
from tools.sglang_mamba_shim import load_sglang_mamba
from tools.sglang_swa_shim import load_sglang_swa

__all__ = ["load_sglang_unified", "default_src"]

REAL = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.unified_cache",
    "sglang.srt.mem_cache.unified_cache.cache_action",
    "sglang.srt.mem_cache.unified_cache.component_type",
    "sglang.srt.mem_cache.unified_cache.session_ref_tracker",
    "sglang.srt.mem_cache.unified_cache.tree_core_registry",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core_interface",
    "sglang.srt.mem_cache.unified_cache.components",
    "sglang.srt.mem_cache.unified_cache.components.tree_component",
    "sglang.srt.mem_cache.unified_cache.components.full_component",
    "sglang.srt.mem_cache.unified_cache.components.swa_component",
    "sglang.srt.mem_cache.unified_cache.components.mamba_component",
)


def _msgspec_stand_in() -> types.ModuleType:
    """``msgspec.Struct`` as a dataclass (positional fields, mutable defaults copied)."""
    mod = types.ModuleType("msgspec")

    class Struct:
        def __init_subclass__(cls, frozen: bool = False, kw_only: bool = False, **kw: Any) -> None:
            super().__init_subclass__()
            for name, default in list(vars(cls).items()):
                if name in cls.__dict__.get("__annotations__", {}) and isinstance(default, (list, dict, set)):
                    setattr(cls, name, dataclasses.field(default_factory=lambda d=default: type(d)(d)))
            dataclasses.dataclass(cls, frozen=frozen, kw_only=kw_only, eq=False)

    def field(*, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
              name: Any = None) -> Any:
        return dataclasses.field(default=default, default_factory=default_factory)

    mod.Struct = Struct  # type: ignore[attr-defined]
    mod.field = field  # type: ignore[attr-defined]
    return mod


class _NoSession:
    """The stubbed session layer: every ``try_*`` answers "not a session request" (None)."""

    def __init__(self, inner: Any = None, **kw: Any):
        self.inner = inner
        self.slots: dict = {}

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        if item.startswith("try_"):
            return lambda *a, **k: None
        return Stub(f"session.{item}")


class _Envs(Stub):
    """The runtime env vars (stubs, falsy), but the tree-core backend reads SGLang's default."""

    def __getattr__(self, item: str) -> Any:
        if item == "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND":
            return types.SimpleNamespace(get=lambda: "python")
        return super().__getattr__(item)


def load_sglang_unified(src: str | None = None, *, mamba: bool = False) -> types.SimpleNamespace:
    """The sliding-window (and with ``mamba``, Mamba) namespace plus SGLang's ``UnifiedRadixCache``."""
    if "msgspec" not in sys.modules and importlib.util.find_spec("msgspec") is None:
        sys.modules["msgspec"] = _msgspec_stand_in()
    base = load_sglang_mamba(src, real=REAL) if mamba else load_sglang_swa(src, real=REAL)
    imp = importlib.import_module
    imp("sglang.srt.session.streaming_session").StreamingSession = _NoSession
    urc = imp("sglang.srt.mem_cache.unified_radix_cache")
    urc.StreamingSession = _NoSession
    urc.envs = _Envs("envs")
    comps = imp("sglang.srt.mem_cache.unified_cache.components")
    CT = comps.ComponentType
    chunk = {"size": 64}
    mc = imp("sglang.srt.mem_cache.unified_cache.components.mamba_component")
    mc.mamba_cache_chunk_size = lambda: chunk["size"]
    mc.mamba_checkpoint_grid = lambda page: math.lcm(chunk["size"], page)
    mc.get_exec = lambda: types.SimpleNamespace(mamba=types.SimpleNamespace(mamba_max_states_per_path=-1))
    kinds = {"full": CT.FULL, "swa": CT.SWA, "mamba": CT.MAMBA}

    def make_unified_cache(components: tuple[str, ...], alloc: Any, rtp: Any, page_size: int,
                           window: int | None = None, chunk_size: int = 64, **extra: Any) -> Any:
        chunk["size"] = chunk_size
        params = base.CacheInitParams(
            disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page_size,
            sliding_window_size=window, tree_components=tuple(kinds[c] for c in components), **extra)
        return urc.UnifiedRadixCache(params)

    ns = types.SimpleNamespace(**vars(base))
    ns.unified_radix_cache = urc
    ns.UnifiedRadixCache = urc.UnifiedRadixCache
    ns.ComponentType = CT
    ns.tree_component = imp("sglang.srt.mem_cache.unified_cache.components.tree_component")
    ns.tree_core = imp("sglang.srt.mem_cache.unified_cache.unified_tree_core")
    ns.make_unified_cache = make_unified_cache
    return ns


if __name__ == "__main__":  # pragma: no cover - smoke check: python -m tools.sglang_unified_shim [SRC]
    sg = load_sglang_unified(sys.argv[1] if len(sys.argv) > 1 else None)
    alloc = sg.make_swa_allocator(64, 32, 1)
    c = sg.make_unified_cache(("full", "swa"), alloc, sg.make_req_to_token_pool(4, 64), 1, window=4)
    v = alloc.alloc(6)
    print(c.insert(sg.InsertParams(key=sg.RadixKey([1, 2, 3, 4, 5, 6]), value=v)))
    print(c.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey([1, 2, 3, 4, 5, 9]))).device_indices)

"""SGLang 0.5.19's ``UnifiedRadixCache`` (Python TreeCore) loaded on CPU, ready to drive.

    from tools.sglang_unified_shim import load_sglang_unified
    sg = load_sglang_unified()                      # ImportError without a source tree
    alloc = sg.make_swa_allocator(size=256, size_swa=64, page_size=1)
    cache = sg.make_cache(("full", "swa"), alloc, sg.make_req_to_token_pool(8, 512), page_size=1, window=8)

Built on :mod:`tools.sglang_swa_shim` (the common loader, CPU allocator kernels, SGLang's
``ReqKvInfo``) and, for Mamba, :mod:`tools.sglang_mamba_shim`.  On top of them this only:

* executes ``mem_cache/unified_radix_cache.py`` and ``mem_cache/unified_cache/**`` from
  SGLang's source as real modules (HiCache, storage, metrics and sessions stay stubs);
* gives ``msgspec`` (not a kvcore dependency) a dataclass-backed ``Struct`` when the real
  package is missing: the unified tree only uses it for plain records;
* makes the stubbed ``StreamingSession`` answer "not a session node" (None), and the
  tree-core backend env var read "python" (SGLang's default).

Nothing of SGLang is copied into this repository; the source tree is read at run time.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import sys
import types
from typing import Any

__all__ = ["load_sglang_unified", "default_src"]

_UNIFIED = [
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
]


def _load_tool(name: str):
    try:
        return importlib.import_module(f"tools.{name}")
    except ImportError:
        if f"_kvcore_{name}" in sys.modules:  # the copy the other shims loaded
            return sys.modules[f"_kvcore_{name}"]
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_kvcore_{name}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def default_src() -> str | None:
    return _load_tool("sglang_shim").default_src()


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

    def field(*, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING, name=None):
        return dataclasses.field(default=default, default_factory=default_factory)

    mod.Struct = Struct  # type: ignore[attr-defined]
    mod.field = field  # type: ignore[attr-defined]
    return mod


def load_sglang_unified(src: str | None = None, *, mamba: bool = False) -> types.SimpleNamespace:
    common = _load_tool("sglang_shim")
    for name in _UNIFIED:
        common._REAL.add(name)
    try:
        import msgspec  # noqa: F401
    except ImportError:
        sys.modules["msgspec"] = _msgspec_stand_in()
    if mamba:
        base = _load_tool("sglang_mamba_shim").load_sglang_mamba(src)
        swa = base.swa
    else:
        base = _load_tool("sglang_swa_shim").load_sglang_swa(src)
        swa = base
    imp = importlib.import_module
    common = _load_tool("sglang_shim")
    ss = imp("sglang.srt.session.streaming_session")

    class NoSession:
        def __init__(self, inner=None, **kw):
            self.inner = inner
            self.slots: dict = {}

        def __getattr__(self, item):
            if item.startswith("__"):
                raise AttributeError(item)
            if item.startswith("try_"):
                return lambda *a, **k: None
            return common.Stub(f"session.{item}")

    ss.StreamingSession = NoSession
    urc = imp("sglang.srt.mem_cache.unified_radix_cache")
    urc.StreamingSession = NoSession
    stub = common.Stub

    class Envs(stub):
        """The runtime env vars (stubs, falsy), but the tree-core backend reads SGLang's default."""

        def __getattr__(self, item):
            if item == "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND":
                return types.SimpleNamespace(get=lambda: "python")
            return super().__getattr__(item)

    urc.envs = Envs("envs")
    comps = imp("sglang.srt.mem_cache.unified_cache.components")
    tc = imp("sglang.srt.mem_cache.unified_cache.components.tree_component")
    core = imp("sglang.srt.mem_cache.unified_cache.unified_tree_core")
    CT = comps.ComponentType
    chunk = {"size": 64}
    mc = imp("sglang.srt.mem_cache.unified_cache.components.mamba_component")
    # Server-args lookups (stubs here): the chunk size the caller picks, no per-path state cap.
    mc.mamba_cache_chunk_size = lambda: chunk["size"]
    mc.mamba_checkpoint_grid = lambda page: math.lcm(chunk["size"], page)
    mc.get_exec = lambda: types.SimpleNamespace(mamba=types.SimpleNamespace(mamba_max_states_per_path=-1))
    kinds = {"full": CT.FULL, "swa": CT.SWA, "mamba": CT.MAMBA}
    sg = base.base if hasattr(base, "base") else base

    def make_cache(components, alloc, rtp, page_size: int, window: int | None = None, chunk_size: int = 64,
                   **extra):
        chunk["size"] = chunk_size
        params = sg.CacheInitParams(
            disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=page_size,
            sliding_window_size=window, tree_components=tuple(kinds[c] for c in components), **extra)
        return urc.UnifiedRadixCache(params)

    ns = types.SimpleNamespace(**vars(base))
    ns.update = None
    ns.unified_radix_cache = urc
    ns.UnifiedRadixCache = urc.UnifiedRadixCache
    ns.ComponentType = CT
    ns.tree_component = tc
    ns.tree_core = core
    ns.make_cache = make_cache
    ns.swa_shim = swa
    for name in ("MatchPrefixParams", "InsertParams", "EvictParams", "DecLockRefParams", "RadixKey",
                 "CacheInitParams"):
        if not hasattr(ns, name):
            setattr(ns, name, getattr(sg, name))
    if mamba:
        ns.make_swa_allocator = None
    if not hasattr(ns, "make_swa_allocator") and hasattr(base, "make_allocator") and not mamba:
        ns.make_swa_allocator = base.make_allocator
    return ns


if __name__ == "__main__":  # pragma: no cover - smoke check
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    sg = load_sglang_unified(sys.argv[1] if len(sys.argv) > 1 else None)
    alloc = sg.make_swa_allocator(64, 32, 1)
    c = sg.make_cache(("full", "swa"), alloc, sg.make_req_to_token_pool(4, 64), 1, window=4)
    v = alloc.alloc(6)
    print(c.insert(sg.InsertParams(key=sg.RadixKey([1, 2, 3, 4, 5, 6]), value=v)))
    print(c.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey([1, 2, 3, 4, 5, 9]))).device_indices)
    print(torch.__version__)

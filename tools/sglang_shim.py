"""Load SGLang's own ``srt/mem_cache`` classes from an unpacked source tree, heavy deps stubbed.

    from tools.sglang_shim import load_sglang
    sg = load_sglang("/tmp/sgl/src")      # types.SimpleNamespace
    cache = sg.RadixCache.create_simulated(page_size=4)

Everything under ``sglang.srt.mem_cache`` that the caches and allocators need is
SGLang's real code, imported from ``src``.  Modules outside that package
(kernels, metrics, runtime context, KV-event transport, ``sglang.srt.utils``) are
replaced by permissive stubs, except for the handful of small helpers the
allocators really call (``get_num_new_pages``, ``next_power_of_2``), which are
lifted verbatim from SGLang's own ``utils/common.py`` by AST.  ``memory_pool.py``
(triton, CUDA kernels) is not imported: its ``ReqToTokenPool`` class is lifted
from the file the same way.  Nothing is copied into this repository.

``load_sglang`` purges any earlier ``sglang`` modules from ``sys.modules`` and
installs a fresh set, so calling it twice is fine; the returned namespace holds:

    radix_cache, base_prefix_cache, evict_policy, allocator, swa_allocator, utils  (modules)
    RadixCache, RadixKey, TreeNode, ReqToTokenPool, TokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, MatchPrefixParams,
    InsertParams, EvictParams, DecLockRefParams, CacheInitParams, BaseSWAKVPool, ...
    make_swa_kvpool()   -> a buffer-less BaseSWAKVPool for SWATokenToKVPoolAllocator

The paged allocator's Triton kernels are replaced by CPU emulations (see
``_install_cpu_kernels``); everything else in the allocators is SGLang's code.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

__all__ = ["load_sglang", "default_src", "Stub"]

# Real modules (relative to sglang.srt.mem_cache) that are executed from SGLang's source.
_REAL = {
    "sglang.srt.mem_cache",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.events",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.allocator.base",
    "sglang.srt.mem_cache.allocator.token",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.allocator.swa",
    "sglang.srt.mem_cache.base_swa_memory_pool",
    "sglang.srt.mem_cache.swa_radix_cache",
    "sglang.srt.mem_cache.chunk_cache",
}


def default_src() -> str | None:
    """``$KVCORE_SGLANG_SRC``, else ``/tmp/sgl/src`` if it holds ``sglang/``; None otherwise."""
    src = os.environ.get("KVCORE_SGLANG_SRC") or "/tmp/sgl/src"
    return src if os.path.isdir(os.path.join(src, "sglang", "srt", "mem_cache")) else None


class Stub:
    """Permissive placeholder: any attribute, call, subscript, base-class use or iteration works.

    Falsy, so ``if is_hip():`` / ``if envs.X.get():`` take the plain-CPU branch.
    """

    def __init__(self, name: str = "stub"):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, item: str) -> Stub:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return Stub(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Used as a decorator (@triton.jit, @torch.compile-likes): hand the function back.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], Stub):
            return args[0]
        return Stub(f"{self._name}()")

    def __mro_entries__(self, bases):
        return (object,)

    def __getitem__(self, item):
        return Stub(f"{self._name}[]")

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self) -> str:
        return f"<Stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return Stub(f"{self.__name__}.{item}")


def _lift(path: str, names: Iterable[str], namespace: dict) -> dict:
    """Exec the top-level ``def``/``class`` named ``names`` from ``path`` into ``namespace``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    wanted = set(names)
    body = [n for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    missing = wanted - {n.name for n in body}
    if missing:
        raise ImportError(f"{path}: no top-level {sorted(missing)}")
    mod = ast.Module(body=body, type_ignores=[])
    exec(compile(mod, path, "exec"), namespace)
    return namespace


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src: str):
        self.src = src

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in _REAL:
            rel = fullname.replace(".", os.sep)
            pkg = os.path.join(self.src, rel)
            if os.path.isdir(pkg) and not os.path.exists(os.path.join(pkg, "__init__.py")):
                spec = importlib.machinery.ModuleSpec(fullname, self, is_package=True)
                spec.submodule_search_locations = [pkg]
                return spec
            if os.path.isdir(pkg):
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
            return importlib.util.spec_from_file_location(fullname, pkg + ".py")
        is_pkg = os.path.isdir(os.path.join(self.src, fullname.replace(".", os.sep))) or fullname.count(".") < 3
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)

    def create_module(self, spec):
        if spec.name in _REAL:  # namespace package (no __init__.py): a plain, empty package
            mod = types.ModuleType(spec.name)
            mod.__path__ = list(spec.submodule_search_locations)
            return mod
        mod = _StubModule(spec.name)
        if spec.submodule_search_locations is not None:
            mod.__path__ = []
        return mod

    def exec_module(self, module):
        if module.__name__ in _REAL:
            return
        _fill_stub(module, self.src)


def _fill_stub(module: types.ModuleType, src: str) -> None:
    """Give a few stubbed modules the real (or plain-CPU) values SGLang's pool code reads."""
    name = module.__name__
    common = os.path.join(src, "sglang", "srt", "utils", "common.py")
    if name in ("sglang.srt.utils", "sglang.srt.utils.common"):
        ns = module.__dict__
        ns.setdefault("torch", __import__("torch"))
        _lift(common, ["get_num_new_pages", "next_power_of_2"], ns)
        ns["is_hip"] = ns["is_npu"] = ns["is_cuda"] = ns["is_cpu"] = lambda: False
        ns["get_bool_env_var"] = lambda name, default="false": (
            os.environ.get(name, default).strip().lower() in ("1", "true"))
    elif name == "sglang.srt.mem_cache.memory_pool":
        ns = module.__dict__
        from typing import Any as _Any
        from typing import Optional

        import torch
        ns.update(torch=torch, Any=_Any, List=list, Optional=Optional,
                  GPU_MEMORY_TYPE_KV_CACHE="kv_cache", TorchMemorySaverAdapter=Stub("TorchMemorySaverAdapter"))
        ns["__annotations_future__"] = True
        path = os.path.join(src, "sglang", "srt", "mem_cache", "memory_pool.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ReqToTokenPool"]
        body.insert(0, ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0))
        exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec"), ns)


class _GridKernel:
    """``kernel[(grid,)](*args)`` launcher that runs a plain-Python emulation instead of Triton."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _install_cpu_kernels(paged: types.ModuleType) -> None:
    """Replace the Triton allocator kernels with CPU equivalents.

    ``alloc_extend`` uses SGLang's own reference ``alloc_extend_naive`` (same file);
    ``alloc_decode`` is a line-for-line Python transcription of ``alloc_decode_kernel``.
    When the pool is short of pages the kernels read past ``free_pages`` and the caller
    discards the result (returns None); the emulations just stop early in that case.
    """

    def extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        try:
            paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices,
                                     page_size, out_indices.device)
        except (IndexError, RuntimeError):
            pass

    def decode(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        new_pages = 0
        for i in range(len(seq_lens)):
            seq_len = int(seq_lens[i])
            pre_len = seq_len - 1
            need = (seq_len + page_size - 1) // page_size - (pre_len + page_size - 1) // page_size
            if need == 0:
                out_indices[i] = int(last_loc[i]) + 1
            else:
                if new_pages < len(free_pages):
                    out_indices[i] = int(free_pages[new_pages]) * page_size
                new_pages += need

    paged.alloc_extend_kernel = _GridKernel(extend)
    paged.alloc_decode_kernel = _GridKernel(decode)


def make_swa_kvpool(ns: types.SimpleNamespace):
    """A minimal ``BaseSWAKVPool`` for ``SWATokenToKVPoolAllocator`` (no buffers)."""

    class FakeSWAKVPool(ns.BaseSWAKVPool):
        full_kv_pool = None
        swa_kv_pool = None

        def __init__(self):
            self.full_to_swa_index_mapping = None

        def register_mapping(self, full_to_swa_index_mapping):
            self.full_to_swa_index_mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            return self.full_to_swa_index_mapping[kv_indices].to(kv_indices.dtype)

        def get_state_buf_infos(self):
            return [], [], []

    return FakeSWAKVPool()


def load_sglang(src: str | None = None) -> types.SimpleNamespace:
    """Import SGLang's mem_cache classes from ``src`` (default: :func:`default_src`)."""
    src = src or default_src()
    if src is None or not os.path.isdir(os.path.join(src, "sglang")):
        raise ImportError(f"no SGLang source tree at {src!r} (set KVCORE_SGLANG_SRC)")
    src = os.path.abspath(src)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    sys.meta_path.insert(0, _Finder(src))

    imp = importlib.import_module
    rc = imp("sglang.srt.mem_cache.radix_cache")
    bpc = imp("sglang.srt.mem_cache.base_prefix_cache")
    alloc = imp("sglang.srt.mem_cache.allocator")
    swa = imp("sglang.srt.mem_cache.allocator.swa")
    mp = imp("sglang.srt.mem_cache.memory_pool")
    paged = imp("sglang.srt.mem_cache.allocator.paged")
    _install_cpu_kernels(paged)
    ns = types.SimpleNamespace(
        src=src,
        radix_cache=rc,
        base_prefix_cache=bpc,
        evict_policy=imp("sglang.srt.mem_cache.evict_policy"),
        utils=imp("sglang.srt.mem_cache.utils"),
        cache_init_params=imp("sglang.srt.mem_cache.cache_init_params"),
        allocator=alloc,
        swa_allocator=swa,
        memory_pool=mp,
        RadixCache=rc.RadixCache,
        RadixKey=rc.RadixKey,
        TreeNode=rc.TreeNode,
        ReqToTokenPool=mp.ReqToTokenPool,
        TokenToKVPoolAllocator=alloc.TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=alloc.PagedTokenToKVPoolAllocator,
        SWATokenToKVPoolAllocator=swa.SWATokenToKVPoolAllocator,
        BaseSWAKVPool=imp("sglang.srt.mem_cache.base_swa_memory_pool").BaseSWAKVPool,
        CacheInitParams=imp("sglang.srt.mem_cache.cache_init_params").CacheInitParams,
    )
    for n in ("MatchPrefixParams", "InsertParams", "InsertResult", "EvictParams", "EvictResult",
              "DecLockRefParams", "IncLockRefResult", "DecLockRefResult", "MatchResult", "BasePrefixCache"):
        if hasattr(bpc, n):
            setattr(ns, n, getattr(bpc, n))
    ns.make_swa_kvpool = lambda: make_swa_kvpool(ns)
    return ns


if __name__ == "__main__":  # pragma: no cover - smoke check
    sg = load_sglang(sys.argv[1] if len(sys.argv) > 1 else None)
    c = sg.RadixCache.create_simulated(page_size=1)
    c.insert(sg.InsertParams(key=sg.RadixKey([1, 2, 3]), value=__import__("torch").tensor([7, 8, 9])))
    print("ok", c.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey([1, 2, 4]))).device_indices)

"""The one loader of SGLang 0.5.19's own classes: read from an unpacked source tree, run on a CPU.

    from tools.sglang_loader import load_sglang
    sg = load_sglang("/tmp/sgl/src")      # types.SimpleNamespace
    cache = sg.RadixCache.create_simulated(page_size=4)

Every module named in :data:`REAL` (and in the caller's ``real=``) is SGLang's code,
executed from ``src``.  Every other ``sglang.*`` module is a permissive :class:`Stub`
module, except the few whose values SGLang's pool code really reads; those are listed,
with why, in :data:`FILLED`, and get SGLang's own definitions lifted from the file by
AST (:func:`lift`) or a plain-CPU value.  The paged allocator's two Triton kernels are
replaced by CPU emulations (:func:`_install_cpu_kernels`).  Nothing of SGLang is copied
into this repository; the tree is read at run time.

The family loaders build on this one: ``sglang_swa_shim`` (sliding window),
``sglang_mamba_shim``, ``sglang_unified_shim``, ``sglang_session_shim`` and
``sglang_decode_shim``.  ``load_sglang`` purges earlier ``sglang`` modules from
``sys.modules`` and installs a fresh set, so calling it twice is fine.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

__all__ = ["FINISH_ABORT", "REAL", "FILLED", "Stub", "default_src", "lift", "load_sglang", "srt_path"]

# Modules executed from SGLang's source by every load.
REAL = frozenset({
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
})


def default_src() -> str | None:
    """``$KVCORE_SGLANG_SRC``, else ``/tmp/sgl/src`` if it holds ``sglang/``; None otherwise."""
    src = os.environ.get("KVCORE_SGLANG_SRC") or "/tmp/sgl/src"
    return src if os.path.isdir(os.path.join(src, "sglang", "srt", "mem_cache")) else None


def srt_path(src: str, *parts: str) -> str:
    """A file of SGLang's ``sglang/srt`` package in ``src``."""
    return os.path.join(src, "sglang", "srt", *parts)


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

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __getitem__(self, item: Any) -> Stub:
        return Stub(f"{self._name}[]")

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())

    def __enter__(self) -> Stub:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<Stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return Stub(f"{self.__name__}.{item}")


def lift(path: str, names: Iterable[str] | None, namespace: dict) -> dict:
    """Exec the top-level ``def``/``class`` called ``names`` (every one when None) of ``path`` into ``namespace``.

    Annotations stay lazy (``from __future__ import annotations``): the lifted code's
    type names need not exist here.
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    wanted = None if names is None else set(names)
    body: list[ast.stmt] = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                            and (wanted is None or n.name in wanted)]
    if wanted is not None:
        missing = wanted - {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if missing:
            raise ImportError(f"{path}: no top-level {sorted(missing)}")
    body.insert(0, ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0))
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec"), namespace)
    return namespace


class FINISH_ABORT:  # noqa: N801 - SGLang's name
    """Stands in for SGLang's finish reason; one class for every load (the session imports it when called)."""

    def __init__(self, message: str = "") -> None:
        self.message = message


# ------------------------------------------------------------------ the stubbed modules that hold real values


def _fill_utils(ns: dict, src: str) -> None:
    # The allocators call these helpers: SGLang's own, lifted.  The platform probes answer "plain CPU".
    ns.setdefault("torch", torch)
    lift(srt_path(src, "utils", "common.py"), ["get_num_new_pages", "next_power_of_2", "ceil_div", "ceil_align"], ns)
    ns["is_hip"] = ns["is_npu"] = ns["is_cuda"] = ns["is_cpu"] = lambda: False
    ns["get_bool_env_var"] = lambda name, default="false": (
        os.environ.get(name, default).strip().lower() in ("1", "true"))


def _fill_memory_pool(ns: dict, src: str) -> None:
    # memory_pool.py imports triton and CUDA kernels; only its ReqToTokenPool is needed, lifted.
    ns.update(torch=torch, Any=Any, List=list, Optional=Optional,
              GPU_MEMORY_TYPE_KV_CACHE="kv_cache", TorchMemorySaverAdapter=Stub("TorchMemorySaverAdapter"))
    lift(srt_path(src, "mem_cache", "memory_pool.py"), ["ReqToTokenPool"], ns)


def _fill_schedule_batch(ns: dict, src: str) -> None:
    # schedule_batch.py pulls in the whole scheduler; SGLang's caches and sessions read its ReqKvInfo record
    # (lifted) and the session imports FINISH_ABORT from it when a turn ends.
    ns.update(dataclasses=dataclasses, Optional=Optional, torch=torch, FINISH_ABORT=FINISH_ABORT)
    lift(srt_path(src, "utils", "common.py"), ["ceil_div", "ceil_align"], ns)  # ReqKvInfo.swa_dead_lo's
    lift(srt_path(src, "managers", "schedule_batch.py"), ["ReqKvInfo"], ns)


def _fill_multi_ended_allocator(ns: dict, src: str) -> None:
    # free_swa_out_of_window_slots asks isinstance(alloc, UnifiedSWATokenToKVPoolAllocator): nothing is one here.
    ns["UnifiedSWATokenToKVPoolAllocator"] = type("UnifiedSWATokenToKVPoolAllocator", (), {})


FILLED: dict[str, Callable[[dict, str], None]] = {
    "sglang.srt.utils": _fill_utils,
    "sglang.srt.utils.common": _fill_utils,
    "sglang.srt.mem_cache.memory_pool": _fill_memory_pool,
    "sglang.srt.managers.schedule_batch": _fill_schedule_batch,
    "sglang.srt.mem_cache.multi_ended_allocator": _fill_multi_ended_allocator,
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src: str, real: frozenset[str]):
        self.src = src
        self.real = real

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in self.real:
            pkg = os.path.join(self.src, fullname.replace(".", os.sep))
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

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in self.real:  # namespace package (no __init__.py): a plain, empty package
            mod = types.ModuleType(spec.name)
            mod.__path__ = list(spec.submodule_search_locations or [])
            return mod
        mod = _StubModule(spec.name)
        if spec.submodule_search_locations is not None:
            mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        fill = FILLED.get(module.__name__)  # real modules have their own loader; this runs for stubs
        if fill is not None:
            fill(module.__dict__, self.src)


class _GridKernel:
    """``kernel[(grid,)](*args)`` launcher that runs a plain-Python emulation instead of Triton."""

    def __init__(self, fn: Callable[..., None]):
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.fn


def _install_cpu_kernels(paged: types.ModuleType) -> None:
    """Replace the Triton allocator kernels with CPU equivalents.

    ``alloc_extend`` uses SGLang's own reference ``alloc_extend_naive`` (same file);
    ``alloc_decode`` is a line-for-line Python transcription of ``alloc_decode_kernel``.
    When the pool is short of pages the kernels read past ``free_pages`` and the caller
    discards the result (returns None); the emulations just stop early in that case.
    """

    def extend(prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any,
               bs_upper: int, page_size: int) -> None:
        try:
            paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices,
                                     page_size, out_indices.device)
        except (IndexError, RuntimeError):
            pass

    def decode(seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any, bs_upper: int,
               page_size: int) -> None:
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

    paged.alloc_extend_kernel = _GridKernel(extend)  # type: ignore[attr-defined]
    paged.alloc_decode_kernel = _GridKernel(decode)  # type: ignore[attr-defined]


def _make_swa_kvpool(base_cls: type) -> Any:
    """A minimal ``BaseSWAKVPool`` for ``SWATokenToKVPoolAllocator``: the full->window mapping, no buffers."""

    class FakeSWAKVPool(base_cls):  # type: ignore[misc, valid-type]
        full_kv_pool = None
        swa_kv_pool = None

        def __init__(self) -> None:
            self.full_to_swa_index_mapping = None

        def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
            self.full_to_swa_index_mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
            return self.full_to_swa_index_mapping[kv_indices].to(kv_indices.dtype)

        def get_state_buf_infos(self) -> tuple[list, list, list]:
            return [], [], []

    return FakeSWAKVPool()


class SGReq:
    """What SGLang's caches, sessions and ``free_swa_out_of_window_slots`` read of a request."""

    def __init__(self, kv_cls: type, rid: str, origin_input_ids: Iterable[int], extra_key: str | None = None,
                 priority: int = 0):
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.kv = kv_cls()
        self.extra_key = extra_key
        self.cache_salt = None
        self.priority = priority
        self.last_node: Any = None
        self.swa_uuid_for_lock: Any = None
        self.swa_prefix_lock_released = False
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.skip_lock_node_ids: Any = None

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_range(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(start=self.kv.cache_protected_len, end=self.kv.kv_committed_len)

    def get_fill_ids(self) -> list[int]:
        # SGLang: full_untruncated_fill_ids[: extend_range.end]
        return (self.origin_input_ids + self.output_ids)[: self.kv.kv_committed_len]


def load_sglang(src: str | None = None, *, real: Iterable[str] = ()) -> types.SimpleNamespace:
    """Import SGLang's mem_cache classes from ``src`` (default: :func:`default_src`).

    ``real``: more modules to execute from source (a family loader's own), on top of :data:`REAL`.
    """
    src = src or default_src()
    if src is None or not os.path.isdir(os.path.join(src, "sglang")):
        raise ImportError(f"no SGLang source tree at {src!r} (set KVCORE_SGLANG_SRC)")
    src = os.path.abspath(src)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    sys.meta_path.insert(0, _Finder(src, REAL | frozenset(real)))

    imp = importlib.import_module
    rc = imp("sglang.srt.mem_cache.radix_cache")
    bpc = imp("sglang.srt.mem_cache.base_prefix_cache")
    alloc = imp("sglang.srt.mem_cache.allocator")
    swa = imp("sglang.srt.mem_cache.allocator.swa")
    mp = imp("sglang.srt.mem_cache.memory_pool")
    sb = imp("sglang.srt.managers.schedule_batch")
    common = imp("sglang.srt.mem_cache.common")
    _install_cpu_kernels(imp("sglang.srt.mem_cache.allocator.paged"))
    base_swa = imp("sglang.srt.mem_cache.base_swa_memory_pool").BaseSWAKVPool
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
        common=common,
        RadixCache=rc.RadixCache,
        RadixKey=rc.RadixKey,
        TreeNode=rc.TreeNode,
        ReqToTokenPool=mp.ReqToTokenPool,
        ReqKvInfo=sb.ReqKvInfo,
        TokenToKVPoolAllocator=alloc.TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=alloc.PagedTokenToKVPoolAllocator,
        SWATokenToKVPoolAllocator=swa.SWATokenToKVPoolAllocator,
        BaseSWAKVPool=base_swa,
        CacheInitParams=imp("sglang.srt.mem_cache.cache_init_params").CacheInitParams,
        free_swa_out_of_window_slots=common.free_swa_out_of_window_slots,
        evict_from_tree_cache=common.evict_from_tree_cache,
        release_kv_cache=common.release_kv_cache,
    )
    for n in ("MatchPrefixParams", "InsertParams", "InsertResult", "EvictParams", "EvictResult",
              "DecLockRefParams", "IncLockRefResult", "DecLockRefResult", "MatchResult", "BasePrefixCache"):
        setattr(ns, n, getattr(bpc, n))
    ns.make_swa_kvpool = lambda: _make_swa_kvpool(base_swa)
    ns.SGReq = lambda rid, ids, extra_key=None, priority=0: SGReq(sb.ReqKvInfo, rid, ids, extra_key, priority)

    def make_allocator(size: int, page_size: int = 1) -> Any:
        """SGLang's one-pool token allocator (paged above page size 1), on the CPU."""
        if page_size == 1:
            return alloc.TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        return alloc.PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)

    def make_req_to_token_pool(num_reqs: int, max_context_len: int) -> Any:
        return mp.ReqToTokenPool(num_reqs, max_context_len, "cpu", False)

    ns.make_allocator = make_allocator
    ns.make_req_to_token_pool = make_req_to_token_pool
    return ns


if __name__ == "__main__":  # pragma: no cover - smoke check: python -m tools.sglang_loader [SRC]
    sg = load_sglang(sys.argv[1] if len(sys.argv) > 1 else None)
    c = sg.RadixCache.create_simulated(page_size=1)
    c.insert(sg.InsertParams(key=sg.RadixKey([1, 2, 3]), value=torch.tensor([7, 8, 9])))
    print("ok", c.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey([1, 2, 4]))).device_indices)

"""SGLang's sliding-window classes, loaded through :mod:`tools.sglang_shim`, ready to drive on CPU.

    from tools.sglang_swa_shim import load_sglang_swa
    sg = load_sglang_swa()                       # None-safe: raises ImportError without a source tree
    alloc = sg.make_allocator(size=256, size_swa=64, page_size=4)
    cache = sg.make_radix_cache(alloc, sg.make_req_to_token_pool(8, 512), page_size=4, window=8)
    pure = sg.make_pure_radix_cache(sg.make_pure_allocator(256), sg.make_req_to_token_pool(8, 512), 1, 8)

On top of the common loader this only:

* replaces the two triton kernels of the paged allocator (``alloc_extend_kernel``,
  ``alloc_decode_kernel``) by plain-PyTorch versions: extend calls SGLang's own
  ``alloc_extend_naive`` (same file), decode is the obvious per-request loop;
* lifts SGLang's ``ReqKvInfo`` dataclass from ``managers/schedule_batch.py`` (by AST, as
  the common loader lifts ``ReqToTokenPool``), so SGLang's code reads a real record;
* gives a minimal ``BaseSWAKVPool`` (just the full->window mapping) and a minimal
  request object with what SGLang's SWA caches read from ``req``.

Nothing of SGLang is copied into this repository; the source tree is read at run time.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import os
import sys
import types
from typing import Any, Optional

import torch

__all__ = ["load_sglang_swa", "default_src"]


def _common_shim():
    try:
        from tools import sglang_shim  # type: ignore
        return sglang_shim
    except ImportError:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_shim.py")
        spec = importlib.util.spec_from_file_location("_kvcore_sglang_shim", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def default_src() -> str | None:
    return _common_shim().default_src()


class _Kernel:
    """``kernel[grid](*args)`` -> ``fn(*args)``: stands in for a triton launch."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _lift_class(path: str, name: str, namespace: dict) -> Any:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if not body:
        raise ImportError(f"{path}: no top-level class {name}")
    body.insert(0, ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0))
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec"), namespace)
    return namespace[name]


def load_sglang_swa(src: str | None = None) -> types.SimpleNamespace:
    shim = _common_shim()
    # The pure-SWA radix cache is executed from source too (the common loader stubs what it does not list).
    shim._REAL.add("sglang.srt.mem_cache.pure_swa_radix_cache")
    sg = shim.load_sglang(src)
    imp = importlib.import_module
    paged = imp("sglang.srt.mem_cache.allocator.paged")

    def extend_kernel(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _pow2, page_size):
        paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size,
                                 out_indices.device)

    def decode_kernel(seq_lens, last_loc, free_pages, out_indices, _pow2, page_size):
        k = 0
        for i in range(len(seq_lens)):
            if (int(seq_lens[i]) - 1) % page_size == 0:  # the new token opens a page
                out_indices[i] = int(free_pages[k]) * page_size
                k += 1
            else:
                out_indices[i] = int(last_loc[i]) + 1

    paged.alloc_extend_kernel = _Kernel(extend_kernel)
    paged.alloc_decode_kernel = _Kernel(decode_kernel)

    # free_swa_out_of_window_slots checks isinstance(alloc, UnifiedSWATokenToKVPoolAllocator):
    # that module is stubbed, so give it a class nothing is an instance of.
    me = imp("sglang.srt.mem_cache.multi_ended_allocator")
    me.UnifiedSWATokenToKVPoolAllocator = type("UnifiedSWATokenToKVPoolAllocator", (), {})

    swa_rc = imp("sglang.srt.mem_cache.swa_radix_cache")
    chunk = imp("sglang.srt.mem_cache.chunk_cache")
    common = imp("sglang.srt.mem_cache.common")
    swa_alloc_mod = imp("sglang.srt.mem_cache.allocator.swa")
    pure_rc = imp("sglang.srt.mem_cache.pure_swa_radix_cache")

    ns: dict = {"dataclasses": dataclasses, "Optional": Optional, "torch": torch, "Any": Any}
    shim._lift(os.path.join(sg.src, "sglang", "srt", "utils", "common.py"), ["ceil_div", "ceil_align"], ns)
    ReqKvInfo = _lift_class(os.path.join(sg.src, "sglang", "srt", "managers", "schedule_batch.py"), "ReqKvInfo", ns)

    def make_allocator(size: int, size_swa: int, page_size: int):
        return swa_alloc_mod.SWATokenToKVPoolAllocator(
            size, size_swa, page_size, torch.float16, "cpu", sg.make_swa_kvpool(), False)

    def make_req_to_token_pool(num_reqs: int, max_context_len: int):
        return sg.ReqToTokenPool(num_reqs, max_context_len, "cpu", False)

    def _params(alloc, rtp, page_size, window):
        return sg.CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                                  page_size=page_size, sliding_window_size=window)

    def make_pure_allocator(size: int, page_size: int = 1):
        """SGLang's one-pool allocator of an all-SWA model (page size 1 only, as in SGLang)."""
        return swa_alloc_mod.PureSWATokenToKVPoolAllocator(
            size, page_size, torch.float16, "cpu", sg.make_swa_kvpool(), False)

    def make_pure_radix_cache(alloc, rtp, page_size: int, window: int):
        return pure_rc.PureSWARadixCache(_params(alloc, rtp, page_size, window))

    def make_pure_chunk_cache(alloc, rtp, page_size: int, window: int):
        return chunk.PureSWAChunkCache(_params(alloc, rtp, page_size, window))

    def make_radix_cache(alloc, rtp, page_size: int, window: int):
        return swa_rc.SWARadixCache(_params(alloc, rtp, page_size, window))

    def make_chunk_cache(alloc, rtp, page_size: int, window: int):
        return chunk.SWAChunkCache(_params(alloc, rtp, page_size, window))

    class SGReq:
        """What SGLang's SWA caches and ``free_swa_out_of_window_slots`` read from a request."""

        def __init__(self, rid: str, origin_input_ids: list, extra_key: str | None = None):
            self.rid = rid
            self.origin_input_ids = list(origin_input_ids)
            self.output_ids: list = []
            self.kv = ReqKvInfo()
            self.extra_key = extra_key
            self.cache_salt = None
            self.last_node = None
            self.swa_uuid_for_lock = None
            self.swa_prefix_lock_released = False
            self.prefix_indices = torch.empty((0,), dtype=torch.int64)
            self.skip_lock_node_ids = None

        @property
        def seqlen(self) -> int:
            return len(self.origin_input_ids) + len(self.output_ids)

        @property
        def extend_range(self):
            return types.SimpleNamespace(start=self.kv.cache_protected_len, end=self.kv.kv_committed_len)

        def get_fill_ids(self):
            # SGLang: full_untruncated_fill_ids[: extend_range.end]
            return (self.origin_input_ids + self.output_ids)[: self.kv.kv_committed_len]

    return types.SimpleNamespace(
        base=sg,
        src=sg.src,
        swa_radix_cache=swa_rc,
        chunk_cache=chunk,
        common=common,
        SWARadixCache=swa_rc.SWARadixCache,
        SWAChunkCache=chunk.SWAChunkCache,
        TreeNode=swa_rc.TreeNode,
        RadixKey=sg.RadixKey,
        ReqKvInfo=ReqKvInfo,
        SGReq=SGReq,
        MatchPrefixParams=sg.MatchPrefixParams,
        InsertParams=sg.InsertParams,
        EvictParams=sg.EvictParams,
        DecLockRefParams=sg.DecLockRefParams,
        free_swa_out_of_window_slots=common.free_swa_out_of_window_slots,
        evict_from_tree_cache=common.evict_from_tree_cache,
        make_allocator=make_allocator,
        make_req_to_token_pool=make_req_to_token_pool,
        make_radix_cache=make_radix_cache,
        make_chunk_cache=make_chunk_cache,
        radix_cache=imp("sglang.srt.mem_cache.radix_cache"),
        make_pure_allocator=make_pure_allocator,
        make_pure_radix_cache=make_pure_radix_cache,
        make_pure_chunk_cache=make_pure_chunk_cache,
    )

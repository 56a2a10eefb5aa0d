"""SGLang's sliding-window classes, loaded through :mod:`tools.sglang_loader`, ready to drive on CPU.

    from tools.sglang_swa_shim import load_sglang_swa
    sg = load_sglang_swa()                       # raises ImportError without a source tree
    alloc = sg.make_swa_allocator(size=256, size_swa=64, page_size=4)
    cache = sg.make_radix_cache(alloc, sg.make_req_to_token_pool(8, 512), page_size=4, window=8)
    pure = sg.make_pure_radix_cache(sg.make_pure_allocator(256), sg.make_req_to_token_pool(8, 512), 1, 8)

On top of the loader this only executes ``pure_swa_radix_cache.py`` from source too and
builds SGLang's ``SWAChunkCache`` / ``PureSWA*`` caches and its legacy ``SWARadixCache`` on its
``SWATokenToKVPoolAllocator`` / ``PureSWATokenToKVPoolAllocator`` (a buffer-less
``BaseSWAKVPool`` under them).  ``SWARadixCache`` is no longer what kvcore's ``swa`` answers
as (that is SGLang's ``UnifiedRadixCache`` with components full + swa,
:mod:`tools.sglang_unified_shim`); it stays for ``benchmarks/bench_swa.py``'s speed
comparison and for the tests that pin where the two SGLang trees answer differently.
Nothing of SGLang is copied into this repository.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

from tools.sglang_loader import default_src, load_sglang

__all__ = ["load_sglang_swa", "default_src"]

REAL = ("sglang.srt.mem_cache.pure_swa_radix_cache",)


def load_sglang_swa(src: str | None = None, *, real: tuple[str, ...] = ()) -> types.SimpleNamespace:
    """The loader's namespace plus SGLang's sliding-window caches and their constructors."""
    sg = load_sglang(src, real=REAL + real)
    imp = importlib.import_module
    swa_rc = imp("sglang.srt.mem_cache.swa_radix_cache")
    chunk = imp("sglang.srt.mem_cache.chunk_cache")
    pure_rc = imp("sglang.srt.mem_cache.pure_swa_radix_cache")

    def make_swa_allocator(size: int, size_swa: int, page_size: int) -> Any:
        return sg.SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.float16, "cpu", sg.make_swa_kvpool(),
                                            False)

    def make_pure_allocator(size: int, page_size: int = 1) -> Any:
        """SGLang's one-pool allocator of an all-SWA model (page size 1 only, as in SGLang)."""
        return sg.swa_allocator.PureSWATokenToKVPoolAllocator(
            size, page_size, torch.float16, "cpu", sg.make_swa_kvpool(), False)

    def params(alloc: Any, rtp: Any, page_size: int, window: int) -> Any:
        return sg.CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                                  page_size=page_size, sliding_window_size=window)

    def free_out_of_window(cache: Any, sreq: Any, pre_len: int, *, window: int, page_size: int,
                           chunk: bool) -> None:
        """SGLang's ``free_swa_out_of_window_slots`` as its scheduler calls it for ``cache``'s request ``sreq``."""
        sg.free_swa_out_of_window_slots(
            sreq, pre_len, sliding_window_size=window, page_size=page_size, req_to_token_pool=cache.req_to_token_pool,
            token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator, is_chunk_cache=chunk,
            retain_floor=cache.swa_retain_floor(sreq))

    ns = types.SimpleNamespace(**vars(sg))
    ns.free_out_of_window = free_out_of_window
    ns.chunk_cache = chunk
    ns.SWARadixCache = swa_rc.SWARadixCache
    ns.SWAChunkCache = chunk.SWAChunkCache
    ns.make_swa_allocator = make_swa_allocator
    ns.make_pure_allocator = make_pure_allocator
    ns.make_radix_cache = lambda alloc, rtp, page_size, window: swa_rc.SWARadixCache(
        params(alloc, rtp, page_size, window))
    ns.make_chunk_cache = lambda alloc, rtp, page_size, window: chunk.SWAChunkCache(
        params(alloc, rtp, page_size, window))
    ns.make_pure_radix_cache = lambda alloc, rtp, page_size, window: pure_rc.PureSWARadixCache(
        params(alloc, rtp, page_size, window))
    ns.make_pure_chunk_cache = lambda alloc, rtp, page_size, window: chunk.PureSWAChunkCache(
        params(alloc, rtp, page_size, window))
    return ns

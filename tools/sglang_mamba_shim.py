"""SGLang's ``MambaRadixCache`` with a real ``HybridReqToTokenPool`` / ``MambaPool``, loaded on CPU.

    from tools.sglang_mamba_shim import load_sglang_mamba
    sg = load_sglang_mamba()          # ImportError without a source tree (KVCORE_SGLANG_SRC)
    pool = sg.make_hybrid_pool(num_reqs=8, mamba_size=6, max_context_len=256)
    cache = sg.make_cache(sg.make_allocator(128), pool, chunk_size=4)
    # page size 4: SGLang's extra-buffer mode (ping-pong tracking slots, overlap scheduler)
    pool = sg.make_hybrid_pool(8, 24, 256, extra_buffer=True)
    cache = sg.make_cache(sg.make_allocator(128, 4), pool, chunk_size=4, page_size=4, extra_buffer=True)

Built on :mod:`tools.sglang_swa_shim` (the common loader, SGLang's ``ReqKvInfo``).  On top
of it this only:

* executes ``mem_cache/allocator/mamba.py`` (``MambaSlotAllocator``) and
  ``mem_cache/mamba_radix_cache.py`` from SGLang's source as real modules;
* lifts ``MambaPool`` and ``HybridReqToTokenPool`` (with the two helpers they call) from
  ``memory_pool.py`` by AST into the loader's ``memory_pool`` module, with the platform
  flags of a plain CPU (no NPU, no AMX, no custom memory pool) and no int8 checkpoint pool;
* answers ``mamba_cache_chunk_size()`` (a server-args lookup in SGLang) with the chunk size
  the caller picks.

Nothing of SGLang is copied into this repository; the source tree is read at run time.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
import sys
import types
import typing

import torch

__all__ = ["load_sglang_mamba", "default_src"]


def _swa_shim():
    try:
        from tools import sglang_swa_shim  # type: ignore
        return sglang_swa_shim
    except ImportError:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_swa_shim.py")
        spec = importlib.util.spec_from_file_location("_kvcore_sglang_swa_shim", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


def default_src() -> str | None:
    return _swa_shim().default_src()


def _exec_real(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _lift_defs(path: str, names: list[str], namespace: dict) -> None:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    body: list[ast.stmt] = [n for n in tree.body
                            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    missing = set(names) - {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    if missing:
        raise ImportError(f"{path}: no top-level {sorted(missing)}")
    body.insert(0, ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0))
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec"), namespace)


def load_sglang_mamba(src: str | None = None) -> types.SimpleNamespace:
    swa = _swa_shim().load_sglang_swa(src)
    sg = swa.base
    mem = os.path.join(sg.src, "sglang", "srt", "mem_cache")
    imp = importlib.import_module

    mamba_alloc = _exec_real("sglang.srt.mem_cache.allocator.mamba", os.path.join(mem, "allocator", "mamba.py"))
    imp("sglang.srt.mem_cache.mamba_checkpoint_pool").maybe_init_int8_mamba_checkpoint_pool = (
        lambda **kwargs: None)

    mp = sys.modules["sglang.srt.mem_cache.memory_pool"]
    ns = mp.__dict__
    ns.update(
        torch=torch, copy=copy, dataclasses=dataclasses, dataclass=dataclasses.dataclass,
        fields=dataclasses.fields, cached_property=functools.cached_property, nullcontext=contextlib.nullcontext,
        Any=typing.Any, Optional=typing.Optional, Union=typing.Union,
        List=vars(typing)["List"], Tuple=vars(typing)["Tuple"],
        logger=logging.getLogger("sglang.srt.mem_cache.memory_pool"), GB=1024**3,
        _is_npu=False, _is_cpu=False, _is_cuda=False, _is_hip=False, _cpu_has_amx_support=False,
        _MAMBA_DEBUG_ASSERTS=False, MambaSlotAllocator=mamba_alloc.MambaSlotAllocator,
        maybe_init_custom_mem_pool=lambda device=None: (False, None, None),
        envs=_swa_shim()._common_shim().Stub("envs"), np=importlib.import_module("numpy"),
    )
    _lift_defs(os.path.join(mem, "memory_pool.py"),
               ["get_tensor_size_bytes", "conv_window_dedup_enabled", "MambaPool", "HybridReqToTokenPool"], ns)

    chunk = {"size": 64}
    mrc = _exec_real("sglang.srt.mem_cache.mamba_radix_cache", os.path.join(mem, "mamba_radix_cache.py"))
    mrc.mamba_cache_chunk_size = lambda: chunk["size"]

    def cache_params(conv_shapes=((6, 3),), temporal_shape=(2, 4, 4), dtype=torch.float32):
        return types.SimpleNamespace(
            shape=types.SimpleNamespace(conv=[tuple(s) for s in conv_shapes], temporal=tuple(temporal_shape),
                                        disable_conv_window_dedup=True),
            dtype=types.SimpleNamespace(conv=dtype, temporal=dtype),
            is_kda=False,
        )

    def make_hybrid_pool(num_reqs: int, mamba_size: int, max_context_len: int, *, num_layers: int = 2,
                         conv_shapes=((6, 3),), temporal_shape=(2, 4, 4), dtype=torch.float32,
                         extra_buffer: bool = False):
        return ns["HybridReqToTokenPool"](
            size=num_reqs, mamba_size=mamba_size, mamba_spec_state_size=mamba_size,
            max_context_len=max_context_len, device="cpu", enable_memory_saver=False,
            cache_params=cache_params(conv_shapes, temporal_shape, dtype),
            mamba_layer_ids=list(range(num_layers)), enable_mamba_extra_buffer=extra_buffer,
            enable_overlap_schedule=True,
        )

    def make_allocator(size: int, page_size: int = 1):
        if page_size == 1:
            return sg.TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        return sg.PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)

    def make_cache(alloc, pool, chunk_size: int = 64, page_size: int = 1, extra_buffer: bool = False):
        chunk["size"] = chunk_size
        params = sg.CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                    page_size=page_size, enable_mamba_extra_buffer=extra_buffer)
        return mrc.MambaRadixCache(params)

    return types.SimpleNamespace(
        base=sg,
        swa=swa,
        src=sg.src,
        mamba_radix_cache=mrc,
        MambaRadixCache=mrc.MambaRadixCache,
        TreeNode=mrc.TreeNode,
        MambaPool=ns["MambaPool"],
        HybridReqToTokenPool=ns["HybridReqToTokenPool"],
        MambaSlotAllocator=mamba_alloc.MambaSlotAllocator,
        RadixKey=sg.RadixKey,
        ReqKvInfo=swa.ReqKvInfo,
        SGReq=swa.SGReq,
        MatchPrefixParams=sg.MatchPrefixParams,
        InsertParams=sg.InsertParams,
        EvictParams=sg.EvictParams,
        release_kv_cache=swa.common.release_kv_cache,
        make_hybrid_pool=make_hybrid_pool,
        make_allocator=make_allocator,
        make_cache=make_cache,
    )

"""SGLang's real ``HybridReqToTokenPool`` / ``MambaPool`` (with its ``MambaSlotAllocator``), loaded on CPU.

    from tools.sglang_mamba_shim import load_sglang_mamba
    sg = load_sglang_mamba()          # ImportError without a source tree (KVCORE_SGLANG_SRC)
    pool = sg.make_hybrid_pool(num_reqs=8, mamba_size=6, max_context_len=256)
    # page size 4: SGLang's extra-buffer mode (ping-pong tracking slots, overlap scheduler)
    pool = sg.make_hybrid_pool(8, 24, 256, extra_buffer=True)

:mod:`tools.sglang_unified_shim` builds SGLang's ``UnifiedRadixCache`` (full, mamba) on them.

Built on :mod:`tools.sglang_swa_shim`.  On top of it this only:

* executes ``mem_cache/allocator/mamba.py`` (``MambaSlotAllocator``) from SGLang's source as
  a real module;
* lifts ``MambaPool`` and ``HybridReqToTokenPool`` (with the two helpers they call) from
  ``memory_pool.py`` by AST into the loader's ``memory_pool`` module, with the platform
  flags of a plain CPU (no NPU, no AMX, no custom memory pool) and no int8 checkpoint pool;
* plays SGLang's scheduler's Mamba tracking decision (:func:`track_like_scheduler`).

The Mamba chunk size is the tree's setting: :mod:`tools.sglang_unified_shim` answers it.

Nothing of SGLang is copied into this repository; the source tree is read at run time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import logging
import sys
import types
import typing
from typing import Any

import numpy as np
import torch

from tools.sglang_loader import Stub, default_src, lift, srt_path
from tools.sglang_swa_shim import load_sglang_swa

__all__ = ["load_sglang_mamba", "default_src"]

REAL = ("sglang.srt.mem_cache.allocator.mamba",)


def cache_params(conv_shapes: Any = ((6, 3),), temporal_shape: Any = (2, 4, 4), dtype: Any = torch.float32) -> Any:
    """The model shape SGLang's ``MambaPool`` reads (a small one: a CPU holds every state)."""
    return types.SimpleNamespace(
        shape=types.SimpleNamespace(conv=[tuple(s) for s in conv_shapes], temporal=tuple(temporal_shape),
                                    disable_conv_window_dedup=True),
        dtype=types.SimpleNamespace(conv=dtype, temporal=dtype),
        is_kda=False,
    )


def track_like_scheduler(sreq: Any, pool: Any, start: int, end: int, *, prefill: bool, chunk: int,
                         decode_grid: int) -> bool:
    """SGLang's scheduler (extra-buffer mode, overlap on, not lazy): the tracking decision of one forward.

    Prefill (``_mamba_radix_cache_v2_req_prepare_for_extend``): an extend of at least one
    chunk tracks at ``start + L // chunk * chunk``, or at the branching point when it lies
    inside, chunk-aligned from the start.  Decode (``_mamba_prefix_cache_update``): a step
    that reaches a multiple of ``decode_grid`` (``lcm(chunk, page, mamba_track_interval)``)
    tracks there.  Sets the record's track fields as SGLang does; True when it tracked.
    """
    sk = sreq.kv
    if prefill:
        length = end - start
        if length < chunk:
            return False
        seqlen = start + length // chunk * chunk
        br = sreq.mamba_branching_seqlen
        if br is not None and start < br < end and (br - start) % chunk == 0:
            seqlen = br
    else:
        if end % decode_grid:
            return False
        seqlen = end
    sk.mamba_last_track_idx = sk.mamba_next_track_idx
    sk.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(sk.mamba_next_track_idx)
    sk.mamba_last_track_seqlen = seqlen
    return True


def load_sglang_mamba(src: str | None = None, *, real: tuple[str, ...] = ()) -> types.SimpleNamespace:
    """The sliding-window namespace plus SGLang's Mamba pools (``MambaPool``, ``HybridReqToTokenPool``)."""
    sg = load_sglang_swa(src, real=REAL + real)
    imp = importlib.import_module
    imp("sglang.srt.mem_cache.mamba_checkpoint_pool").maybe_init_int8_mamba_checkpoint_pool = (
        lambda **kwargs: None)
    mamba_alloc = imp("sglang.srt.mem_cache.allocator.mamba")
    mp = sys.modules["sglang.srt.mem_cache.memory_pool"]
    pool_ns = mp.__dict__
    pool_ns.update(
        torch=torch, copy=copy, dataclasses=dataclasses, dataclass=dataclasses.dataclass,
        fields=dataclasses.fields, cached_property=functools.cached_property, nullcontext=contextlib.nullcontext,
        Any=typing.Any, Optional=typing.Optional, Union=typing.Union,
        List=vars(typing)["List"], Tuple=vars(typing)["Tuple"],
        logger=logging.getLogger("sglang.srt.mem_cache.memory_pool"), GB=1024**3,
        _is_npu=False, _is_cpu=False, _is_cuda=False, _is_hip=False, _cpu_has_amx_support=False,
        _MAMBA_DEBUG_ASSERTS=False, MambaSlotAllocator=mamba_alloc.MambaSlotAllocator,
        maybe_init_custom_mem_pool=lambda device=None: (False, None, None),
        envs=Stub("envs"), np=np,
    )
    lift(srt_path(sg.src, "mem_cache", "memory_pool.py"),
         ["get_tensor_size_bytes", "conv_window_dedup_enabled", "MambaPool", "HybridReqToTokenPool"], pool_ns)
    def make_hybrid_pool(num_reqs: int, mamba_size: int, max_context_len: int, *, num_layers: int = 2,
                         conv_shapes: Any = ((6, 3),), temporal_shape: Any = (2, 4, 4), dtype: Any = torch.float32,
                         extra_buffer: bool = False) -> Any:
        return pool_ns["HybridReqToTokenPool"](
            size=num_reqs, mamba_size=mamba_size, mamba_spec_state_size=mamba_size,
            max_context_len=max_context_len, device="cpu", enable_memory_saver=False,
            cache_params=cache_params(conv_shapes, temporal_shape, dtype),
            mamba_layer_ids=list(range(num_layers)), enable_mamba_extra_buffer=extra_buffer,
            enable_overlap_schedule=True,
        )

    ns = types.SimpleNamespace(**vars(sg))
    ns.MambaPool = pool_ns["MambaPool"]
    ns.HybridReqToTokenPool = pool_ns["HybridReqToTokenPool"]
    ns.MambaSlotAllocator = mamba_alloc.MambaSlotAllocator
    ns.track_like_scheduler = track_like_scheduler
    ns.make_hybrid_pool = make_hybrid_pool
    return ns

"""kvcore-mamba's options: pre_alloc_size (a DecodeReqToTokenPool) is refused, not silently ignored."""

from __future__ import annotations

import pytest
from kvcore_mamba.config import MambaConfig
from pydantic import ValidationError

import kvcore
from kvcore import ConfigError, Engine, Req, create_cache


def test_pre_alloc_size_is_refused_by_the_config():
    with pytest.raises(ValidationError) as info:
        MambaConfig(pre_alloc_size=4)
    (err,) = info.value.errors()
    msg = err["msg"]
    assert "pre_alloc_size=4 is not supported with the mamba component" in msg
    assert "HybridMambaDecodeReqToTokenPool" in msg and "max_num_reqs" in msg  # what is missing, what to do


def test_create_cache_names_the_option():
    says = r"backend 'mamba': pre_alloc_size=2 is not supported.*leave pre_alloc_size at 0"
    with pytest.raises(ConfigError, match=says):
        create_cache("mamba", pre_alloc_size=2)


def test_zero_is_the_plain_row_pool():
    cache = create_cache("mamba", pre_alloc_size=0, max_num_reqs=4, size=256, max_context_len=64)
    assert cache.req_to_token_pool.size == 4
    eng = Engine(cache)
    r = Req("r", list(range(10)))
    assert eng.admit(r) and eng.extend(r)
    eng.finish(r)
    kvcore.InvariantChecker(cache).check([])


def test_mamba_is_the_one_tree_with_full_and_the_mamba_component():
    from kvcore_mamba.component import MambaComponent

    from kvcore.tree.unified import UnifiedRadixCache

    cache = create_cache("mamba", size=64, max_num_reqs=2, max_context_len=32)
    assert type(cache) is UnifiedRadixCache
    assert [c.name for c in cache.components] == ["full", "mamba"]
    assert type(cache.components[1]) is MambaComponent       # this distribution's component
    same = create_cache("unified", components=("full", "mamba"), size=64, max_num_reqs=2, max_context_len=32)
    assert type(same) is UnifiedRadixCache and [type(c) for c in same.components] == [type(c) for c in cache.components]
    with pytest.raises(ConfigError, match=r"component set \('full', 'mamba'\)"):
        create_cache("mamba", size=64, components=("full", "swa"))
    kvcore.InvariantChecker(cache).check([])

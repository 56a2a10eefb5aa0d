"""The spec's registration, its options and what it refuses, with vLLM's own config types (no engine)."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from kvcore_vllm.config import parse_extra_config
from kvcore_vllm.plugin import SPEC_NAME, register
from kvcore_vllm.spec import KvcoreOffloadingSpec, NotServed
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory


def offloading_config(groups: int = 1, tp: int = 1, blocks_per_chunk: int = 1, model: str = "tiny",
                      dtype: str = "float32", block: int = 32, **extra: Any) -> OffloadingConfig:
    par = OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                   data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                   is_parallelism_agnostic=False)
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=block, layer_names=(f"l{i}",), group_id=i)
                     for i in range(groups)),
        worker_kv_bytes_per_block=4096, enable_kv_cache_events=False,
        extra_config={"spec_name": SPEC_NAME, "host_bytes": 1 << 16, **extra}, engine_id="unit-test",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk), parallel=par)


def test_entry_point_registers_the_spec_name_with_vllms_factory() -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == "kvcore_vllm.plugin:register"]
    assert eps, "kvcore-vllm's vllm.general_plugins entry point is not installed"
    register()
    register()  # idempotent: vLLM calls it in every process, sometimes twice
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME}) is KvcoreOffloadingSpec
    by_path = OffloadingSpecFactory.get_spec_cls({"spec_name": "KvcoreOffloadingSpec",
                                                  "spec_module_path": "kvcore_vllm"})
    assert by_path is KvcoreOffloadingSpec


def test_options_are_validated_with_messages_that_say_what_to_do() -> None:
    ok = parse_extra_config({"spec_name": SPEC_NAME, "store": "memory://x", "eviction_policy": "LFU",
                             "blocks_per_chunk": 1})
    assert ok.eviction_policy == "lfu" and ok.store == "memory://x"
    with pytest.raises(ValueError, match=r"hostbytes: unknown key; kvcore-vllm takes .*host_bytes"):
        parse_extra_config({"hostbytes": 1})
    with pytest.raises(ValueError, match=r"no kvcore store for scheme 'nosuch://'; known: .*file://"):
        parse_extra_config({"store": "nosuch://h"})
    with pytest.raises(ValueError, match=r"unknown eviction policy 'zz'; known policies: .*lru"):
        parse_extra_config({"eviction_policy": "zz"})
    with pytest.raises(ValueError, match=r"host_bytes"):
        parse_extra_config({"host_bytes": 0})


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"groups": 2}, "2 KV cache groups"),
    ({"tp": 2}, "tp=2"),
    ({"blocks_per_chunk": 2}, "blocks_per_chunk=2"),
])
def test_what_is_not_served_is_refused_with_one_clear_error(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(NotServed, match=says) as err:
        KvcoreOffloadingSpec(offloading_config(**kwargs))
    assert "Run without the kvcore spec" in str(err.value)


def test_a_host_tier_too_small_for_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no block of 4096 bytes"):
        KvcoreOffloadingSpec(offloading_config(host_bytes=100))


def test_store_keys_name_the_model_dtype_layout_block_size_and_rank(tmp_path: Path) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    a = KvcoreOffloadingSpec(offloading_config())
    key = b"\x01" * 32 + b"\x00" * 4
    assert a.store_key(key) == KvcoreOffloadingSpec(offloading_config()).store_key(key)
    others = [offloading_config(namespace="tenant-b"), offloading_config(model="other"),
              offloading_config(dtype="bfloat16"), offloading_config(block=64)]
    keys = {a.store_key(key)} | {KvcoreOffloadingSpec(c).store_key(key) for c in others}
    assert len(keys) == 1 + len(others)
    assert a.store_key(key).endswith(key.hex())

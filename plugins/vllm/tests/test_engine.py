"""kvcore-vllm inside real vLLM 0.32 on the CPU, token for token against a run without any connector.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or, where a test
needs a new process, through ``python -m kvcore_vllm.runs``: one process runs the
file-store reader in vLLM's default multi-process mode (the spec's metadata crosses
processes), then the engine that writes to Redis for this process's reader.
Each in-process run ends with kvcore's InvariantChecker over the host tier's books
(``kvcore_vllm.runs.run_engine``).  A block is 32 tokens; the prompts share 3 blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvcore_redis.servers import RedisClusterServers, RedisServer, redis_server_missing
from kvcore_vllm.runs import BLOCK, overwrite_file_store, run_engine, run_in_new_process

SHARED = 3 * BLOCK


def spec(store: str | None, **options: Any) -> dict[str, Any]:
    return {"store": store, "host_bytes": 1 << 22, **options}


def max_tokens(reference: dict[str, Any]) -> int:
    return len(reference["tokens"][0])


# -- file:// : the spec on, a new process loads, garbage is a miss, unchecked garbage reaches the model ---------

@pytest.fixture(scope="module")
def file_store(tmp_path_factory: pytest.TempPathFactory, model_a: str, prompts: list[list[int]],
               reference_a: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("file-store")
    # Selected by module path here; the other runs use the entry point's registered name.
    writer = run_engine(model_a, {**spec(f"file://{root}"), "spec_module_path": "kvcore_vllm"}, prompts,
                        max_tokens(reference_a))
    return root, writer


def test_spec_on_gives_the_reference_tokens(file_store: tuple[Path, dict[str, Any]],
                                            reference_a: dict[str, Any]) -> None:
    _, writer = file_store
    assert writer["tokens"] == reference_a["tokens"]
    assert writer["manager"]["blocks_stored"] >= 3
    assert writer["manager"]["host"]["pinned"] == 0
    assert writer["invariants"] == "ok"


@pytest.fixture(scope="module")
def other_process(file_store: tuple[Path, dict[str, Any]], redis_server: RedisServer, model_a: str,
                  prompts: list[list[int]], reference_a: dict[str, Any],
                  tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One new process (vLLM is imported once for both): the file store's reader in vLLM's default
    multi-process mode, then an in-process engine that writes to Redis for this process's reader."""
    root, _ = file_store
    with redis_server.client() as c:
        c.flushall()
    n = max_tokens(reference_a)
    return run_in_new_process(model_a, [
        {"kvcore": spec(f"file://{root}", write_to_store=False), "prompts": prompts, "max_tokens": n,
         "multiprocess": True},
        {"kvcore": spec(f"redis://{redis_server.address}/0"), "prompts": prompts, "max_tokens": n,
         "multiprocess": False},
    ], tmp_path_factory.mktemp("jobs"))


def test_new_process_multiprocess_engine_loads_the_shared_prefix(other_process: list[dict[str, Any]],
                                                                 reference_a: dict[str, Any]) -> None:
    reader = other_process[0]
    assert reader["tokens"] == reference_a["tokens"]
    # A fresh engine's first request: every cached token came through the connector.
    assert reader["cached"][0] == SHARED
    assert reader["external_hits"] is None or reader["external_hits"] >= SHARED


def test_garbage_values_are_misses_and_tokens_stay(file_store: tuple[Path, dict[str, Any]], model_a: str,
                                                   prompts: list[list[int]], reference_a: dict[str, Any]) -> None:
    root, _ = file_store
    assert overwrite_file_store(root) >= 3
    run = run_engine(model_a, spec(f"file://{root}", write_to_store=False), prompts, max_tokens(reference_a))
    assert run["tokens"] == reference_a["tokens"]
    assert run["cached"][0] == 0
    m = run["manager"]
    assert m["store_blocks_asked"] >= 1 and m["store_blocks_found"] == 0
    assert m["store"]["errors"] >= 1  # counted as bad values, not silently absent


def test_unchecked_garbage_reaches_the_model(file_store: tuple[Path, dict[str, Any]], model_a: str,
                                            prompts: list[list[int]], reference_a: dict[str, Any]) -> None:
    """The proof that tokens come from the loaded bytes: with the check off (test-only), garbage changes them."""
    root, _ = file_store
    run = run_engine(model_a, spec(f"file://{root}", write_to_store=False, verify_values=False), prompts,
                     max_tokens(reference_a))
    assert run["cached"][0] == SHARED
    assert run["tokens"] != reference_a["tokens"]


# -- redis:// : another process's blocks, another model, a dead server, a Cluster with a node down ------------------
# (garbage on Redis: the kit's TestManagerOnRedis overwrites values on a real server)

def test_redis_store_shared_between_processes_and_models(redis_server: RedisServer, model_a: str, model_b: str,
                                                         prompts: list[list[int]], reference_a: dict[str, Any],
                                                         other_process: list[dict[str, Any]]) -> None:
    url = f"redis://{redis_server.address}/0"
    n = max_tokens(reference_a)
    writer = other_process[1]  # wrote to Redis from another process
    assert writer["tokens"] == reference_a["tokens"]
    assert writer["manager"]["blocks_stored"] >= 3

    reader = run_engine(model_a, spec(url), prompts, n)
    assert reader["tokens"] == reference_a["tokens"]
    assert reader["cached"][0] == SHARED
    assert reader["manager"]["store_blocks_found"] >= 3

    # Model B has model A's KV shape and sees the same prompts: it must not read one of A's keys.
    reference_b = run_engine(model_b, None, prompts, n)
    other = run_engine(model_b, spec(url, write_to_store=False), prompts, n)
    assert other["tokens"] == reference_b["tokens"]
    assert other["cached"][0] == 0
    assert other["manager"]["store_blocks_found"] == 0
    assert other["manager"]["store"]["hits"] == 0

    redis_server.kill()
    try:
        dead = run_engine(model_a, spec(url + "?timeout=0.2"), prompts, n)
    finally:
        redis_server.start()
    assert dead["tokens"] == reference_a["tokens"]
    assert dead["cached"][0] == 0
    assert dead["manager"]["store"]["errors"] >= 1


@pytest.mark.skipif(redis_server_missing() is not None, reason=str(redis_server_missing()))
def test_redis_cluster_with_a_node_down(tmp_path: Path, model_a: str, prompts: list[list[int]],
                                        reference_a: dict[str, Any]) -> None:
    n = max_tokens(reference_a)
    with RedisClusterServers(tmp_path / "cluster", masters=3) as cluster:
        url = cluster.url + "?timeout=0.2"
        writer = run_engine(model_a, spec(url), prompts, n)
        assert writer["tokens"] == reference_a["tokens"]
        cluster.nodes[0].kill()
        reader = run_engine(model_a, spec(url, write_to_store=False), prompts, n)
    assert reader["tokens"] == reference_a["tokens"]
    # Keys are spread over the masters: the prefix loads up to the first block on the dead node.
    assert reader["cached"][0] in (0, BLOCK, 2 * BLOCK, SHARED)
    assert reader["manager"]["store"]["errors"] >= 1 or reader["cached"][0] == SHARED

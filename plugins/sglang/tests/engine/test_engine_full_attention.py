"""Real SGLang generating tokens on kvcore's caches: a tiny random-weight Llama on the CPU.

For every ``kvcore-*`` name the installed SGLang serves on a full-attention model (kvcore-sglang's
own targets that serve ``full`` on this version, as its contract module's ``SERVED`` says where it
narrows them, and the names other distributions declare, e.g. ``kvcore-example``),
at page size 1 and 16, SGLang runs one workload (``harness.run_workload``: rounds of concurrent
requests with shared prefixes, multi-turn continuations, prompts longer than the 32-token prefill
chunk, a 384-token pool that evicts and retracts, two streamed requests aborted after their first
token) once on SGLang's own default cache and once on the kvcore cache, each in a fresh
``sglang.Engine``. Every request's greedy tokens and ``meta_info["cached_tokens"]`` must be equal
(``kvcore-chunk`` against ``--disable-radix-cache``, SGLang's own no-reuse cache); an aborted request
must be aborted in both, with the same cached tokens, and one's tokens a prefix of the other's (how
many tokens it made before the abort arrived is timing). SGLang's log must show the kvcore backend
(``Tree cache initialized: source=registered('kvcore-...')``) and no failure: SGLang's scheduler runs
its idle memory check (``available + evictable + protected == total`` for the token pool, every
request slot free) on every idle pass, with ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``, so a
leak raises in the scheduler; SGLang then kills the engine's processes (each engine runs in a
child process of its own) and the test fails with the log's failure lines. One real
``python -m sglang.launch_server`` with ``kvcore-radix`` answers the same workload over HTTP
exactly as the default engine does.

What is not SGLang's own here: ``cpu_stand_ins/sgl_kernel`` stands in for the ``sgl_kernel``
package, whose CPU build is not on the package index. SGLang's CPU engine imports a few ``*_cpu``
kernels from it when its modules load (``mem_cache/allocation.py``,
``kernels/ops/kvcache/cache_move.py``, the speculative modules); on a CPU without AMX these runs
call none of them (every layer takes SGLang's plain torch path), and each stand-in raises if called.
SGLang's Triton kernels (the paged allocator's) run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
from kvcore_sglang.plugin import declared_targets

from plugins.sglang.tests.engine.harness import Config, Result, leak_lines, served_names, tree_cache_lines

SGLANG = version("sglang")
PAGES = (1, 16)


def _full_attention_names() -> list[str]:
    names = served_names("full")
    for name, ep in declared_targets():
        target = ep.load()
        if "full" in target.serves:
            names.append(name)
    return names


NAMES = _full_attention_names()


def baseline_of(name: str, page: int) -> Config:
    # kvcore-chunk is SGLang's no-reuse cache: what --disable-radix-cache builds.
    if name == "kvcore-chunk":
        return Config(None, page, disable_radix_cache=True)
    return Config(None, page)


def assert_clean(result: Result, label: str) -> None:
    bad = leak_lines(result.log)
    assert not bad, f"{label}: SGLang's log reports a failure or leak:\n" + "\n".join(bad[:20])


def assert_same_answers(got: Result, want: Result, label: str) -> None:
    assert list(got.rounds) == list(want.rounds)
    for name, answers in want.rounds.items():
        mine = got.rounds[name]
        assert len(mine) == len(answers), f"{label}: round {name}"
        for i, (a, b) in enumerate(zip(mine, answers)):
            where = f"{label}: round {name!r}, request {i}"
            assert a.cached_tokens == b.cached_tokens, f"{where}: cached_tokens {a.cached_tokens} != {b.cached_tokens}"
            if name == "aborted":
                assert a.finish == b.finish == "abort", f"{where}: finish {a.finish} / {b.finish}"
                n = min(len(a.output_ids), len(b.output_ids))
                assert n >= 1 and a.output_ids[:n] == b.output_ids[:n], f"{where}: {a.output_ids} / {b.output_ids}"
            else:
                assert a.finish == b.finish, f"{where}: finish {a.finish} != {b.finish}"
                assert a.output_ids == b.output_ids, f"{where}: tokens {a.output_ids} != {b.output_ids}"


def assert_workload_ran(result: Result, page: int, reuse: bool) -> None:
    """The workload did what it is for on SGLang's own cache: prefixes reused, then evicted."""
    rounds = result.rounds
    cached = [a.cached_tokens for r in rounds.values() for a in r]
    if not reuse:
        assert not any(cached), f"a cache without reuse reported cached tokens: {cached}"
        return
    assert rounds["shared-prefix"][1].cached_tokens >= 32, rounds["shared-prefix"]
    assert rounds["multi-turn"][0].cached_tokens > 40, rounds["multi-turn"]
    # The first family was cached (40 tokens, two 16-token pages) and is gone after the pool filled.
    assert rounds["after-eviction"][0].cached_tokens < 32, rounds["after-eviction"]
    assert all(a.cached_tokens % page == 0 for r in rounds.values() for a in r)
    assert [a.finish for a in rounds["aborted"]] == ["abort", "abort"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("name", NAMES)
def test_engine_matches_sglang(engine_run, name: str, page: int) -> None:
    base = baseline_of(name, page)
    want = engine_run(base)
    assert_clean(want, base.label)
    assert [src for src, _ in tree_cache_lines(want.log)] == ["default"]
    assert_workload_ran(want, page, reuse=not base.disable_radix_cache)

    got = engine_run(Config(name, page))
    assert_clean(got, name)
    lines = tree_cache_lines(got.log)
    assert [src for src, _ in lines] == [f"registered('{name}')"], lines
    assert lines[0][1].startswith("Kvcore"), lines
    assert_same_answers(got, want, f"{name} page {page} (SGLang {SGLANG})")


def test_http_server_matches_engine(engine_run) -> None:
    """One real launch_server with kvcore-radix, over loopback HTTP, against the default engine."""
    want = engine_run(Config(None, 1))
    got = engine_run(Config("kvcore-radix", 1), http=True)
    assert_clean(got, "launch_server kvcore-radix")
    assert [src for src, _ in tree_cache_lines(got.log)] == ["registered('kvcore-radix')"]
    assert_same_answers(got, want, f"launch_server kvcore-radix (SGLang {SGLANG})")


"""Discovery through the real entry-point machinery, isolation, registration rules."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest

import kvcore
from kvcore import BackendNotFound, ConfigError, available_backends, create_cache, hookimpl, plugin_failures
from kvcore.plugins import BLOCK_ENV, DISABLE_AUTOLOAD_ENV, get_backend, get_plugin_manager
from kvcore.testing.distributions import make_dist

TOY = '''
import kvcore

class ToyCache(kvcore.ChunkCache):
    """A toy third-party backend."""

class ToyConfig(kvcore.CacheConfig):
    flavour: str = "plain"

@kvcore.hookimpl
def kvcore_register_backends(register):
    register("{name}", ToyCache, config=ToyConfig, description="{description}")
'''


def run_kvcore(args, path: Path, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kvcore", *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def site(tmp_path):
    make_dist(tmp_path, "toy-kv", "toy_kv", TOY.format(name="toy", description="toy backend"))
    make_dist(tmp_path, "broken-kv", "broken_kv", "raise ImportError('needs libfoo')\n", version="0.1")
    make_dist(tmp_path, "typo-kv", "typo_kv", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_backend(register):  # misspelt: no such hook
            pass
    """)
    make_dist(tmp_path, "raising-kv", "raising_kv", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_backends(register):
            raise RuntimeError("registration blew up")
    """)
    return tmp_path


def test_third_party_backend_is_listed_and_broken_ones_are_reported(site):
    out = run_kvcore(["backends", "--json"], site)
    assert out.returncode == 1, out.stderr  # a plugin failed to load: CI sees it in the status
    data = json.loads(out.stdout)
    names = {b["name"]: b for b in data["backends"]}
    assert names["toy"]["distribution"] == "toy-kv" and names["toy"]["version"] == "1.0"
    assert names["toy"]["description"] == "toy backend"
    assert "flavour" in names["toy"]["options"]
    assert names["chunk"]["distribution"] == "kvcore"
    failed = {f["plugin"]: f for f in data["failed"]}
    assert "needs libfoo" in failed["broken_kv"]["error"] and failed["broken_kv"]["distribution"] == "broken-kv"
    assert "kvcore_register_backend" in failed["typo_kv"]["error"]
    assert "registration blew up" in failed["raising_kv"]["error"]


def test_third_party_backend_runs_in_bench(site):
    out = run_kvcore(["bench", "--backend", "toy", "--num-requests", "16", "--json"], site)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    report = report[0] if isinstance(report, list) else report
    assert report["backend"] == "toy" and report["leaked_slots"] == 0


def test_table_output_lists_failures(site):
    out = run_kvcore(["backends"], site)
    assert out.returncode == 1
    assert "toy" in out.stdout and "failed: broken_kv (broken-kv)" in out.stdout


def test_disable_autoload_keeps_only_builtins(site):
    out = run_kvcore(["backends", "--json"], site, {DISABLE_AUTOLOAD_ENV: "1"})
    data = json.loads(out.stdout)
    assert [b["name"] for b in data["backends"]] == ["chunk"] and data["failed"] == []


def test_block_one_plugin_by_name(site):
    out = run_kvcore(["backends", "--json"], site, {BLOCK_ENV: "toy_kv,broken_kv"})
    data = json.loads(out.stdout)
    assert "toy" not in {b["name"] for b in data["backends"]}
    assert "broken_kv" not in {f["plugin"] for f in data["failed"]}


def test_duplicate_backend_name_names_both_distributions(tmp_path):
    make_dist(tmp_path, "alpha-kv", "alpha_kv", TOY.format(name="twin", description="a"))
    make_dist(tmp_path, "beta-kv", "beta_kv", TOY.format(name="twin", description="b"))
    out = run_kvcore(["bench", "--backend", "twin", "--num-requests", "4"], tmp_path)
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "alpha-kv" in err[0] and "beta-kv" in err[0] and "Traceback" not in out.stderr
    data = json.loads(run_kvcore(["backends", "--json"], tmp_path).stdout)
    assert "twin" not in {b["name"] for b in data["backends"]}
    assert {f["distribution"] for f in data["failed"]} >= {"alpha-kv", "beta-kv"}


# -- in-process ---------------------------------------------------------------------


def test_hook_kvcore_register_backends():
    """The built-in chunk backend registers through the same hook as third parties."""
    spec = available_backends()["chunk"]
    assert spec.factory is kvcore.ChunkCache and spec.config is kvcore.CacheConfig
    assert spec.distribution == "kvcore"
    impls = get_plugin_manager().hook.kvcore_register_backends.get_hookimpls()
    assert "kvcore.builtin_backends" in {i.plugin_name for i in impls}


def test_unknown_backend_lists_known_ones():
    with pytest.raises(BackendNotFound, match=r"unknown backend 'nope'; known backends: .*chunk"):
        create_cache("nope")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"size": 0}, r"backend 'chunk': option 'size': Input should be greater than 0"),
        ({"page_size": -4}, r"option 'page_size'"),
        ({"size": 10, "page_size": 4}, r"size=10 is not a multiple of page_size=4"),
        ({"colour": "red"}, r"backend 'chunk': unknown option 'colour'"),
        ({"max_num_reqs": "many"}, r"option 'max_num_reqs'"),
    ],
)
def test_bad_options_name_backend_and_field(options, message):
    with pytest.raises(ConfigError, match=message):
        create_cache("chunk", **options)


def test_absent_devices_are_clear_errors():
    with pytest.raises(kvcore.DeviceUnavailable, match="torch_npu is not installed"):
        create_cache("chunk", device="npu")
    with pytest.raises(kvcore.DeviceUnavailable, match="unknown device 'quantum'"):
        create_cache("chunk", device="quantum")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(kvcore.DeviceUnavailable, match="CUDA is not available"):
            create_cache("chunk", device="cuda")


def test_hook_kvcore_cache_created():
    """Extensions see every built cache and can wrap it."""
    seen = []

    class Extension:
        @hookimpl
        def kvcore_cache_created(self, cache):
            seen.append(cache.backend_name)

    get_plugin_manager().register(Extension(), name="ext")
    cache = create_cache("chunk", size=8, max_num_reqs=1, max_context_len=8)
    assert seen == ["chunk"] and isinstance(cache.plugin_manager, pluggy.PluginManager)


def test_hook_cache_unfinished_req():
    """A wrapper on a cache's own plugin manager sees each prefill chunk once; the backend answers."""
    from kvcore.testing import admit, finish, make_req, prefill

    cache = create_cache("chunk", size=16, max_num_reqs=2, max_context_len=16)
    seen = []

    class Chunks:
        @hookimpl(wrapper=True)
        def cache_unfinished_req(self, req, chunked):
            result = yield
            seen.append((req.rid, req.kv.kv_committed_len, chunked, result))
            return result

    cache.plugin_manager.register(Chunks())
    cache.plugin_manager.check_pending()
    req = make_req("c", list(range(10)))
    assert admit(cache, req)
    assert prefill(cache, req, upto=4) and prefill(cache, req, upto=8)
    assert seen == [("c", 4, True, True), ("c", 8, True, True)]
    finish(cache, req)
    kvcore.InvariantChecker(cache).check([req])


def test_each_cache_has_its_own_lifecycle_manager():
    a = create_cache("chunk", size=8, max_num_reqs=1, max_context_len=8)
    b = create_cache("chunk", size=8, max_num_reqs=1, max_context_len=8)
    assert a.plugin_manager is not b.plugin_manager
    assert [i.plugin_name for i in a.hook.cache_finished_req.get_hookimpls()] == ["backend"]


def test_misspelt_lifecycle_wrapper_fails_loudly():
    cache = create_cache("chunk", size=8, max_num_reqs=1, max_context_len=8)

    class Typo:
        @hookimpl(wrapper=True)
        def cache_finishd_req(self, req, is_insert):
            yield

    cache.plugin_manager.register(Typo())
    with pytest.raises(pluggy.PluginValidationError):
        cache.plugin_manager.check_pending()


def test_backend_spec_has_the_contract_fields():
    spec = get_backend("chunk")
    for field in ("factory", "config", "description", "distribution", "version"):
        assert getattr(spec, field)
    assert plugin_failures() == [] or all(f.plugin != "kvcore.builtin_backends" for f in plugin_failures())


POLICY = '''
import kvcore

class Newest:
    """Evict the most recently created leaf first."""
    def get_priority(self, node):
        return -node.creation_time

@kvcore.hookimpl
def kvcore_register_eviction_policies(register):
    register("newest", Newest)
'''


def test_hook_kvcore_register_eviction_policies(tmp_path):
    """A plugin registers an eviction policy that a tree backend then uses."""
    pytest.importorskip("kvcore_radix")
    make_dist(tmp_path, "newest-policy", "newest_policy", POLICY)
    script = textwrap.dedent('''
        import itertools, torch, kvcore
        print(",".join(kvcore.available_eviction_policies()))
        cache = kvcore.create_cache("radix", size=64, max_num_reqs=2, max_context_len=16, eviction_policy="newest")
        cache.clock = itertools.count().__next__
        for key in ([1, 2], [3, 4], [5, 6]):
            slots = cache.token_to_kv_pool_allocator.alloc(2)
            cache.insert(key, slots)
        cache.evict(2)
        print([len(cache.match_prefix(k).device_indices) for k in ([1, 2], [3, 4], [5, 6])])
        try:
            kvcore.create_cache("radix", eviction_policy="oldest-first")
        except ValueError as exc:
            print("error:", exc)
    ''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    policies, remaining, error = out.stdout.strip().splitlines()
    assert "newest" in policies.split(",") and "lru" in policies.split(",")
    assert remaining == "[2, 2, 0]"  # the newest leaf went first
    assert "backend 'radix'" in error and "'oldest-first'" in error and "newest" in error

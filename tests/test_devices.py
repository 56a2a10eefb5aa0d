"""Device kinds through ``kvcore_register_devices``: the built-ins, a third party's, errors in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcore
from kvcore import DeviceUnavailable, create_cache
from kvcore.devices import available_devices, check_device, device_kind, get_device, synchronize
from kvcore.plugins import get_plugin_manager, reset_plugins
from kvcore.pools import TokenToKVPoolAllocator
from kvcore.testing.distributions import make_dist

TOY_DEVICE = '''
import torch
import kvcore
from kvcore.pools import MHATokenToKVPool, TokenToKVPoolAllocator

BUILT = []

class ToyAllocator(TokenToKVPoolAllocator):
    def __init__(self, size, page_size=1, device="cpu"):
        BUILT.append(("allocator", str(device)))
        super().__init__(size, page_size, device)

class ToyKvPool(MHATokenToKVPool):
    def __init__(self, *args, **kwargs):
        BUILT.append(("kv_pool", str(kwargs["device"])))
        super().__init__(*args, **kwargs)

@kvcore.hookimpl
def kvcore_register_devices(register):
    # A kind of its own whose pools live in host memory.
    register("toydev", why_unavailable=lambda: None, resolve=lambda text: torch.device("cpu"),
             allocator=ToyAllocator, kv_pool=ToyKvPool, defaults={"page_size": 8},
             page_aligned_sessions=True, description="a toy device")
    register("absentdev", why_unavailable=lambda: "libabsent is not installed", description="never here")
    register("brokenprobe", why_unavailable=lambda: 1 / 0)
'''


def run_kvcore(args, path: Path, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kvcore", *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def toy_site(tmp_path, monkeypatch):
    """The toy device distribution, discovered in this process; the registry is reloaded after."""
    make_dist(tmp_path, "toy-dev", "toy_dev", TOY_DEVICE)
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugins()
    yield tmp_path
    sys.modules.pop("toy_dev", None)
    reset_plugins()


# -- the hook -------------------------------------------------------------------------


def test_hook_kvcore_register_devices(toy_site):
    """A third party registers a device kind; pools are built from its classes and defaults."""
    devices = available_devices()
    toy = devices["toydev"]
    assert toy.distribution == "toy-dev" and toy.version == "1.0" and toy.description == "a toy device"
    assert toy.availability() is None and dict(toy.defaults) == {"page_size": 8}

    cache = create_cache("chunk", size=64, max_num_reqs=2, max_context_len=32, device="toydev",
                         kv_buffer={"num_layers": 1, "num_heads": 1, "head_dim": 4})
    built = sys.modules["toy_dev"].BUILT
    assert built == [("allocator", "cpu"), ("kv_pool", "cpu")]
    assert type(cache.token_to_kv_pool_allocator).__name__ == "ToyAllocator"
    assert cache.page_size == 8  # the device's default
    assert cache.session_page_aligned is True
    assert create_cache("chunk", size=64, page_size=4, device="toydev").page_size == 4  # given beats the default
    kvcore.InvariantChecker(cache).check([])


def test_unavailable_and_broken_probes_are_reported_not_raised(toy_site):
    devices = available_devices()
    assert devices["absentdev"].availability() == "libabsent is not installed"
    assert "availability check failed: ZeroDivisionError" in devices["brokenprobe"].availability()
    with pytest.raises(DeviceUnavailable, match=r"^device 'absentdev' is not available: libabsent is not installed$"):
        create_cache("chunk", device="absentdev")


# -- built-ins ------------------------------------------------------------------------


def test_cpu_and_cuda_register_through_the_same_hook():
    devices = available_devices()
    assert {"cpu", "cuda"} <= set(devices)
    assert devices["cpu"].distribution == devices["cuda"].distribution == "kvcore"
    impls = get_plugin_manager().hook.kvcore_register_devices.get_hookimpls()
    assert "kvcore.builtin_devices" in {i.plugin_name for i in impls}
    assert devices["cpu"].availability() is None
    assert check_device("cpu") == torch.device("cpu")
    synchronize(torch.device("cpu"))  # a no-op, through the registry
    assert device_kind("cuda:1") == "cuda" and device_kind(torch.device("cpu")) == "cpu"
    assert get_device("cuda:0").name == "cuda"


def test_unknown_device_is_one_line_naming_the_registered_ones():
    with pytest.raises(DeviceUnavailable) as info:
        create_cache("chunk", device="quantum")
    msg = str(info.value)
    assert msg.startswith("unknown device 'quantum'; registered devices: cpu, cuda") and "\n" not in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_absent_is_one_line():
    with pytest.raises(DeviceUnavailable, match=r"^device 'cuda:1' is not available: CUDA is not available here"):
        create_cache("chunk", device="cuda:1")
    assert "CUDA is not available" in available_devices()["cuda"].availability()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pools_live_on_the_gpu():
    pytest.importorskip("kvcore_radix")
    cache = create_cache("radix", size=256, page_size=16, max_num_reqs=4, max_context_len=128, device="cuda",
                         kv_buffer={"num_layers": 1, "num_heads": 2, "head_dim": 8})
    engine = kvcore.Engine(cache)
    req = kvcore.Req("r", list(range(40)))
    assert engine.admit(req) and engine.extend(req)
    engine.decode([req], [1])
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :41].to(torch.int64)
    cache.kv_pool.set_kv_buffer(0, slots, torch.ones(41, 2, 8, device="cuda"), torch.ones(41, 2, 8, device="cuda"))
    synchronize(torch.device("cuda"))
    assert cache.token_to_kv_pool_allocator.free_slots().device.type == "cuda"
    engine.finish(req)
    kvcore.InvariantChecker(cache).check([])
    n = torch.cuda.device_count()
    with pytest.raises(DeviceUnavailable, match=f"only {n} CUDA device"):
        create_cache("chunk", device=f"cuda:{n}")


def test_builtin_pools_are_kvcore_own():
    cache = create_cache("chunk", size=32, max_num_reqs=2, max_context_len=16)
    assert type(cache.token_to_kv_pool_allocator) is TokenToKVPoolAllocator
    assert cache.session_page_aligned is False
    kvcore.InvariantChecker(cache).check([])


# -- registration errors, reported like backends' --------------------------------------


def test_bad_device_registrations_are_reported_and_do_not_stop_others(tmp_path):
    make_dist(tmp_path, "bad-dev", "bad_dev", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_devices(register):
            register("weird", why_unavailable=lambda: None, defaults={"colour": "red"})
    """)
    make_dist(tmp_path, "alpha-dev", "alpha_dev", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_devices(register):
            register("twin", why_unavailable=lambda: None)
    """)
    make_dist(tmp_path, "beta-dev", "beta_dev", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_devices(register):
            register("twin", why_unavailable=lambda: None)
    """)
    make_dist(tmp_path, "cpu-thief", "cpu_thief", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_devices(register):
            register("cpu", why_unavailable=lambda: None)
    """)
    out = run_kvcore(["backends", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    names = {d["name"]: d for d in data["devices"]}
    assert names["cpu"]["distribution"] == "kvcore" and "weird" not in names and "twin" not in names
    failed = {f["plugin"]: f["error"] for f in data["failed"]}
    assert "device registration failed" in failed["bad_dev"] and "'colour'" in failed["bad_dev"]
    assert "alpha-dev" in failed["alpha_dev"] and "beta-dev" in failed["alpha_dev"]
    assert "already provided by kvcore" in failed["cpu_thief"]
    # The conflict is one line where the device is asked for.
    out = run_kvcore(["bench", "--backend", "chunk", "--device", "twin", "--num-requests", "4"], tmp_path)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1 and "alpha-dev" in err[0] and "beta-dev" in err[0]


# -- the CLI ---------------------------------------------------------------------------


def test_backends_lists_devices_with_availability(toy_site):
    out = run_kvcore(["backends", "--json"], toy_site)
    assert out.returncode == 0, out.stderr
    devices = {d["name"]: d for d in json.loads(out.stdout)["devices"]}
    assert devices["cpu"]["available"] is True and devices["cpu"]["why_not"] is None
    assert devices["absentdev"] == {**devices["absentdev"], "available": False, "why_not": "libabsent is not installed"}
    assert devices["toydev"]["defaults"] == {"page_size": 8} and devices["toydev"]["page_aligned_sessions"] is True
    table = run_kvcore(["backends"], toy_site)
    assert "  cpu (kvcore " in table.stdout and "): available" in table.stdout
    assert "absentdev (toy-dev 1.0): not available: libabsent is not installed" in table.stdout


def test_bench_device_choices_come_from_the_registry(toy_site):
    out = run_kvcore(["bench", "--backend", "chunk", "--device", "tpu", "--num-requests", "4"], toy_site)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1
    assert "unknown device 'tpu'; registered devices:" in err[0] and "toydev" in err[0]
    assert "Traceback" not in out.stderr
    out = run_kvcore(["bench", "--backend", "chunk", "--device", "absentdev", "--num-requests", "4"], toy_site)
    assert out.returncode == 1 and out.stderr.strip() == (
        "kvcore: error: device 'absentdev' is not available: libabsent is not installed"
    )
    out = run_kvcore(["bench", "--backend", "chunk", "--device", "toydev", "--num-requests", "8", "--json",
                      "--no-reference"], toy_site)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["leaked_slots"] == 0 and report["invariant_violations"] == 0


def test_listing_devices_imports_no_heavy_module(tmp_path):
    """A findable torch_npu is reported available, yet listing never imports it."""
    marker = tmp_path / "imported"
    (tmp_path / "torch_npu.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    out = run_kvcore(["backends", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert not marker.exists()
    devices = {d["name"]: d for d in json.loads(out.stdout)["devices"]}
    if "npu" in devices:
        assert devices["npu"]["available"] is True

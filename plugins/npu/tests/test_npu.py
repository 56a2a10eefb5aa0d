"""kvcore-npu on the CPU: the NPU allocator, the 5-D K/V pool, torch_npu dispatch (against a fake), the
session rule, the device's errors and the CLI.  No test here runs on Ascend hardware."""

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from kvcore_npu import NPUMHATokenToKVPool, NPUPagedTokenToKVPoolAllocator
from kvcore_npu.device import why_unavailable

import kvcore
from kvcore import DeviceUnavailable, Engine, InvariantChecker, Req, StreamingSession, create_cache
from kvcore.devices import available_devices, check_device, synchronize
from kvcore.pools import TokenToKVPoolAllocator

HAVE_TORCH_NPU = why_unavailable() is None and "torch_npu" not in sys.modules


class RecordingFakeTorchNpu(types.ModuleType):
    """A FAKE ``torch_npu`` module for tests on the CPU: it records every call it gets and does
    what the real op would do with plain indexing.  It is not torch_npu and proves nothing about Ascend."""

    def __init__(self, npus: int = 0):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []
        fake = self

        class _Npu:
            @staticmethod
            def is_available():
                fake.calls.append(("npu.is_available", {}))
                return npus > 0

            @staticmethod
            def device_count():
                return npus

            @staticmethod
            def synchronize(device=None):
                fake.calls.append(("npu.synchronize", {"device": device}))

        self.npu = _Npu()

    def _npu_reshape_and_cache(self, *, key, value, key_cache, value_cache, slot_indices):
        self.calls.append(("_npu_reshape_and_cache", dict(key=key, value=value, key_cache=key_cache,
                                                          value_cache=value_cache, slot_indices=slot_indices)))
        p = key_cache.shape[1]
        idx = slot_indices.to(torch.int64)
        key_cache[idx // p, idx % p] = key
        value_cache[idx // p, idx % p] = value


@pytest.fixture
def fake_torch_npu(monkeypatch):
    def install(npus: int = 0) -> RecordingFakeTorchNpu:
        fake = RecordingFakeTorchNpu(npus)
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        return fake

    return install


def run_kvcore(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "kvcore", *args], capture_output=True, text=True, env=env,
                          timeout=300)


# --------------------------------------------------------------------------- allocator


def _pair(size, page):
    return TokenToKVPoolAllocator(size, page), NPUPagedTokenToKVPoolAllocator(size, page)


@pytest.mark.parametrize("page", [4, 128])
def test_allocator_matches_the_paged_allocator_with_int32_batch_results(page):
    """Same slots and free lists as kvcore's paged allocator (SGLang's CUDA one); alloc_extend /
    alloc_decode come back int32 as SGLang's NPU class returns them, plain alloc int64."""
    rng = random.Random(page)
    base, npu = _pair(48 * page, page)
    rows: list[list[int]] = []  # each "request": its slots, in row order
    for step in range(300):
        op = rng.random()
        if op < 0.35:
            bs = rng.randrange(1, 4)
            pre, seq, last, owners = [], [], [], []
            for _ in range(bs):
                r = rng.choice(rows) if rows and rng.random() < 0.5 else None
                if r is not None and any(r is o for o in owners):
                    r = None
                a = len(r) if r is not None else 0
                pre.append(a)
                seq.append(a + rng.randrange(1, 3 * page + 2))
                last.append(r[-1] if r else -1)
                owners.append(r)
            n = sum(seq) - sum(pre)
            got = [al.alloc_extend(pre, pre, seq, seq, last, n) for al in (base, npu)]
            assert (got[0] is None) == (got[1] is None), step
            if got[1] is None:
                continue
            assert got[1].dtype == torch.int32 and got[0].tolist() == got[1].tolist(), step
            out = got[1].tolist()
            k = 0
            for r, a, b in zip(owners, pre, seq):
                new = out[k : k + b - a]
                k += b - a
                if r is None:
                    rows.append(new)
                else:
                    r.extend(new)
        elif op < 0.55 and rows:
            batch = rng.sample(rows, min(len(rows), rng.randrange(1, 4)))
            seq = [len(r) + 1 for r in batch]
            last = [r[-1] for r in batch]
            got = [al.alloc_decode(seq, seq, last) for al in (base, npu)]
            assert (got[0] is None) == (got[1] is None), step
            if got[1] is not None:
                assert got[1].dtype == torch.int32 and got[0].tolist() == got[1].tolist(), step
                for r, s in zip(batch, got[1].tolist()):
                    r.append(s)
        elif op < 0.65:
            n = page * rng.randrange(0, 3)
            got = [al.alloc(n) for al in (base, npu)]
            if got[1] is not None:
                assert got[1].dtype == torch.int64 and got[0].tolist() == got[1].tolist()
                if got[1].numel():
                    rows.append(got[1].tolist())
        elif rows:
            r = rows.pop(rng.randrange(len(rows)))
            for al in (base, npu):
                al.free(torch.tensor(r, dtype=torch.int32))
        assert base.free_slots().tolist() == npu.free_slots().tolist(), step
    for r in rows:
        npu.free(torch.tensor(r))
    assert npu.available_size() == 48 * page


def test_allocator_refuses_bad_frees_and_short_pools():
    npu = NPUPagedTokenToKVPoolAllocator(4 * 128, 128)
    slots = npu.alloc_extend([0], [0], [300], [300], [-1], 300)
    assert slots is not None and slots.dtype == torch.int32 and npu.available_size() == 128
    assert npu.alloc_extend([0], [0], [200], [200], [-1], 200) is None  # 2 pages, 1 left: nothing taken
    assert npu.available_size() == 128
    with pytest.raises(ValueError, match="extend_num_tokens"):
        npu.alloc_extend([0], [0], [10], [10], [-1], 11)
    npu.free(slots)
    with pytest.raises(ValueError, match="double free"):
        npu.free(slots[:1])
    with pytest.raises(ValueError, match="padding or out of range"):
        npu.free(torch.tensor([3]))
    assert npu.available_size() == 4 * 128


# --------------------------------------------------------------------------- the 5-D K/V pool


def test_kv_pool_is_one_5d_buffer_written_by_indexing_off_npu():
    pool = NPUMHATokenToKVPool(4 * 8, 8, torch.float32, head_num=2, head_dim=3, layer_num=2, device="cpu")
    assert pool.k_buffer.shape == pool.v_buffer.shape == (2, 5, 8, 2, 3)
    assert pool.use_npu_ops is False
    assert pool.get_key_buffer(1).shape == (5, 8, 2, 3)
    loc = torch.tensor([8, 17, 39], dtype=torch.int32)
    k = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3)
    pool.set_kv_buffer(1, loc, k, -k)
    assert torch.equal(pool.k_buffer[1, 1, 0], k[0]) and torch.equal(pool.k_buffer[1, 2, 1], k[1])
    assert torch.equal(pool.v_buffer[1, 4, 7], -k[2])
    assert pool.k_buffer[0].abs().sum() == 0 and pool.mem_usage_bytes() == 2 * 2 * 5 * 8 * 2 * 3 * 4
    assert "torch_npu" not in sys.modules or isinstance(sys.modules["torch_npu"], types.ModuleType)


def test_kv_writes_dispatch_to_torch_npu_reshape_and_cache(fake_torch_npu):
    """With the NPU ops on, each write is one ``_npu_reshape_and_cache`` per layer with SGLang's
    arguments: int32 slot indices and the layer's buffer viewed as (pages, page_size, heads, dim)."""
    fake = fake_torch_npu()
    plain = NPUMHATokenToKVPool(4 * 8, 8, torch.float16, 2, 3, 2, "cpu")
    via_op = NPUMHATokenToKVPool(4 * 8, 8, torch.float16, 2, 3, 2, "cpu", use_npu_ops=True)
    loc = torch.tensor([9, 10, 31, 32], dtype=torch.int64)
    k = torch.randn(4, 2, 3)
    for pool in (plain, via_op):
        pool.set_kv_buffer(0, loc, k, 2 * k)
    assert [name for name, _ in fake.calls] == ["_npu_reshape_and_cache"]
    args = fake.calls[0][1]
    assert args["slot_indices"].dtype == torch.int32 and args["slot_indices"].tolist() == loc.tolist()
    assert args["key_cache"].shape == (5, 8, 2, 3)
    assert args["key_cache"].data_ptr() == via_op.k_buffer[0].data_ptr()
    assert args["value_cache"].data_ptr() == via_op.v_buffer[0].data_ptr()
    assert args["key"].dtype == torch.float16
    assert torch.equal(plain.k_buffer, via_op.k_buffer) and torch.equal(plain.v_buffer, via_op.v_buffer)


# --------------------------------------------------------------------------- the device


@pytest.mark.skipif(HAVE_TORCH_NPU, reason="torch_npu is installed here")
def test_device_npu_without_torch_npu_is_one_line():
    assert available_devices()["npu"].availability().startswith("torch_npu is not installed")
    for backend in ("radix", "npu", "chunk"):
        with pytest.raises(DeviceUnavailable) as info:
            create_cache(backend, device="npu")
        assert str(info.value).startswith("device 'npu' is not available: torch_npu is not installed")
    assert "torch_npu" not in sys.modules


def test_device_npu_with_a_fake_torch_npu_but_no_npu(fake_torch_npu):
    fake = fake_torch_npu(npus=0)
    assert available_devices()["npu"].availability() is None
    with pytest.raises(DeviceUnavailable, match="torch_npu is installed but finds no Ascend NPU here"):
        create_cache("radix", device="npu")
    assert ("npu.is_available", {}) in fake.calls


def test_device_npu_index_and_synchronize_go_through_torch_npu(fake_torch_npu):
    fake = fake_torch_npu(npus=1)
    with pytest.raises(DeviceUnavailable, match=r"'npu:3' requested but only 1 Ascend NPU"):
        check_device("npu:3")
    with pytest.raises(DeviceUnavailable, match="not an npu device"):
        check_device("npu:x")
    synchronize(torch.device("cpu"))  # the CPU's no-op: the fake sees nothing
    assert not [c for c in fake.calls if c[0] == "npu.synchronize"]
    from kvcore_npu import device

    device.synchronize("npu:0")
    assert ("npu.synchronize", {"device": "npu:0"}) in fake.calls


# --------------------------------------------------------------------------- the backend


def _engine_run(cache, n_prompt=300, n_decode=140):
    engine = Engine(cache)
    req = Req("r", list(range(1, n_prompt + 1)))
    assert engine.admit(req) and engine.extend(req)
    for t in range(n_decode):
        assert engine.decode([req], [t])
    return engine, req


def test_backend_npu_is_the_radix_tree_on_npu_pools_at_page_128():
    cache = create_cache("npu", size=16 * 128, max_num_reqs=4, max_context_len=1024,
                         kv_buffer={"num_layers": 2, "num_heads": 2, "head_dim": 4})
    assert cache.page_size == 128 and cache.session_page_aligned is True
    assert type(cache.token_to_kv_pool_allocator) is NPUPagedTokenToKVPoolAllocator
    assert isinstance(cache.kv_pool, NPUMHATokenToKVPool) and cache.kv_pool.k_buffer.shape == (2, 17, 128, 2, 4)
    assert type(cache).__name__ == "UnifiedRadixCache" and cache.radix and cache.backend_name == "npu"
    # One tree implementation, the core's: no kvcore-npu module imports kvcore_radix or looks a backend up.
    import kvcore_npu

    sources = [p.read_text() for p in Path(kvcore_npu.__file__).parent.glob("*.py")]
    assert not [src for src in sources if "import kvcore_radix" in src or "from kvcore_radix" in src]
    assert not [src for src in sources if "get_backend" in src]
    engine, req = _engine_run(cache)
    written = []
    engine.kv_writer = written.append
    engine.decode([req], [0])
    assert written[0].dtype == torch.int32  # alloc_decode's int32, written into the int32 row as is
    engine.finish(req)
    InvariantChecker(cache).check([])
    again = Req("r2", list(range(1, 301)))
    m = engine.match(again)
    assert m.prefix_len == 256 and m.result.device_indices.dtype == torch.int64
    engine.cancel(m)
    InvariantChecker(cache).check([])


def test_radix_on_any_device_keeps_its_pools_and_the_npu_backend_its_options():
    with pytest.raises(kvcore.ConfigError, match="backend 'npu': unknown option 'key_validation'"):
        create_cache("npu", key_validation="stored")
    cache = create_cache("npu", size=8 * 128, page_size=64, eviction_policy="lfu")
    assert cache.page_size == 64 and cache.eviction_policy == "lfu"
    InvariantChecker(cache).check([])


def _session_turns(backend, first_len):
    cache = StreamingSession(create_cache(backend, size=32 * 128, page_size=128, max_num_reqs=4,
                                          max_context_len=2048))
    engine = Engine(cache)
    t1 = Req("t1", list(range(1, first_len + 1)), session_id="s")
    assert engine.admit(t1) and engine.extend(t1)
    engine.decode([t1], [7])
    engine.finish(t1)
    t2 = Req("t2", t1.fill_ids + list(range(500, 540)), session_id="s")
    assert engine.admit(t2)
    reused, live = t2.kv.kv_committed_len, len(cache.session_slots())
    InvariantChecker(cache).check([t2, *cache.session_slots()])
    assert engine.extend(t2)
    engine.finish(t2)
    InvariantChecker(cache).check(cache.session_slots())
    engine.end_session("s")
    InvariantChecker(cache).check([])
    return reused, live


def test_sessions_reuse_only_page_aligned_prefixes_on_npu_pools():
    # 300 prompt tokens + 1 decoded: radix reuses all 301 (minus nothing), npu the 256 of two whole pages.
    assert _session_turns("radix", 300) == (301, 1)
    assert _session_turns("npu", 300) == (256, 1)
    # Under one page: SGLang's NPU rule releases the session and the turn is prefilled afresh.
    assert _session_turns("radix", 100) == (101, 1)
    assert _session_turns("npu", 100) == (0, 0)


# --------------------------------------------------------------------------- the CLI


@pytest.mark.skipif(HAVE_TORCH_NPU, reason="torch_npu is installed here")
def test_cli_lists_npu_and_fails_in_one_line_without_torch_npu():
    out = run_kvcore("backends")
    assert out.returncode == 0, out.stderr
    assert "npu (kvcore-npu 0.1.0): not available: torch_npu is not installed" in out.stdout
    data = json.loads(run_kvcore("backends", "--json").stdout)
    assert "npu" in {b["name"] for b in data["backends"]}
    npu = {d["name"]: d for d in data["devices"]}["npu"]
    assert npu["available"] is False and npu["defaults"] == {"page_size": 128}
    out = run_kvcore("bench", "--backend", "radix", "--device", "npu")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "kvcore: error: device 'npu' is not available: torch_npu is not installed "
        "(pip install torch-npu, which needs the Ascend CANN toolkit)"
    ]


def test_cli_bench_npu_on_cpu_has_no_leaks():
    out = run_kvcore("bench", "--backend", "npu", "--device", "cpu", "--num-requests", "48", "--write-kv", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for r in (report, report["reference"]):
        assert r["leaked_slots"] == 0 and r["leaked_rows"] == 0 and r["invariant_violations"] == 0
    assert report["backend"] == "npu" and report["reference"]["backend"] == "radix"
    assert report["hit_rate"] == report["reference"]["hit_rate"]  # one tree, same page size: same hits


def test_listing_and_building_on_cpu_never_import_torch_npu():
    script = (
        "import sys, kvcore\n"
        "kvcore.available_backends(); [d.availability() for d in kvcore.devices.available_devices().values()]\n"
        "kvcore.create_cache('npu', size=1024, kv_buffer={'num_layers': 1, 'num_heads': 1, 'head_dim': 2})\n"
        "print('torch_npu' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

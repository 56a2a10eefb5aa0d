"""The K/V paths the bench runs on a device, on the CPU here and on CUDA where there is one.

The ``cuda`` cases are marked ``cuda`` (``benchmarks/device_check.sh`` runs ``pytest -m cuda``)
and skip without CUDA; the ``cpu`` cases run the same code everywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import kvcore
from kvcore.bench import run_bench
from kvcore.bench.kvwriter import make_kv_writer
from kvcore.devices import synchronize

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs CUDA")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_writer_puts_the_bytes_index_copy_puts(device, page_size):
    """The bench's writer (set_kv_buffer per layer) against index_copy_ of the same rows, byte for byte,
    on slots the engine hands out, tiled past its source rows."""
    pytest.importorskip("kvcore_radix")
    cache = kvcore.create_cache(
        "radix", size=1024, page_size=page_size, max_num_reqs=4, max_context_len=512, device=device,
        kv_buffer={"num_layers": 3, "num_heads": 2, "head_dim": 16, "dtype": "float16"},
    )
    dev = torch.device(device)
    writer = make_kv_writer(cache, dev, rows=32, layers=3, heads=2, head_dim=16)
    batches: list[torch.Tensor] = []

    def recording(slots: torch.Tensor) -> None:
        batches.append(slots.clone())
        writer(slots)

    engine = kvcore.Engine(cache, kv_writer=recording)
    reqs = [kvcore.Req(f"r{i}", list(range(i * 1000, i * 1000 + 70 + 30 * i))) for i in range(3)]
    for r in reqs:
        assert engine.admit(r) and engine.extend(r)
    engine.decode(reqs, [1, 2, 3])
    synchronize(dev)
    pool = cache.kv_pool
    assert pool.k_buffer[0].device.type == dev.type and writer.src.device.type == dev.type
    assert all(b.device.type == dev.type for b in batches)
    allocated = sum(r.kv.kv_allocated_len for r in reqs)
    assert sum(b.numel() for b in batches) == allocated  # every token written once
    assert writer.bytes_written == allocated * 2 * 3 * 2 * 16 * 2  # K and V, 3 layers, 2 heads x 16, float16
    # Each batch's K and V are the writer's source rows, tiled past 32; rebuild them with index_copy_.
    want = [torch.zeros_like(b) for b in pool.k_buffer]
    for slots in batches:
        n = slots.numel()
        rows = torch.cat([writer.src] * (-(-n // writer.src.shape[0])))[:n]
        for layer in range(3):
            want[layer].index_copy_(0, slots.to(torch.int64), rows)
    for layer in range(3):
        assert torch.equal(pool.k_buffer[layer], want[layer]) and torch.equal(pool.v_buffer[layer], want[layer])
    for r in reqs:
        engine.finish(r)
    kvcore.InvariantChecker(cache).check([])


@pytest.mark.parametrize("device", DEVICES)
def test_bench_writes_kv_on_the_device_and_leaks_nothing(device):
    """``kvcore bench --device DEVICE --write-kv`` in small: every prefill and decode token's K/V is written."""
    pytest.importorskip("kvcore_swa")
    (rep,) = run_bench(["swa"], num_requests=6, device=device, write_kv=True, check_every=4, size=8192,
                       swa_size=4096)
    assert rep["device"] == device
    assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
    assert rep["invariant_checks"] > 0 and rep["invariant_violations"] == 0  # the bench's checker, at the end too
    token_bytes = 2 * 4 * 8 * 128 * 2  # the bench's K/V shape: K and V, 4 layers, 8 heads x 128, float16
    computed = rep["prompt_tokens"] - rep["cached_tokens"] + rep["retract_recomputed_tokens"]
    assert rep["kv_bytes_written"] % token_bytes == 0
    assert rep["kv_bytes_written"] >= computed * token_bytes > 0


def _is_mark(node: ast.AST, name: str) -> bool:
    """``pytest.mark.<name>`` or a call of it."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark")


def _needs_cuda(node: ast.AST) -> bool:
    """``pytest.mark.skipif(not <...>.cuda.is_available(), ...)``: a test that runs only with CUDA."""
    if not (isinstance(node, ast.Call) and _is_mark(node, "skipif") and node.args):
        return False
    cond = node.args[0]
    return (isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not) and isinstance(cond.operand, ast.Call)
            and ast.unparse(cond.operand.func).endswith("cuda.is_available"))


def test_every_test_that_needs_cuda_is_marked_cuda():
    """The device check runs ``pytest -m cuda``: a CUDA-only test without the marker would never run there."""
    root = Path(__file__).resolve().parents[1]
    files = sorted([*root.glob("tests/*.py"), *root.glob("plugins/*/tests/*.py")])
    found, unmarked = 0, []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for parent in ast.walk(tree):
            groups = []
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                groups.append(parent.decorator_list)
            if isinstance(parent, (ast.List, ast.Tuple)):
                groups.append(parent.elts)
            if isinstance(parent, ast.keyword) and parent.arg == "marks":
                groups.append([parent.value])
            for group in groups:
                for node in group:
                    if _needs_cuda(node):
                        found += 1
                        if not any(_is_mark(other, "cuda") for other in group):
                            unmarked.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found >= 5  # test_pools, test_devices, test_hisparse, test_hisparse_device and this module
    assert unmarked == [], f"CUDA-only tests without @pytest.mark.cuda: {unmarked}"

"""A stand-in for ``sgl_kernel`` on a CPU-only machine, for the real-engine tests only.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports a few ``*_cpu`` kernels from
``sgl_kernel`` when its modules load, and no CPU build of ``sgl_kernel`` can be installed from
the package index.  The paths the tests run (a tiny Llama, greedy decoding, no speculative
decoding, no AMX) never call them: every name here raises if it is ever called, so a test that
reached one would fail rather than compute something else.
"""

from typing import Any, NoReturn

__version__ = "0.0.0+kvcore-test-stand-in"


def _stand_in(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is the CPU tests' stand-in, which "
            "only provides the names SGLang imports; install a real sgl_kernel build to run it"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


# What SGLang's CPU modules import by name (mem_cache/allocation.py,
# kernels/ops/kvcache/cache_move.py, the speculative modules).
_NAMES = (
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _NAMES:
    globals()[_name] = _stand_in(_name)
del _name

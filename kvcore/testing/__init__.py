"""kvcore's conformance suite, shipped with the package so every backend runs it.

A backend author (ours or a third party) subclasses
:class:`PrefixCacheConformance` in a pytest module, the way fsspec ships its
abstract filesystem tests; one line names the registered backend::

    # tests/test_conformance.py of a plugin distribution
    from kvcore.testing import PrefixCacheConformance


    class TestMyCacheConformance(PrefixCacheConformance):
        backend = "my-backend"

The kit builds it through ``kvcore.create_cache(backend, **options)``; page sizes
come from the backend's config (``page_size`` default; 1 means ``(1, 16)``), prefix
reuse from ``cache.is_chunk_cache()``.  Class attributes override them
(``page_sizes``, ``supports_prefix_reuse``, ``backend_options``), and a
``make_cache`` fixture override builds a backend the registry does not know.
Sliding-window backends subclass :class:`kvcore.testing.swa.SWACacheConformance`
the same way.

Run it with ``pytest --import-mode=importlib``.  The class holds scenario tests
(no reuse for chunk caches, finished requests cache or free every slot,
lock/unlock accounting, eviction frees only unlocked entries, insert returns the
cached prefix length, extra_key isolation, bad input leaves state unchanged,
chunked prefill then finish, streaming sessions, reset returns every slot) and a
hypothesis state machine over match/insert/lock/unlock/evict/admit/prefill
chunk/decode/finish, and ``test_fuzz``: a short seeded ``kvcore fuzz`` run (the same
engine, :mod:`kvcore.fuzz`) per page size, bad inputs mixed in.  Every test ends with
``kvcore.InvariantChecker``.  kvcore's ``pytest11`` entry point registers this package
for pytest's assertion rewriting, so a failing kit assertion shows its values; a
backend that did not load is reported at collection with the plugin's error.

Hypothesis budgets follow ``KVCORE_HYPOTHESIS_PROFILE`` (``dev`` by default,
``ci``, ``long``: see :mod:`kvcore.testing.profiles`), so a long fuzz run is
``KVCORE_HYPOTHESIS_PROFILE=long pytest -k state_machine``.

The engine-protocol helpers (``make_req``, ``admit``, ``prefill``, ``decode``,
``finish``, ``abort``, ``retract``, ``resume``, ``run_request``, ``alloc_slots``,
``extend_slots``) are one-call wrappers over :class:`kvcore.engine.Engine`,
reusable by other suites and benchmarks.
"""

from kvcore.testing.conformance import CacheStateMachine, PrefixCacheConformance, backend_page_sizes, snapshot
from kvcore.testing.helpers import (
    abort,
    admit,
    alloc_slots,
    check_invariants,
    decode,
    extend_slots,
    finish,
    make_req,
    pool_total,
    prefill,
    resume,
    retract,
    run_request,
)
from kvcore.testing.profiles import PROFILE_ENV, PROFILES, current_profile, load_profile

load_profile()

__all__ = [
    "PrefixCacheConformance",
    "CacheStateMachine",
    "snapshot",
    "backend_page_sizes",
    "PROFILE_ENV",
    "PROFILES",
    "current_profile",
    "load_profile",
    "make_req",
    "admit",
    "prefill",
    "decode",
    "finish",
    "abort",
    "retract",
    "resume",
    "run_request",
    "alloc_slots",
    "extend_slots",
    "check_invariants",
    "pool_total",
]

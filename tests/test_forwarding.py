"""Meta-tests: a wrapper (``ForwardingCache``, ``StreamingSession``) reaches the backend for every protocol call.

A wrapper that forwarded through ``__getattr__`` answered every name the base class
defines with the base default (a session's ``sanity_check`` checked nothing).  These
tests fail for any public name of ``BasePrefixCache`` or call of a capability protocol
(``kvcore.capabilities``) that a wrapper leaves to inheritance or to ``__getattr__``, on
every installed backend.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import kvcore
from kvcore import BasePrefixCache, InvariantChecker, StreamingSession
from kvcore.cache import MatchResult
from kvcore.capabilities import PROTOCOL_CALLS, Capability, window_lock_release
from kvcore.forwarding import ForwardingCache
from kvcore.testing import make_req

BACKENDS = sorted(kvcore.available_backends())

# What the session answers itself, by design: its own slots.
ANSWERED_BY_SESSION = {"session_slots"}


def protocol_methods() -> list[str]:
    """The core calls and every capability protocol's calls."""
    core = {
        name
        for name, member in inspect.getmembers(BasePrefixCache)
        if not name.startswith("_") and callable(member) and not isinstance(member, type)
    }
    return sorted(core.union(*PROTOCOL_CALLS.values()))


def declared_attributes() -> list[str]:
    """Plain class attributes of the protocol a wrapper must read from the backend (capabilities, flags)."""
    return sorted(
        name
        for name, value in vars(BasePrefixCache).items()
        if not name.startswith("_") and isinstance(value, (bool, str, frozenset))
    )


def test_forwarding_cache_defines_every_protocol_name() -> None:
    own = vars(ForwardingCache)
    missing = [n for n in protocol_methods() + declared_attributes() if n not in own]
    assert not missing, f"ForwardingCache leaves these BasePrefixCache names to inheritance: {missing}"


def _args(name: str, cache: BasePrefixCache) -> tuple[Any, ...]:
    req = make_req("r", [1, 2, 3])
    node = object()
    table: dict[str, tuple[Any, ...]] = {
        "match_prefix": ([1, 2],),
        "match_request": (req, [1, 2]),
        "insert": ([1, 2], None),
        "cache_finished_req": (req, True),
        "cache_unfinished_req": (req, False),
        "evict": (1,),
        "make_room": (1,),
        "evicting": ([],),
        "inc_lock_ref": (node,),
        "dec_lock_ref": (node, None),
        "dec_swa_lock_only": (node, None),
        "check_node_locked": (node, "meta-test"),
        "check_req": (req, "meta-test"),
        "check_req_lock": (req, "meta-test"),
        "release_req_lock": (req,),
        "pretty_print": (None,),
        "on_decode_step": ([req], torch.zeros((1, 1), dtype=torch.int64)),
        "backup_request_state": (req,),
        "restore_request_state": (req, None),
        "request_state_slots": (req.kv,),
        "free_window_slots": ([req], None),
        "rebase_on_match": (req, MatchResult(torch.empty((0,), dtype=torch.int64)), 0),
        "free_kv_row": (req.kv, []),
    }
    return table.get(name, ())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrapper", [ForwardingCache, StreamingSession])
def test_every_protocol_method_reaches_the_backend(backend: str, wrapper: type[ForwardingCache]) -> None:
    inner = kvcore.create_cache(backend)
    wrapped = wrapper(inner)
    not_reached = []
    for name in protocol_methods():
        if wrapper is StreamingSession and name in ANSWERED_BY_SESSION:
            continue
        sentinel = object()
        calls: list[tuple] = []

        def recorder(*args: Any, _calls: list = calls, _sentinel: object = sentinel, **kwargs: Any) -> object:
            _calls.append(args)
            return _sentinel

        setattr(inner, name, recorder)
        try:
            result = getattr(wrapped, name)(*_args(name, inner))
        finally:
            delattr(inner, name)
        if not calls:
            not_reached.append(name)
        elif result is not None:
            assert result is sentinel, f"{backend}: {wrapper.__name__}.{name} did not return the backend's answer"
    assert not not_reached, f"{backend}: through {wrapper.__name__}, these never reached the backend: {not_reached}"
    for name in declared_attributes():
        assert getattr(wrapped, name) == getattr(inner, name), f"{backend}: {wrapper.__name__}.{name}"
    InvariantChecker(wrapped).check(owners=[])


def test_session_runs_the_backends_own_sanity_check() -> None:
    inner = kvcore.create_cache("radix", size=64, max_num_reqs=4, max_context_len=32)
    ran: list[bool] = []
    original = inner.sanity_check

    def counting() -> None:
        ran.append(True)
        original()

    inner.sanity_check = counting  # type: ignore[method-assign]
    InvariantChecker(StreamingSession(inner)).check(owners=[])
    assert ran, "the invariant checker through a session never ran the backend's sanity_check"


@pytest.mark.parametrize("backend", ["swa", "unified-swa"])
def test_window_lock_release_through_a_session(backend: str) -> None:
    inner = kvcore.create_cache(backend, size=256, swa_size=256, sliding_window_size=4, max_num_reqs=4,
                                max_context_len=64)
    session = StreamingSession(inner)
    assert Capability.WINDOW_LOCK_RELEASE in session.capabilities
    assert window_lock_release(session) is session
    engine = kvcore.Engine(session)
    req = make_req("r", list(range(1, 17)))
    assert engine.admit(req)
    assert engine.extend(req)
    other = make_req("o", list(range(1, 17)))
    assert engine.admit(other)
    # The backend answers (no "cannot release a window lock early" from a base default).
    session.dec_swa_lock_only(other.last_node, other.lock)
    assert other.lock is not None and other.lock.swa_released
    engine.finish(other)
    engine.finish(req)
    InvariantChecker(session).check(owners=[])

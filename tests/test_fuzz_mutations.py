"""Mutation tests: put a refused class of bad input back and `kvcore fuzz` finds it within a few seeds.

Each mutation disables one of the checks that reliability II added (the record-field
check before a release or window free; the state check every lifecycle call starts with);
the fuzz, whose bad-input generator mixes those kinds in, must then fail.
"""

from __future__ import annotations

import pytest

from kvcore.cache import BasePrefixCache
from kvcore.fuzz import FuzzFailure, run_fuzz
from kvcore.record import ReqKvInfo

MUTATIONS = {
    "record fields trusted": (ReqKvInfo, "check_fields"),
    "lifecycle call in the wrong state": (BasePrefixCache, "check_req"),
}


@pytest.mark.parametrize(("mutation", "backend"), [
    ("record fields trusted", "swa"),
    ("record fields trusted", "radix"),
    ("lifecycle call in the wrong state", "swa"),
    ("lifecycle call in the wrong state", "chunk"),
])
def test_fuzz_finds_a_reintroduced_bug(mutation: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name = MUTATIONS[mutation]
    monkeypatch.setattr(owner, name, lambda self, *args, **kwargs: None)
    failures = []
    for seed in range(4):
        try:
            run_fuzz(backend, 3000, seed)
        except FuzzFailure as exc:
            failures.append(exc)
            break
    assert failures, f"{mutation}: kvcore fuzz on {backend} did not notice within 4 seeds of 3,000 operations"
    assert failures[0].replay.startswith("kvcore fuzz")


@pytest.mark.parametrize("backend", ["swa", "radix"])
def test_the_unmutated_fuzz_is_clean(backend: str) -> None:
    run_fuzz(backend, 3000, 0)

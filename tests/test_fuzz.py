"""``kvcore fuzz``: every installed backend survives a seeded random run; failures replay."""

from __future__ import annotations

import os

import pytest

import kvcore
from kvcore.cli import main
from kvcore.fuzz import FuzzFailure, replay_command, run_fuzz

OPS = int(os.environ.get("KVCORE_FUZZ_OPS", "3000"))


@pytest.mark.parametrize("backend", sorted(kvcore.available_backends()))
def test_fuzz_every_installed_backend(backend):
    result = run_fuzz(backend, OPS, seed=1, check_every=10)
    assert result.ops == OPS and result.checks >= OPS // 10
    bad = {k for k in result.counts if k.startswith("bad: ")}
    assert len(bad) >= 8, sorted(bad)  # the bad inputs really were mixed in
    for op in ("admit", "extend", "decode", "finish", "retract", "abort", "evict", "lock"):
        assert result.counts.get(op, 0) > 0, op


@pytest.mark.parametrize("backend", ["radix", "swa"])
def test_fuzz_paged(backend):
    run_fuzz(backend, OPS // 2, seed=2, check_every=10, page_size=4)


def test_same_seed_same_run():
    a = run_fuzz("radix", 800, seed=5)
    b = run_fuzz("radix", 800, seed=5)
    assert a.counts == b.counts


def test_a_bug_is_reported_with_seed_operation_and_replay(monkeypatch, capsys):
    # Bring back the session bug of issue 14: a later turn reuses the old KV whatever its tokens.
    import kvcore.session

    monkeypatch.setattr(kvcore.session, "common_prefix_len", lambda a, b, n: n)
    failure = None
    for seed in range(10):
        try:
            run_fuzz("radix", 4000, seed=seed)
        except FuzzFailure as exc:
            failure = exc
            break
    assert failure is not None, "the fuzz did not find a session turn reusing KV of other tokens"
    assert "other tokens" in failure.what
    assert failure.replay == replay_command("radix", failure.seed, failure.op, None, 0.05)
    # The replay command fails at the same operation.
    with pytest.raises(SystemExit) as exit_info:
        main(failure.replay.split()[1:])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"seed {failure.seed}, operation {failure.op}:" in err and "replay: kvcore fuzz" in err


def test_cli_fuzz_clean_run(capsys):
    main(["fuzz", "--backend", "chunk", "--ops", "300", "--seed", "3", "--check-every", "7"])
    out = capsys.readouterr().out
    assert "300 operations" in out and "clean" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["fuzz", "--backend", "nope", "--ops", "10"],
        ["fuzz", "--backend", "radix", "--ops", "-1"],
        ["fuzz", "--backend", "radix", "--check-every", "0"],
        ["fuzz", "--backend", "radix", "--bad-rate", "2"],
    ],
)
def test_cli_fuzz_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcore: error:")

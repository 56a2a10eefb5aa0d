"""The ``kvcore`` command's error contract: one line for a user's error, a traceback for a bug, exit codes 1/2/3.

Each case of issue 25's "The CLI" and issue 26's "A fair bench and a debuggable CLI" is a
test here that failed on the code before (noted per test).  Runs go through
``kvcore.cli.main`` (the console script's own error handling) or, where the old code
would hang or a throwaway distribution must be discovered, a real subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvcore
from kvcore.cli import main
from kvcore.commands.errors import EXIT_LEAK, EXIT_RUNTIME, EXIT_USAGE
from kvcore.testing.distributions import make_dist

INSTALLED = kvcore.available_backends()


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """kvcore.cli.main in-process: (exit status, stdout, stderr); a clean run returns without SystemExit."""
    code: object = 0
    try:
        main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return (0 if code is None else int(code)), out.out, out.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcore: error:") and "Traceback" not in err, err
    return lines[0]


def _kvcore(args: list[str], path: Path | None = None, timeout: float = 120, **env: str):
    environ = dict(os.environ, **env)
    if path is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(path), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvcore", *args], capture_output=True, text=True, env=environ,
                          timeout=timeout)


# ------------------------------------------------------------------ issue 25: option values
@pytest.mark.parametrize(
    "args, flag",
    [
        # Old: a 62-line traceback from torch allocating the row table.
        (["--pre-alloc-size", "1000000000000"], "--pre-alloc-size"),
        (["--pre-alloc-size", "1e12"], "--pre-alloc-size"),
        # Old: "cannot convert float NaN to integer" (no option named).
        (["--step-ms", "nan", "-w", "trace"], "--step-ms"),
        (["--step-ms", "inf", "-w", "trace"], "--step-ms"),
        # Old: "Overflow when unpacking long long" from torch's generator.
        (["--seed", str(10**24)], "--seed"),
        (["--seed", "1e24"], "--seed"),
        (["--topk-locality", "nan"], "--topk-locality"),
        (["--max-num-reqs", "1048576", "--pre-alloc-size", "1"], "--pre-alloc-size"),
        (["--page-size", str(10**9)], "--page-size"),
        (["--retract-mode", "swap"], "--retract-mode"),
    ],
)
def test_bad_values_name_their_option(capsys, args, flag):
    code, out, err = _main(capsys, "bench", "--backend", "chunk", "-n", "2", *args)
    line = _one_line(err)
    assert code == EXIT_USAGE and flag in line and out == ""


def test_transfer_steps_beyond_the_limit_are_refused_before_the_run():
    # Old: the pd-decode loop waited 10^12 idle steps (a subprocess, so the old code fails by its timeout).
    proc = _kvcore(["bench", "--backend", "chunk", "-w", "pd-decode", "-n", "4", "--transfer-steps",
                    "1000000000000"], timeout=60)
    assert proc.returncode == EXIT_USAGE
    assert "--transfer-steps" in _one_line(proc.stderr)


def test_a_row_table_this_machine_cannot_hold_is_refused(capsys):
    # 2^20 rows as wide as a sparse-decode request (up to 32K tokens) are about 128 GiB of int32 row table.
    code, _, err = _main(capsys, "bench", "--backend", "chunk", "-w", "sparse-decode", "-n", "2",
                         "--max-num-reqs", str(2**20 - 8), "--size", "65536")
    line = _one_line(err)
    assert code == EXIT_USAGE and "GiB" in line and "rows" in line


@pytest.mark.parametrize("backend", [b for b in ("mamba", "hisparse") if b in INSTALLED])
def test_fuzz_page_size_a_backend_refuses_is_one_line(capsys, backend):
    # Old: the pydantic error, several lines, without the option's name.
    code, out, err = _main(capsys, "fuzz", "--backend", backend, "--ops", "10", "--page-size", "3")
    line = _one_line(err)
    assert code == EXIT_USAGE and "--page-size" in line and backend in line and out == ""


def test_plot_into_a_folder_that_cannot_be_written_stops_before_the_run(capsys):
    # Old: os.access says yes to root, so the whole run went by and then the PNG failed without --plot named.
    folder = Path("/proc")
    code, out, err = _main(capsys, "bench", "--backend", "chunk", "-n", "4", "--json", "--plot",
                           str(folder / "kvcore-run.png"))
    line = _one_line(err)
    assert code == EXIT_USAGE and "--plot" in line and "not writable" in line and out == ""


def test_a_plot_that_fails_at_the_end_keeps_the_json_and_names_plot(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    import kvcore.bench.plot

    def disk_full(reports, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvcore.bench.plot, "write_plot", disk_full)
    code, out, err = _main(capsys, "bench", "--backend", "chunk", "-n", "4", "--json", "--no-reference",
                           "--plot", str(tmp_path / "run.png"))
    assert json.loads(out)["backend"] == "chunk"  # the results went out first
    line = _one_line(err)
    assert code == EXIT_RUNTIME and "--plot" in line and "No space left" in line


@pytest.mark.skipif("hisparse" not in INSTALLED, reason="needs kvcore-hisparse")
def test_hisparse_multi_turn_runs_with_the_default_sessions(capsys):
    # Old: "decode step at length 871 does not follow its hisparse state" half-way through the run.
    code, out, err = _main(capsys, "bench", "--backend", "hisparse", "-w", "multi-turn", "-n", "30", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0
    assert rep["reference"]["leaked_slots"] == 0  # its reference ran alike: without sessions
    assert "without streaming sessions on every backend: hisparse" in err
    # Asked for explicitly, the refusal comes before anything runs.
    code, out, err = _main(capsys, "bench", "--backend", "hisparse", "-w", "multi-turn", "-n", "30", "--sessions")
    assert code == EXIT_USAGE and "--sessions" in _one_line(err) and out == ""


@pytest.mark.skipif("swa" not in INSTALLED, reason="needs swa")
def test_release_window_lock_with_sessions_runs_clean(capsys):
    # Found on the way (old: a TypeError traceback): a turn on a session's KV has no tree lock to give back.
    code, out, err = _main(capsys, "bench", "-b", "swa", "-w", "multi-turn", "-n", "60", "--release-window-lock",
                           "--no-reference", "--json", "--check-every", "25")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["window_lock_releases"] > 0 and rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0


# ------------------------------------------------------------------ issue 26: a fair bench
@pytest.mark.skipif("radix" not in INSTALLED, reason="needs radix")
def test_eviction_policy_reaches_every_backend_that_takes_it_and_names_the_others(capsys):
    # Old: chunk (no eviction_policy option) dropped it silently.
    code, out, err = _main(capsys, "bench", "--compare", "chunk,radix", "-n", "8", "--json", "--eviction-policy", "lfu")
    assert code == 0, err
    reps = {r["backend"]: r for r in json.loads(out)}
    assert reps["radix"]["options"]["eviction_policy"] == "lfu"
    assert "eviction_policy" not in reps["chunk"]["options"]
    assert "--eviction-policy lfu reaches radix; chunk takes no eviction_policy option" in err
    code, _, err = _main(capsys, "bench", "--compare", "chunk,radix", "-n", "4", "--eviction-policy", "nope")
    assert code == EXIT_USAGE and "--eviction-policy 'nope': choose one of" in _one_line(err)
    code, _, err = _main(capsys, "bench", "--backend", "chunk", "--no-reference", "-n", "4", "--eviction-policy", "lfu")
    assert code == EXIT_USAGE and "no backend of this run (chunk) takes option 'eviction_policy'" in _one_line(err)


@pytest.mark.skipif("radix" not in INSTALLED, reason="needs radix")
def test_backend_opt_is_validated_by_the_backends_own_config(capsys):
    code, out, err = _main(capsys, "bench", "-b", "radix", "--no-reference", "-n", "8", "--json",
                           "--backend-opt", "enable_kv_events=true")
    assert code == 0, err
    assert json.loads(out)["options"]["enable_kv_events"] is True
    for opt, needle in (("enable_kv_events=maybe", "--backend-opt enable_kv_events: Input should be a valid boolean"),
                        ("fanout=3", "no backend of this run (radix) takes option 'fanout'"),
                        ("eviction_polcy=lru", "takes option 'eviction_polcy'; did you mean 'eviction_policy'?"),
                        ("radix:eviction_polcy=lru",
                         "takes no option 'eviction_polcy'; did you mean 'eviction_policy'?"),
                        ("size=10", "the bench sets size itself; use --size"),
                        ("chunk:disable=true", "'chunk' is not a backend of this run"),
                        ("nonsense", "write key=value")):
        code, out, err = _main(capsys, "bench", "-b", "radix", "--no-reference", "-n", "4", "--backend-opt", opt)
        assert code == EXIT_USAGE and needle in _one_line(err) and out == "", (opt, err)


@pytest.mark.skipif("radix" not in INSTALLED, reason="needs radix")
def test_backend_opt_for_one_backend_of_a_comparison(capsys):
    code, out, err = _main(capsys, "bench", "--compare", "radix,chunk", "-n", "6", "--json",
                           "--backend-opt", "radix:enable_kv_events=true")
    assert code == 0, err
    reps = {r["backend"]: r for r in json.loads(out)}
    assert reps["radix"]["options"]["enable_kv_events"] is True and "enable_kv_events" not in reps["chunk"]["options"]


@pytest.mark.skipif("unified" not in INSTALLED, reason="needs kvcore-unified")
def test_unified_components_as_a_plain_option_set(capsys):
    # The preset unified-swa is unified with components (full, swa): the same set given as options.
    code, out, err = _main(capsys, "bench", "-b", "unified", "--no-reference", "-n", "6", "--json",
                           "--backend-opt", "components=full,swa", "--backend-opt", "sliding_window_size=64",
                           "--backend-opt", "swa_size=65536")
    assert code == 0, err
    rep = json.loads(out)
    assert [p["name"] for p in rep["pools"]] == ["full", "swa"] and rep["leaked_slots"] == 0
    code, _, err = _main(capsys, "bench", "-b", "unified", "--no-reference", "-n", "4",
                         "--backend-opt", "components=full,nope")
    assert code == EXIT_USAGE and "components" in _one_line(err)


def test_fuzz_backend_opt(capsys):
    code, out, err = _main(capsys, "fuzz", "--backend", "radix", "--ops", "300", "--backend-opt", "eviction_policy=lfu")
    assert code == 0, err
    assert "clean" in out
    code, _, err = _main(capsys, "fuzz", "--backend", "radix", "--ops", "10", "--backend-opt", "enable_kv_events=maybe")
    assert code == EXIT_USAGE and "--backend-opt enable_kv_events" in _one_line(err)
    code, _, err = _main(capsys, "fuzz", "--backend", "radix", "--ops", "10", "--backend-opt", "size=4")
    assert code == EXIT_USAGE and "sizes size itself" in _one_line(err)


LRU_ONLY = [b for b in ("swa", "mamba", "unified", "unified-swa", "unified-mamba") if b in INSTALLED]


@pytest.mark.parametrize("backend", LRU_ONLY)
def test_eviction_policy_is_refused_by_name_where_the_tree_keeps_its_own_orders(backend, capsys):
    # Old: each backend refused in its own words after its other checks; now one rule at validation.
    from kvcore.backend_options import describe_options
    from kvcore.factory import validate_options
    from kvcore.plugins import get_backend

    with pytest.raises(kvcore.ConfigError) as exc:
        validate_options(backend, eviction_policy="lfu")
    msg = str(exc.value)
    assert f"backend {backend!r}: option 'eviction_policy': the {backend} backend takes eviction_policy 'lru' only" \
        in msg and "(got 'lfu')" in msg, msg
    assert validate_options(backend, eviction_policy="LRU").eviction_policy == "LRU"  # as radix: any case
    specs = {o["name"]: o for o in describe_options(get_backend(backend).config)}
    assert specs["eviction_policy"]["description"].startswith("'lru' only")
    code, out, err = _main(capsys, "fuzz", "--backend", backend, "--ops", "10", "--backend-opt", "eviction_policy=fifo")
    line = _one_line(err)
    assert code == EXIT_USAGE and out == "" and f"the {backend} backend takes eviction_policy 'lru' only" in line \
        and "'fifo'" in line, line


def test_an_unknown_option_gets_a_did_you_mean(capsys):
    # Old: "unknown option 'evicton_policy'" with no hint, where a misspelt hook names the nearest one.
    with pytest.raises(kvcore.ConfigError, match=r"backend 'chunk': unknown option 'szie'; did you mean 'size'\?"):
        kvcore.create_cache("chunk", szie=64)
    with pytest.raises(kvcore.ConfigError, match=r"unknown option 'colour'$"):
        kvcore.create_cache("chunk", colour="red")  # nothing near: no guess
    if "radix" in INSTALLED:
        with pytest.raises(kvcore.ConfigError, match="unknown option 'evicton_policy'; did you mean 'eviction_policy'"):
            kvcore.create_cache("radix", evicton_policy="lfu")
        code, out, err = _main(capsys, "fuzz", "--backend", "radix", "--ops", "10",
                               "--backend-opt", "enable_kv_event=true")
        line = _one_line(err)
        assert code == EXIT_USAGE and out == "" and "did you mean 'enable_kv_events'?" in line, line
        assert "no small configuration" not in line  # the option is wrong, not the pool sizes


# ------------------------------------------------------------------ issue 26: a debuggable CLI
BUGGY = '''
import kvcore

class BuggyCache(kvcore.ChunkCache):
    """Finishing a request looks it up in a table that was never filled (an author's bug)."""

    table = {}

    def cache_finished_req(self, req, is_insert=True):
        return self.table["oops"]

class InitBugCache(kvcore.ChunkCache):
    def __init__(self, params):
        super().__init__(params, "an argument too many")

@kvcore.hookimpl
def kvcore_register_backends(register):
    register("buggy", BuggyCache, description="cache_finished_req raises KeyError")
    register("initbug", InitBugCache, description="__init__ raises TypeError")
'''

BROKEN = "raise ImportError('needs libfoo')\n"


@pytest.fixture(scope="module")
def buggy_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    make_dist(root, "buggy-kv", "buggy_kv", BUGGY)
    return root


def test_a_backends_keyerror_is_a_bug_report_not_a_one_line_error(buggy_site):
    # Old: "kvcore: error: 'oops'" and exit 1, as if the user had done something wrong.
    proc = _kvcore(["bench", "--backend", "buggy", "--no-reference", "-n", "8"], buggy_site)
    assert proc.returncode == EXIT_RUNTIME
    assert "Traceback (most recent call last)" in proc.stderr and 'KeyError: \'oops\'' in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcore: internal error while running backend 'buggy': KeyError: 'oops'")
    assert "This is a bug, not a usage error: it was raised in backend buggy, initbug (distribution buggy-kv" in last
    assert "buggy_kv.py" in last


def test_a_typeerror_in_a_backends_init_is_not_relabelled_a_config_error(buggy_site):
    # Old: "kvcore: error: backend 'initbug': ChunkCache.__init__() takes 2 positional arguments ..." (a ConfigError).
    proc = _kvcore(["bench", "--backend", "initbug", "--no-reference", "-n", "4"], buggy_site)
    assert proc.returncode == EXIT_RUNTIME
    assert "Traceback" in proc.stderr and "TypeError" in proc.stderr.strip().splitlines()[-1]
    assert "raised in backend" in proc.stderr and "ConfigError" not in proc.stderr


def test_debug_env_shows_the_traceback_of_a_user_error():
    proc = _kvcore(["bench", "--backend", "nope"], KVCORE_DEBUG="1")
    assert proc.returncode == EXIT_USAGE and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("kvcore: error:")


def test_a_leaking_run_exits_3_through_the_console_script(capsys, monkeypatch):
    # Old: the command raised typer.Exit(2), which main() dropped outside standalone mode: exit status 0.
    import kvcore.engine

    monkeypatch.setattr(kvcore.engine.Engine, "finish", lambda self, req, is_insert=True: None)  # never frees
    code, out, err = _main(capsys, "bench", "--backend", "chunk", "--no-reference", "-n", "4", "--json")
    assert code == EXIT_LEAK and json.loads(out)["leaked_slots"] > 0
    assert "kvcore: chunk failed the leak check" in err


def test_backends_json_lists_each_backends_options():
    from kvcore.commands.backends import backends  # noqa: F401 (the command module is importable alone)

    proc = _kvcore(["backends", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = {b["name"]: b for b in json.loads(proc.stdout)["backends"]}
    specs = {o["name"]: o for o in data["chunk"]["option_specs"]}
    assert specs["size"] == {"name": "size", "type": "int", "required": False, "default": 65536,
                             "description": "token slots in the KV pool"}
    assert set(specs) == set(data["chunk"]["options"])
    if "radix" in data:
        radix = {o["name"]: o for o in data["radix"]["option_specs"]}
        assert radix["eviction_policy"]["default"] == "lru" and radix["eviction_policy"]["type"] == "str"


def test_backends_exits_non_zero_when_a_plugin_failed(tmp_path):
    # Old: exit status 0, so CI could not see a broken install.
    make_dist(tmp_path, "broken-kv", "broken_kv", BROKEN, version="0.1")
    for args in (["backends"], ["backends", "--json"]):
        proc = _kvcore(args, tmp_path)
        assert proc.returncode == EXIT_RUNTIME, proc.stderr
        assert "1 plugin(s) failed to load: broken_kv" in proc.stderr
    assert "needs libfoo" in json.loads(proc.stdout)["failed"][0]["error"]


def test_exit_codes_are_documented():
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    cli = readme[readme.index("## The CLI"):]
    docs = (root / "docs" / "bench.md").read_text()
    for text in (cli, docs):
        for code in ("`0`", "`1`", "`2`", "`3`"):
            assert code in text
    assert "KVCORE_DEBUG" in cli and "--backend-opt" in cli and "--backend-opt" in docs


def test_the_help_of_every_command_is_clean(capsys):
    for command in ("backends", "bench", "fuzz"):
        code, out, err = _main(capsys, command, "--help")
        assert code == 0 and "Usage" in out and err == ""


_WITHOUT_CLI_DEPS = """
import sys
class _Absent:
    # As on a server that installed kvcore without the [cli] extra: typer, rich and click are not there.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("typer", "rich", "click"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def test_the_library_imports_and_runs_without_the_cli_dependencies() -> None:
    code = _WITHOUT_CLI_DEPS + (
        "import kvcore\n"
        "from kvcore.testing import make_req\n"
        "cache = kvcore.create_cache('swa', size=256, sliding_window_size=16, max_num_reqs=2, max_context_len=64)\n"
        "eng = kvcore.Engine(cache)\n"
        "r = make_req('r', list(range(2, 40)))\n"
        "assert eng.admit(r) and eng.extend(r, 16) and eng.extend(r)\n"
        "eng.finish(r)\n"
        "kvcore.InvariantChecker(cache).check([])\n"
        "assert not {m.split('.')[0] for m in sys.modules} & {'typer', 'rich', 'click'}\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_the_command_line_without_its_dependencies_says_what_to_install() -> None:
    code = _WITHOUT_CLI_DEPS + "from kvcore.cli import main\nmain(['backends'])\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == EXIT_USAGE and res.stdout == ""
    assert "pip install 'kvcore[cli]'" in _one_line(res.stderr)

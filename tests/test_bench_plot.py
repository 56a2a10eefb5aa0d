"""--plot styles (one per backend, coinciding lines visible) and --progress on stderr."""

from __future__ import annotations

import importlib.util

import pytest

import kvcore
from kvcore.bench import run_bench
from kvcore.cli import main

INSTALLED = kvcore.available_backends()
needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib absent")


def test_backend_styles_are_one_per_backend_and_distinct():
    from kvcore.bench.plot import backend_styles

    reports = [{"backend": n} for n in ("chunk", "radix", "swa", "swa-chunk", "mamba")]
    styles = backend_styles(reports + [{"backend": "radix"}])
    assert list(styles) == ["chunk", "radix", "swa", "swa-chunk", "mamba"]
    keys = [(s["color"], s["linestyle"], s["marker"]) for s in styles.values()]
    assert len({k[0] for k in keys}) == len(keys)
    # two backends drawn on top of each other differ in line style and marker, not only in colour
    for a, b in zip(keys, keys[1:]):
        assert a[1] != b[1] and a[2] != b[2]


@needs_mpl
def test_figure_keeps_a_backend_in_one_style_in_every_panel(tmp_path):
    from kvcore.bench.plot import make_figure, write_plot

    backends = ["chunk", "radix"] if "radix" in INSTALLED else ["chunk"]
    reps = run_bench(backends, workload="shared-prefix", num_requests=16, size=8192, max_num_reqs=8, chunk_size=512)
    fig = make_figure(reps)
    seen: dict[str, set] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            name = label.split(" ")[0]
            if name in backends:
                seen.setdefault(name, set()).add((line.get_color(), line.get_linestyle()))
                if label in backends or label.endswith(" live"):
                    assert line.get_marker() not in (None, "None", "")  # markers keep coinciding lines visible
    assert set(seen) == set(backends)
    for name, styles in seen.items():
        assert len(styles) == 1, (name, styles)  # one colour and style in every panel
    assert len({next(iter(s)) for s in seen.values()}) == len(backends)
    out = tmp_path / "run.png"
    write_plot(reps, str(out))
    assert out.stat().st_size > 1000


def _run(capsys, *args):
    code = 0
    try:
        main(["bench", "--backend", "chunk", "-w", "no-reuse", "-n", "6", "--size", "8192", "--no-reference",
              "--markdown", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_progress_goes_to_stderr_from_the_start(capsys):
    code, out, err = _run(capsys, "--progress")
    assert code in (0, None)
    lines = err.strip().splitlines()
    assert lines[0] == "kvcore bench: chunk: 0/6 requests, 0 s"  # before the first step
    assert lines[-1].startswith("kvcore bench: chunk: 6/6 requests")
    assert "| metric |" in out and "requests," not in out  # data stays on stdout, progress on stderr
    code, out, err = _run(capsys, "--no-progress")
    assert err == ""

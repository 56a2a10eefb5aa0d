"""``--plot FILE.png``: pool occupancy and hit rate over the run (matplotlib, the ``plot`` extra).

Each backend keeps one colour, line style and marker in every panel (:func:`backend_styles`),
so lines that coincide (two backends with the same full-pool curve) stay visible: the
later one is dashed over the earlier, and their markers sit at different steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["write_plot", "make_figure", "backend_styles"]

_LINESTYLES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def backend_styles(reports: list[dict]) -> dict[str, dict[str, Any]]:
    """Backend name -> matplotlib style (color, linestyle, marker, linewidth): one per backend, in every panel."""
    out: dict[str, dict[str, Any]] = {}
    for r in reports:
        name = r["backend"]
        if name in out:
            continue
        i = len(out)
        out[name] = {"color": f"C{i % 10}", "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
                     "marker": _MARKERS[i % len(_MARKERS)], "linewidth": 1.6 if i == 0 else 1.1}
    return out


def _markevery(n: int, i: int, k: int) -> tuple[int, int] | None:
    """About 12 markers per line, each backend's shifted so coinciding lines show every marker."""
    if n == 0:
        return None
    every = max(1, n // 12)
    return (min(n - 1, (i * every) // max(k, 1)), every)


def make_figure(reports: list[dict]) -> Figure:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvcore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = backend_styles(reports)
    k = len(styles)
    pools: list[str] = []
    for r in reports:
        pools += [p["name"] for p in r["pools"] if p["name"] not in pools]
    fig, grid = plt.subplots(len(pools) + 1, 1, squeeze=False, figsize=(10, 3.2 * (len(pools) + 1)), sharex=True)
    axes = [row[0] for row in grid]
    for ax, pool in zip(axes, pools):
        for i, r in enumerate(reports):
            tl = r.get("_timeline") or {}
            if f"{pool}_used" not in tl:
                continue
            st = styles[r["backend"]]
            steps = tl["step"]
            me = _markevery(len(steps), i, k)
            ax.plot(steps, tl[f"{pool}_live"], color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                    markevery=me, markersize=4, linewidth=st["linewidth"], label=f"{r['backend']} live")
            ax.plot(steps, tl[f"{pool}_used"], color=st["color"], linestyle=st["linestyle"], linewidth=0.7,
                    alpha=0.45, label=f"{r['backend']} with cache")
            cap = next(p["capacity"] for p in r["pools"] if p["name"] == pool)
            ax.axhline(cap, color=st["color"], linestyle=(0, (1, 3)), linewidth=0.8, alpha=0.6)
        ax.set_ylabel(f"{pool} slots in use")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for i, r in enumerate(reports):
        tl = r.get("_timeline") or {}
        st = styles[r["backend"]]
        steps = tl.get("step", [])
        ax.plot(steps, tl.get("hit_rate", []), color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                markevery=_markevery(len(steps), i, k), markersize=4, linewidth=st["linewidth"],
                label=f"{r['backend']}")
    inf = reports[0]["infinite_cache_hit_rate"]
    ax.axhline(inf, color="gray", linestyle="--", linewidth=0.8, label=f"infinite cache ({inf:.1%})")
    ax.set_ylabel("hit rate (cumulative)")
    ax.set_xlabel("scheduler step")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(alpha=0.3)
    first = reports[0]
    fig.suptitle(f"kvcore bench: {first['workload']}, {first['num_requests']} requests, seed {first['seed']}")
    fig.tight_layout()
    return fig


def write_plot(reports: list[dict], path: str) -> None:
    fig = make_figure(reports)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)

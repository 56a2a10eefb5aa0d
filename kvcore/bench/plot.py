"""``--plot FILE.png``: pool occupancy and hit rate over the run (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

__all__ = ["write_plot"]


def write_plot(reports: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvcore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
            color = f"C{i}"  # one color per backend across every panel
            ax.plot(tl["step"], tl[f"{pool}_live"], color=color, label=f"{r['backend']} live", linewidth=1)
            ax.plot(tl["step"], tl[f"{pool}_used"], color=color, linestyle=":", linewidth=1,
                    label=f"{r['backend']} with cache")
            cap = next(p["capacity"] for p in r["pools"] if p["name"] == pool)
            ax.axhline(cap, color=color, linestyle="--", linewidth=0.6, alpha=0.5)
        ax.set_ylabel(f"{pool} slots in use")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for i, r in enumerate(reports):
        tl = r.get("_timeline") or {}
        ax.plot(tl.get("step", []), tl.get("hit_rate", []), color=f"C{i}", label=f"{r['backend']}", linewidth=1)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)

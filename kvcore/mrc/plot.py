"""``kvcore mrc --plot FILE.png``: hit rate against cache size (tokens below, GiB of a model above, log x).

Every line is labelled where it ends, so the picture reads without the legend: LRU
solid, the optimum dashed, the infinite-cache ceiling dotted, simulated backends as
points (one marker per backend and policy) named beside them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.bench.sizing import ModelLayout
from kvcore.mrc.curve import MissRatioCurve

__all__ = ["make_figure", "write_plot"]

_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _bytes_per_token(layout: ModelLayout) -> int:
    """A full-attention prefix cache keeps every layer's K and V for every cached token."""
    return layout.per_token_layer * (layout.full_layers + layout.swa_layers)


def make_figure(curve: MissRatioCurve, layout: ModelLayout) -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvcore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = curve.sizes.astype(float)
    lru, opt = curve.lru * 100, curve.optimal * 100
    fig, ax = plt.subplots(figsize=(10, 6))
    ax.set_xscale("log")
    ax.plot(sizes, lru, color="C0", linewidth=2.2, label="LRU (stack distances)")
    ax.plot(sizes, opt, color="C3", linewidth=2.2, linestyle="--", label="optimal (Belady MIN)")
    inf = curve.infinite * 100
    ax.axhline(inf, color="0.35", linestyle=":", linewidth=1.6, label="infinite cache")
    x_end = sizes[-1]
    ax.annotate(f"infinite cache {inf:.1f}%", (sizes[0], inf), xytext=(2, 4), textcoords="offset points",
                color="0.25", fontsize=10, va="bottom")
    # Name each curve where it is easiest to tell apart: halfway up the optimum, and LRU at the same height.
    mid = inf / 2
    for ys, label, color, dy in ((opt, "optimal", "C3", 6), (lru, "LRU", "C0", -14)):
        k = int((ys >= mid).argmax()) if (ys >= mid).any() else len(ys) - 1
        ax.annotate(label, (sizes[k], ys[k]), xytext=(6, dy), textcoords="offset points", color=color,
                    fontsize=11, fontweight="bold")
    labels = []
    for p in curve.simulated:
        if p["label"] not in labels:
            labels.append(p["label"])
    for i, name in enumerate(labels):
        pts = [p for p in curve.simulated if p["label"] == name]
        px = [p["size"] for p in pts]
        py = [p["hit_rate"] * 100 for p in pts]
        color = f"C{(i + 4) % 10}"
        # Points of several policies often coincide: each smaller than the one before, so all stay visible.
        ax.scatter(px, py, marker=_MARKERS[i % len(_MARKERS)], s=max(20, 150 - 40 * i), color=color,
                   edgecolor="black", linewidths=0.8, zorder=5 + i, label=f"simulated: {name}")
        # Named below the curves (where the plot is empty), a leader line to the point at the largest size.
        ax.annotate(f"{name} (simulated)", (px[-1], py[-1]), xytext=(0.97, 0.36 - 0.06 * i),
                    textcoords="axes fraction", color=color, fontsize=10, ha="right", va="center",
                    arrowprops={"arrowstyle": "-", "color": color, "linewidth": 0.8})
    ax.set_ylim(0, 100)
    ax.set_xlim(sizes[0], x_end * 1.05)
    ax.set_xlabel("cache size (tokens, log scale)")
    ax.set_ylabel("prompt tokens reused (%)")
    ax.grid(alpha=0.3, which="both")
    per = _bytes_per_token(layout)

    def to_gib(t: Any) -> Any:
        return np.asarray(t, dtype=float) * (per / 2**30)

    def to_tokens(g: Any) -> Any:
        return np.asarray(g, dtype=float) * (2**30 / per)

    top = ax.secondary_xaxis("top", functions=(to_gib, to_tokens))
    top.set_xlabel(f"cache size (GiB of KV, {layout.name}: {per:,} bytes/token)")
    ax.legend(loc="upper left", fontsize=9, framealpha=0.9, bbox_to_anchor=(0.0, 0.93))
    fig.suptitle(f"kvcore mrc: {curve.workload}, {curve.requests:,} requests, {curve.prompt_tokens:,} prompt tokens, "
                 f"page size {curve.page_size}", fontsize=11)
    fig.tight_layout()
    return fig


def write_plot(curve: MissRatioCurve, path: str, layout: ModelLayout) -> None:
    fig = make_figure(curve, layout)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Throwaway installed distributions, for tests of plugin discovery.

``make_dist(root, "toy-kv", "toy_kv", source)`` writes module ``toy_kv`` and a
``toy_kv-1.0.dist-info`` with an entry point in group ``kvcore`` under
``root``; put ``root`` on ``sys.path`` (or ``PYTHONPATH`` for a subprocess) and
call ``kvcore.plugins.reset_plugins()`` to have it discovered.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

__all__ = ["make_dist"]


def make_dist(root: Path, dist: str, module: str, source: str, version: str = "1.0") -> None:
    """A minimal installed distribution: its module and a ``*.dist-info`` with ``entry_points.txt``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[kvcore]\n{module} = {module}\n")

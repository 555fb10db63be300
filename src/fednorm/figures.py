"""Figures written to files: matplotlib on its file-only (Agg) backend, imported only when a figure is drawn
(``import fednorm`` stays free of matplotlib), and one way to save and close a figure."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend: figures go to files, never to a window (headless machines, tests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it to ``path`` (creating its folder) and close it, so long runs do not pile up
    open figures."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path

"""Pictures: the step at which each canvas position was decoded (diffusion samplers, DiCo clusters)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def commit_order_plot(commit_step, path: str | Path, title: str = "", labels: list[str] | None = None) -> Path:
    """Heatmap rows = samples (or samplers), columns = canvas positions, colour = decoding step (grey: not
    decoded, e.g. after the answer's EOS)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = np.asarray(commit_step, dtype=float)
    if a.ndim == 1:
        a = a[None]
    a = np.where(a < 0, np.nan, a)
    fig, ax = plt.subplots(figsize=(min(18, 4 + a.shape[1] / 12), max(2.2, 1.2 + 0.45 * a.shape[0])))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    im = ax.imshow(a, aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_xlabel("canvas position")
    if labels:
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
    else:
        ax.set_ylabel("sample")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="decoding step")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

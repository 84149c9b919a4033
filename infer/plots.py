"""Pictures: the step at which each canvas position was decoded (diffusion samplers, DiCo clusters)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

NOT_DECODED = "never decoded (after the answer's EOS)"  # what a grey cell (commit step -1) is


def commit_order_figure(commit_step, title: str = "", labels: list[str] | None = None):
    """The matplotlib Figure of `commit_order_plot` (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    a = np.asarray(commit_step, dtype=float)
    if a.ndim == 1:
        a = a[None]
    a = np.where(a < 0, np.nan, a)
    fig, ax = plt.subplots(figsize=(min(18, 4 + a.shape[1] / 12), max(2.5, 1.5 + 0.45 * a.shape[0])),
                           layout="constrained")
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    im = ax.imshow(a, aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_xlabel("canvas position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if labels:
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
    else:
        ax.set_ylabel("sample")
        if a.shape[0] <= 16:
            ax.set_yticks(range(a.shape[0]))
        else:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    fig.legend(handles=[Patch(facecolor="lightgrey", edgecolor="grey", label=NOT_DECODED)], loc="outside lower left",
               fontsize=8, frameon=False)
    cb = fig.colorbar(im, ax=ax, label="decoding step")
    cb.locator = MaxNLocator(integer=True)
    cb.update_ticks()
    return fig


def commit_order_plot(commit_step, path: str | Path, title: str = "", labels: list[str] | None = None) -> Path:
    """Heatmap rows = samples (or samplers), columns = canvas positions, colour = decoding step (grey: never
    decoded, i.e. masks after the answer's EOS, which never reach the answer); written to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = commit_order_figure(commit_step, title=title, labels=labels)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

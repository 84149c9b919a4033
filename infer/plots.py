"""Pictures: the step at which each canvas position was decoded (diffusion samplers, DiCo clusters), and the
acceptance of draft-and-verify methods (tokens per verify step, acceptance by depth)."""

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


def acceptance_plot(histogram, per_depth, path: str | Path, title: str = "") -> Path:
    """Draft-and-verify at a glance: left, how many verify steps committed 1, 2, ... tokens (the accepted draft
    tokens plus the target's own); right, the fraction of steps whose draft survived to each depth, given it reached
    the depth before. Written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = np.asarray(histogram, dtype=float)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    a1.bar(np.arange(1, len(hist) + 1), hist, color="tab:blue")
    a1.set_xlabel("tokens committed by one verify step")
    a1.set_ylabel("verify steps")
    a1.set_xticks(np.arange(1, len(hist) + 1))
    from matplotlib.ticker import MaxNLocator

    a1.yaxis.set_major_locator(MaxNLocator(integer=True))
    depth = [np.nan if v is None else v for v in per_depth]
    a2.plot(np.arange(1, len(depth) + 1), depth, marker="o", color="tab:orange")
    a2.set_ylim(0, 1.02)
    a2.set_xlabel("draft depth")
    a2.set_ylabel("accepted | reached")
    a2.set_xticks(np.arange(1, max(2, len(depth) + 1)))
    a2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

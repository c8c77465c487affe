"""The PNG `fp8now eval --plot` writes: mean KL and top-1 agreement per scheme."""

from __future__ import annotations

import os
from pathlib import Path

from ..atomic import write_atomically


def plot_schemes(results: dict, path: str | os.PathLike) -> Path:
    """A PNG of mean KL (with its 99th percentile) and top-1 agreement per scheme, with standard
    errors as error bars; written to a temporary sibling then renamed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: run `pip install matplotlib`") from None
    path = Path(path)
    keys = list(results["schemes"])
    res = [results["schemes"][k] for k in keys]
    x = list(range(len(keys)))
    fig = Figure(figsize=(4 + 1.2 * len(keys), 4), layout="constrained")
    FigureCanvasAgg(fig)  # Agg rendering without pyplot's global state
    ax_kl, ax_top = fig.subplots(1, 2)
    ax_kl.errorbar(x, [r["kl"] for r in res], yerr=[r["kl_se"] for r in res], fmt="o", capsize=4,
                   label="mean ± SE")
    ax_kl.plot(x, [r["kl_p99"] for r in res], "v", color="gray", label="99th percentile")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL(bf16 || fp8), nats per token (lower is better)")
    ax_kl.legend(fontsize=8)
    ax_top.errorbar(x, [100 * r["top1"] for r in res], yerr=[100 * r["top1_se"] for r in res], fmt="o",
                    capsize=4)
    ax_top.set_ylabel("top-1 agreement with bf16, % ± SE (higher is better)")
    for ax in (ax_kl, ax_top):
        ax.set_xticks(x, keys)
        ax.set_xlim(-0.5, len(keys) - 0.5)
        ax.grid(True, axis="y", alpha=0.3)
    t = results["text"]
    fig.suptitle(f"{Path(results.get('model', '')).name or 'model'}: FP8 vs bf16 on {t['name']} "
                 f"({t['predicted']} predictions)", fontsize=9)
    return write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))

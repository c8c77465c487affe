"""The PNG `fp8now sensitivity --plot` writes: every layer's KL alone in model order, and against its size."""

from __future__ import annotations

import os
from pathlib import Path

from ..atomic import write_atomically

FLOOR = 1e-7   # costs at or below zero are drawn here on the log axes (keeping such a layer saves nothing)


def plot_sensitivity(record: dict, kept: list[str], path: str | os.PathLike) -> Path:
    """Left: each layer's KL alone in model order, one colour per projection (the name's last part), the layers
    `kept` in bf16 ringed. Right: the same against the layer's MiB (the rank is their ratio). Log KL axes."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: run `pip install matplotlib`") from None
    layers = record["layers"]
    kinds = list(dict.fromkeys(row["name"].rsplit(".", 1)[-1] for row in layers))
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg rendering without pyplot's global state
    ax_order, ax_size = fig.subplots(1, 2, width_ratios=(2, 1))
    cost = [max(row["alone"], FLOOR) for row in layers]
    mib = [row["bytes"] / 2**20 for row in layers]
    for kind in kinds:
        idx = [i for i, row in enumerate(layers) if row["name"].rsplit(".", 1)[-1] == kind]
        ax_order.plot(idx, [cost[i] for i in idx], "o", ms=4, label=kind)
        ax_size.plot([mib[i] for i in idx], [cost[i] for i in idx], "o", ms=4, label=kind)
    chosen = [i for i, row in enumerate(layers) if row["name"] in set(kept)]
    for ax, xs in ((ax_order, chosen), (ax_size, [mib[i] for i in chosen])):
        ax.plot(xs, [cost[i] for i in chosen], "o", ms=10, mfc="none", color="black", label="kept in bf16")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    ax_order.axhline(record["baseline"] / max(len(layers), 1), color="gray", ls="--", lw=0.8,
                     label="all-FP8 KL / layers")
    ax_order.set_xlabel("layer, in model order")
    ax_order.set_ylabel(f"KL alone (error x{record['magnify']:g}, / {record['magnify'] ** 2:g}), nats/token")
    ax_size.set_xlabel("MiB of the layer's bf16 weight")
    ax_order.legend(fontsize=7, ncol=2)
    s = record["settings"]
    fig.suptitle(f"{Path(record.get('model', '')).name or 'model'} ({record['scheme']}): layer sensitivity on "
                 f"{record['tokens']} generated tokens ({len(s['prompts'])} prompts); all-FP8 KL "
                 f"{record['baseline']:.4f}", fontsize=9)
    return write_atomically(Path(path), lambda f: fig.savefig(f, format="png", dpi=110))

"""The PNG `fp8now sensitivity --plot` writes: every layer's KL cost in model order, and alone against all-but."""

from __future__ import annotations

import os
from pathlib import Path

from ..atomic import write_atomically

FLOOR = 1e-7   # costs at or below zero are drawn here on the log axes (keeping such a layer saves nothing)


def plot_sensitivity(record: dict, kept: list[str], path: str | os.PathLike) -> Path:
    """Left: KL cost per layer in model order, one colour per projection (the name's last part), the layers
    `kept` in bf16 ringed. Right: each layer's KL alone against its all-but gain. Log axes, nats per token."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: run `pip install matplotlib`") from None
    layers = record["layers"]
    kinds = list(dict.fromkeys(row["name"].rsplit(".", 1)[-1] for row in layers))
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg rendering without pyplot's global state
    ax_rank, ax_ends = fig.subplots(1, 2, width_ratios=(2, 1))
    for kind in kinds:
        idx = [i for i, row in enumerate(layers) if row["name"].rsplit(".", 1)[-1] == kind]
        ax_rank.plot(idx, [max(layers[i]["cost"], FLOOR) for i in idx], "o", ms=4, label=kind)
        ax_ends.plot([max(layers[i]["alone"], FLOOR) for i in idx], [max(layers[i]["gain"], FLOOR) for i in idx],
                     "o", ms=4, label=kind)
    chosen = [i for i, row in enumerate(layers) if row["name"] in set(kept)]
    ax_rank.plot(chosen, [max(layers[i]["cost"], FLOOR) for i in chosen], "o", ms=10, mfc="none", color="black",
                 label="kept in bf16")
    ax_rank.axhline(record["baseline"] / max(len(layers), 1), color="gray", ls="--", lw=0.8,
                    label="all-FP8 KL / layers")
    ax_rank.set_xlabel("layer, in model order")
    ax_rank.set_ylabel("KL cost (alone and all-but gain, 1/SE^2-weighted), nats/token")
    ax_ends.set_xlabel(f"alone: KL with only this layer in FP8 (error x{record['magnify']:g}, / {record['magnify'] ** 2:g})")
    ax_ends.set_ylabel("KL saved by keeping only this layer in bf16")
    lo = min([FLOOR * 10] + [max(min(r["alone"], r["gain"]), FLOOR) for r in layers])
    hi = max([FLOOR * 100] + [max(r["alone"], r["gain"]) for r in layers])
    ax_ends.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
    for ax in (ax_rank, ax_ends):
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    ax_ends.set_xscale("log")
    ax_rank.legend(fontsize=7, ncol=2)
    s = record["settings"]
    fig.suptitle(f"{Path(record.get('model', '')).name or 'model'} ({record['scheme']}): layer sensitivity on "
                 f"{record['tokens']} generated tokens ({len(s['prompts'])} prompts); all-FP8 KL "
                 f"{record['baseline']:.4f}", fontsize=9)
    return write_atomically(Path(path), lambda f: fig.savefig(f, format="png", dpi=110))

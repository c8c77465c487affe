"""`fp8now sensitivity [MODEL] --scheme S`: every quantizable layer ranked by how much its FP8 version moves
the output distribution (fp8now.sensitivity), with what `--keep-bf16 auto:F` would keep; text, `--json` or a PNG."""

from __future__ import annotations

import argparse
import sys

DEFAULT_KEEP = "auto:0.05"


def add_command(sub, common: argparse.ArgumentParser, scheme_help: str) -> None:
    """The `sensitivity` subcommand and its flags."""
    sens = sub.add_parser("sensitivity", parents=[common], help="rank the layers by how much FP8 moves the output, "
                          "without data (cached per checkpoint and scheme)")
    sens.add_argument("--scheme", default="channel", help=scheme_help + " (default: channel)")
    sens.add_argument("--keep-bf16", default=DEFAULT_KEEP, metavar="auto:F",
                      help="mark the layers Fp8Config(keep_bf16=...) would keep in bf16: the highest-ranked within "
                      f"the fraction F of the quantizable weight bytes (default: {DEFAULT_KEEP})")
    sens.add_argument("--top", type=int, default=0, metavar="N", help="print only the N highest-ranked layers "
                      "(default: 0, all of them)")
    sens.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of every layer's KL cost in model order (default: no plot)")
    sens.add_argument("--refresh", action="store_true", help="score again even when the cache holds a result "
                      "(default: read it)")


def sensitivity_command(args) -> int:
    """Score (or read from the cache), then print the ranked table or one JSON object. Returns the exit status."""
    from ..config import keep_bf16_fraction
    from ..hf.models import resolve_model
    from ..loading.devices import resolve_device
    from ..sensitivity.score import sensitivity
    from ..sensitivity.select import ranked, select
    from .evaluate import config_dict
    from .flags import flag_config
    from .output import dumps, envelope, scheme_entry

    key, config = flag_config(args)
    fraction = keep_bf16_fraction(args.keep_bf16)           # a bad value fails before any work
    if args.top < 0:
        raise ValueError(f"--top must be 0 (all) or more, got {args.top}")
    device = resolve_device(args.device)
    model_dir = resolve_model(args.model, progress=sys.stderr.isatty())
    record = sensitivity(model_dir, config, device, refresh=args.refresh, progress=sys.stderr.isatty())
    chosen = select(record["layers"], fraction)
    rows = [{**row, "keep_bf16": row["name"] in chosen.names} for row in ranked(record["layers"])]
    if args.plot:
        from ..sensitivity.plot import plot_sensitivity

        record["plot"] = str(plot_sensitivity(record, chosen.names, args.plot))
    keep = {"keep_bf16": args.keep_bf16, "layers": chosen.names, "kept_bytes": chosen.kept_bytes,
            "budget_bytes": chosen.budget_bytes, "total_bytes": chosen.total_bytes}
    if args.json:
        results = {k: record[k] for k in ("baseline", "baseline_se", "magnify", "tokens", "answers", "seconds", "forwards",
                                          "settings", "cached", "cache_file", "cache_error", "plot") if k in record}
        entry = scheme_entry(config_dict(config), record["report"], {**results, "ranking": rows, "keep": keep})
        options = {k: getattr(args, k) for k in ("scheme", "keep_bf16", "top", "plot", "refresh")}
        print(dumps(envelope("sensitivity", model_dir, record["settings"]["device"], options, {key: entry})))
        return 0
    print("\n".join(text_lines(model_dir, key, record, rows, keep, args.top)))
    return 0


def text_lines(model_dir, key: str, record: dict, rows: list[dict], keep: dict, top: int = 0) -> list[str]:
    """The header, the ranked table and the closing lines of the text output."""
    from .output import table

    s = record["settings"]
    source = (f"read from the cache {record['cache_file']} (--refresh scores again)" if record["cached"] else
              f"scored in {record['seconds']['total']:.1f} s (load {record['seconds']['load']:.1f}, generate "
              f"{record['seconds']['generate']:.1f}, quantize {record['seconds']['quantize']:.1f}, measure "
              f"{record['seconds']['measure']:.1f}); " + (f"cached in {record['cache_file']}" if "cache_file" in record
                                                         else f"NOT cached: {record['cache_error']}"))
    lines = [f"{model_dir} ({key}) on {s['device']}: {len(rows)} layers; KL(bf16 || model) on {record['tokens']} "
             f"tokens the bf16 model generated from {len(s['prompts'])} fixed openings ({s['new_tokens']} each)",
             f"all layers in FP8: KL {record['baseline']:.5f} ± {record['baseline_se']:.5f}; {source}", ""]
    shown = rows[:top] if top else rows
    lines += table(("rank", "layer", "kind", "MiB", "score", "KL alone", "± SE", "keep"),
                   [(str(r["rank"]), r["name"], r["kind"], f"{r['bytes'] / 2**20:.2f}", f"{r['score']:.2e}",
                     f"{r['alone']:.2e}", f"{r['alone_se']:.1e}", "bf16" if r["keep_bf16"] else "") for r in shown],
                   right_from=3, right_until=7)
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more (--top 0 shows all)")
    lines += ["", f"KL in nats per token. alone: KL with only this layer in FP8, its error magnified "
              f"{record['magnify']:g}x, divided by {record['magnify'] ** 2:g}; score: KL alone per MiB (the rank)",
              f"keep_bf16={keep['keep_bf16']!r} keeps {len(keep['layers'])} layers in bf16: "
              f"{keep['kept_bytes'] / 2**20:.2f} MiB of {keep['total_bytes'] / 2**20:.2f} MiB "
              f"({100 * keep['kept_bytes'] / max(keep['total_bytes'], 1):.2f}%)"]
    if "plot" in record:
        lines.append(f"plot: {record['plot']}")
    return lines

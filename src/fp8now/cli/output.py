"""What the CLI prints: one JSON shape for `run`, `eval`, `inspect` and `bench`, and the text tables.

JSON (`--json`), the same keys for every command:
    {"command": "run" | "eval" | "inspect" | "quantize" | "bench", "model": folder, "device": str,
     "args": {the command's options},
     "results": {command-wide results: eval's text and bf16 time; bench's model name and bf16 rows;
                 {} otherwise},
     "schemes": {key: {"config": {"scheme", "activation", "backend", "fast_accum"},
                       "report": LoadReport.to_dict(),
                       "results": {run: "generations"; eval: the KL statistics; inspect: "summary";
                                   quantize: "out", "format"; bench: "rows" (bench.py)}}}}
A failed command prints {"command", "model", "error": {"type", "message"}} instead (error_object), besides its
one line on stderr. Non-finite floats become null, so the output is strict JSON.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict

SCHEMA_KEYS = ("command", "model", "device", "args", "results", "schemes")


def envelope(command: str, model, device: str, args: dict, schemes: dict, results: dict | None = None) -> dict:
    """The one JSON shape; `schemes` maps a scheme key to {"config", "report", "results"}."""
    return {"command": command, "model": str(model), "device": device, "args": args,
            "results": results or {}, "schemes": schemes}


def scheme_entry(config: dict, report: dict, results: dict) -> dict:
    return {"config": config, "report": report, "results": results}


def error_object(args, e: BaseException, message: str) -> dict:
    """`--json`'s output for a failed command (exit status 1, or 130 when interrupted)."""
    return {"command": args.command, "model": args.model, "error": {"type": type(e).__name__, "message": message}}


def quantize_summary(report, out, fmt: str, key: str) -> str:
    """`quantize`'s text: what it wrote (dense layers and experts in FP8, what stayed in high precision), then
    the load report's warnings (including what a known reader cannot read)."""
    experts = "" if not report.experts else (
        f", {len(report.experts)} experts modules ({sum(r.num_experts for r in report.experts)} experts) in FP8")
    lines = [f"wrote {out} ({fmt}): {len(report.layers)} layers in FP8 ({key}){experts}, {len(report.ignored)} "
             "left in high precision"]
    return "\n".join(lines + [f"WARNING: {w}" for w in report.warnings()])


def eval_envelope(results: dict, args: dict) -> dict:
    """`evaluate()`'s dict in the shared shape: its load report and layers under "report"."""
    schemes = {}
    for key, r in results["schemes"].items():
        r = dict(r)
        config, layers, report = r.pop("config"), r.pop("layers"), r.pop("load_report")
        schemes[key] = scheme_entry(config, {**report, "layers": layers}, r)
    wide = {"text": results["text"], "bf16_eval_s": results["bf16_eval_s"]}
    if "plot" in results:
        wide["plot"] = results["plot"]
    return envelope("eval", results["model"], results["device"], args, schemes, wide)


def dumps(obj) -> str:
    """Strict JSON on one line."""
    return json.dumps(finite(obj), allow_nan=False)


def finite(obj):
    """`obj` with NaN/inf floats as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


# --- inspect: one row per projection type -----------------------------------------------------------

def projection_summary(layers: list[dict]) -> list[dict]:
    """Rows {"type", "count", "sqnr_min_db", "sqnr_median_db", "worst_layer"} per projection type (the
    last part of the layer name: q_proj, ..., down_proj), in model order. A None SQNR (exact weight, or not
    measured) counts as +inf; the worst layer is the one with the lowest SQNR."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in layers:
        groups[row["name"].rsplit(".", 1)[-1]].append(row)
    out = []
    for kind, rows in groups.items():
        db = [math.inf if r["sqnr_db"] is None else r["sqnr_db"] for r in rows]
        worst = min(range(len(rows)), key=db.__getitem__)
        out.append({"type": kind, "count": len(rows), "sqnr_min_db": db[worst],
                    "sqnr_median_db": statistics.median(db), "worst_layer": rows[worst]["name"]})
    return out


def experts_summary(experts: list[dict]) -> list[dict]:
    """The MoE experts modules as one more summary row (type "experts"): the worst expert of any module,
    the median of the modules' medians, the module holding the worst expert; [] for a dense model."""
    if not experts:
        return []
    db = [math.inf if r["min_sqnr_db"] is None else r["min_sqnr_db"] for r in experts]
    worst = min(range(len(experts)), key=db.__getitem__)
    medians = [math.inf if r["median_sqnr_db"] is None else r["median_sqnr_db"] for r in experts]
    return [{"type": "experts", "count": len(experts), "sqnr_min_db": db[worst],
             "sqnr_median_db": statistics.median(medians), "worst_layer": experts[worst]["name"]}]


def format_summary(rows: list[dict]) -> list[str]:
    def db(x: float) -> str:
        return f"{x:.1f}" if math.isfinite(x) else "inf"

    return table(("projection", "count", "min SQNR dB", "median SQNR dB", "worst layer"),
                 [(r["type"], str(r["count"]), db(r["sqnr_min_db"]), db(r["sqnr_median_db"]),
                   r["worst_layer"]) for r in rows], right_until=4)


def format_inspect(report, summary: list[dict]) -> str:
    """The summary rows, what was left alone, then the report's size/time lines."""
    lines = format_summary(summary)
    lines += [line.split(" SQNR dB")[0] for line in report.experts_lines()]   # the summary row has the SQNR
    lines += [f"left alone: {name} ({why})" for name, why in report.ignored]
    lines += [f"skipped checkpoint tensor: {name} ({why})" for name, why in report.skipped_tensors]
    return "\n".join(lines + report.summary_lines())


# --- eval: llama.cpp's KL statistics per scheme ------------------------------------------------------

def format_eval(results: dict, layers: bool = False) -> str:
    """The statistics per scheme; with `layers`, one row per layer with its weight SQNR under each scheme."""
    t, schemes = results["text"], results["schemes"]
    lines = [f"model {results['model']} on {results['device']}; text {t['name']}: {t['tokens']} tokens "
             f"in {t['windows']} windows of <= {t['seq_len']} ({t['predicted']} predictions)", ""]
    lines += table(("scheme", "PPL bf16", "PPL fp8", "PPL ratio", "mean KL", "KL p99", "KL p99.9",
                    "top-1 %"),
                   [(k, f"{r['ppl_bf16']:.4f}", f"{r['ppl_fp8']:.4f}", _pm(r["ppl_ratio"], r["ppl_ratio_se"], 5),
                     _pm(r["kl"], r["kl_se"], 6), f"{r['kl_p99']:.5f}", f"{r['kl_p999']:.5f}",
                     _pm(100 * r["top1"], 100 * r["top1_se"], 2)) for k, r in schemes.items()])
    lines += ["", "± is one standard error (llama.cpp's --kl-divergence statistics; KL(bf16 || fp8) in nats "
              "per token, percentiles over tokens)"]
    if not layers:
        return "\n".join(lines)
    lines += ["", "per-layer weight error (SQNR dB of the dequantized FP8 weight; higher is better)"]
    keys = list(schemes)
    names = [r["name"] for r in schemes[keys[0]]["layers"]]
    by_key = {k: {r["name"]: r for r in schemes[k]["layers"]} for k in keys}
    lines += table(("layer", *keys), [(name, *(_db(by_key[k].get(name)) for k in keys)) for name in names])
    return "\n".join(lines)


def _pm(value: float, se: float, digits: int) -> str:
    return f"{value:.{digits}f} ± {se:.{digits}f}"


def _db(row: dict | None) -> str:
    if row is None:
        return "-"
    return "inf" if row["sqnr_db"] is None else f"{row['sqnr_db']:.1f}"


def table(head: tuple[str, ...], rows: list[tuple[str, ...]], right_from: int = 1,
          right_until: int | None = None) -> list[str]:
    """Aligned columns; columns `right_from` .. `right_until` - 1 are right-aligned."""
    stop = len(head) if right_until is None else right_until
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.rjust(w) if right_from <= i < stop else x.ljust(w)
                       for i, (x, w) in enumerate(zip(r, widths))).rstrip() for r in (head, *rows)]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def memory_summary(report, rss_after_load: int | None) -> str:
    """`run`'s closing lines: bytes, the load's time and memory, the process's peak, what was left alone,
    backends."""
    from ..host_memory import mib, peak_rss_bytes

    backends = Counter(row.backend for row in report.layers)
    backends.update(f"{row.backend} (experts)" for row in report.experts)
    left = ", ".join(name for name, _ in report.ignored) or "none"
    device_peak = "" if report.peak_device_bytes is None else \
        f"; peak device memory {mib(report.peak_device_bytes)}"
    return "\n".join([
        report.summary_lines()[0],
        f"load: {report.load_s:.2f} s; peak RSS by its end {mib(report.peak_host_rss_bytes or None)}, "
        f"RSS after it {mib(rss_after_load)}{device_peak}",
        f"process peak RSS: {mib(peak_rss_bytes())} (the whole run, read at its end)",
        f"left alone: {len(report.ignored)} ({left})",
        "backends: " + ", ".join(f"{name} x{count}" for name, count in sorted(backends.items())),
        *([f"cpu activation quantizer: {report.cpu_quantizer}"] if report.cpu_quantizer else []),
        *([f"cpu weight quantizer: {report.cpu_weight_quantizer}"] if report.cpu_weight_quantizer else []),
        *(line for line in report.summary_lines() if line.startswith("WARNING")),
    ])

"""Issue 40 part 2 on the embedded SmolLM2-135M, CPU: does keep_bf16="auto:0.05" cut the KL, and what does the
sensitivity pass cost against one `fp8now eval`?

Per scheme (tensor, channel, block):
1. time, back to back, as subprocesses: `fp8now eval --scheme S` (its default: the first 4096 tokens of the
   bundled licence texts) and `fp8now sensitivity --scheme S --refresh` (a fresh pass, stored in the cache),
   `--repeat` rounds, the fastest of each counted (the CPU is shared);
2. KL(bf16 || FP8), top-1 agreement and perplexity on the licence texts (`--max-tokens`, default all of them),
   which the choice never saw (it scores on text the model generates from its own fixed openings), without
   and with keep_bf16 (the cached scores of step 1): one bf16 reference run shared by every FP8 model.

    PYTHONPATH=src python3 benchmarks/sensitivity_kl.py --max-tokens 4096
    # writes benchmarks/results/sensitivity_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sensitivity_smollm2_cpu.json")


def timed_cli(*args: str) -> tuple[float, dict]:
    """Wall seconds of `python -m fp8now ARGS --json` and its JSON object."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fp8now", *args, "--json"], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"fp8now {' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")
    return seconds, json.loads(proc.stdout)


def timing_row(scheme: str, repeat: int) -> dict:
    """`repeat` rounds of eval then a fresh pass, back to back; the ratio of the fastest of each (the machine is
    shared: the slower rounds are other people's work), every round's seconds and the load averages kept."""
    evals, passes = [], []
    for _ in range(repeat):
        evals.append(timed_cli("eval", "--scheme", scheme)[0])
        seconds, out = timed_cli("sensitivity", "--scheme", scheme, "--refresh")
        passes.append(seconds)
    res = out["schemes"][scheme]["results"]
    eval_s, sens_s = min(evals), min(passes)
    print(f"{scheme}: eval {eval_s:.1f} s, sensitivity {sens_s:.1f} s ({sens_s / eval_s:.2f}x); rounds: eval "
          f"{', '.join(f'{x:.1f}' for x in evals)}, sensitivity {', '.join(f'{x:.1f}' for x in passes)}", flush=True)
    return {"kind": "timing", "scheme": scheme, "eval_s": eval_s, "sensitivity_s": sens_s,
            "ratio": sens_s / eval_s, "eval_rounds_s": evals, "sensitivity_rounds_s": passes,
            "sensitivity_parts_s": res["seconds"], "scored_tokens": res["tokens"], "load_average": os.getloadavg()}


def accuracy_rows(schemes: list[str], keep: str, max_tokens: int | None) -> list[dict]:
    from fp8now import Fp8Config, load
    from fp8now.cli.evaluate import bundled_text, compare_models, tokenize, windows
    from fp8now.hf.bf16 import load_bf16
    from fp8now.hf.models import resolve_model

    folder = resolve_model(None)
    name, text = bundled_text()
    ids = tokenize(folder, text)
    ids = ids[:max_tokens] if max_tokens else ids
    wins = windows(ids, 512)
    models, reports = {}, {}
    for scheme in schemes:
        for k in (None, keep):
            key = (scheme, k)
            models[key], reports[key] = load(folder, Fp8Config(scheme=scheme, keep_bf16=k), device="cpu",
                                             measure_error=False)
    comparison = compare_models(load_bf16(folder, torch.device("cpu")), models, wins, 4, "cpu", progress=False)
    rows = []
    for (scheme, k), report in reports.items():
        m = comparison.metrics((scheme, k))
        kept = report.keep_bf16 or {"layers": [], "kept_bytes": 0, "total_bytes": report.bf16_bytes}
        base = comparison.metrics((scheme, None))["kl"]
        rows.append({"kind": "accuracy", "scheme": scheme, "keep_bf16": k,
                     "text": {"name": name, "tokens": int(ids.numel()), "predicted": comparison.predicted},
                     **{f: m[f] for f in ("kl", "kl_se", "top1", "top1_se", "ppl_bf16", "ppl_fp8", "kl_p99")},
                     "kl_reduction_pct": 100 * (1 - m["kl"] / base), "kept_layers": kept["layers"],
                     "kept_bytes": kept["kept_bytes"], "quantizable_bytes": kept["total_bytes"],
                     "kept_pct": 100 * kept["kept_bytes"] / kept["total_bytes"]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="tensor,channel,block")
    p.add_argument("--keep", default="auto:0.05")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens of the licence texts (0: all)")
    p.add_argument("--timing", default=None, metavar="SCHEMES",
                   help="the schemes to time (default: all of --schemes; 'none': none, the cache must hold the scores)")
    p.add_argument("--repeat", type=int, default=2, help="timing rounds per scheme (the fastest counts)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    timed = schemes if args.timing is None else [s.strip() for s in args.timing.split(",") if s.strip() != "none"]
    rows = [timing_row(s, args.repeat) for s in timed if s]
    rows += accuracy_rows(schemes, args.keep, args.max_tokens or None)
    for row in rows:
        if row["kind"] == "accuracy":
            print(f"{row['scheme']} keep_bf16={row['keep_bf16']}: KL {row['kl']:.5f} ± {row['kl_se']:.5f} "
                  f"({row['kl_reduction_pct']:+.1f}% less), top-1 {100 * row['top1']:.2f}%, ppl {row['ppl_fp8']:.3f} "
                  f"(bf16 {row['ppl_bf16']:.3f}), kept {len(row['kept_layers'])} layers = {row['kept_pct']:.2f}%")
    record.write(args.out, record.meta(device="cpu"), rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

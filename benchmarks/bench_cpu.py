"""CPU targets of issue 28 on the embedded model, each FP8 figure beside plain transformers bf16 in the same run.

- decode: `fp8now run --mode greedy` (the real CLI, a subprocess) against a bf16 child process that
  loads the same checkpoint with `AutoModelForCausalLM.from_pretrained` and generates the same way
  (chat template, an untimed 8-token warm-up, then the timed greedy `generate`); both report tokens/s
  and their process peak RSS (VmHWM at exit). Target: FP8 >= 0.8x the tokens/s, peak RSS <= 1.2x.
- eval forward: both models in one process, the forward over `eval`'s default windows (the first
  QUICK_EVAL_TOKENS tokens of the bundled text, windows of 512, batches of 4), timed alternately.
  Target: FP8 <= 1.25x the bf16 time.
Pairs run interleaved and are repeated, since the machine may be shared: each ratio is taken within
one pair, and the spread over the repeats is the noise.

`PYTHONPATH=src python benchmarks/bench_cpu.py [--repeats 3] [--tokens 64] [--out benchmarks/results/cpu.json]`
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK_EVAL_TOKENS = 4096  # fp8now.cli.main's default for `eval --max-tokens`


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def bf16_child(tokens: int) -> None:
    """Plain transformers bf16: load, warm up, one timed greedy generate; prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    from fp8now.cli.main import DEFAULT_PROMPT, _encode, _timed_generate
    from fp8now.host_memory import peak_rss_bytes
    from fp8now.hf.models import resolve_model
    from fp8now.hf.tokenizer import load_tokenizer

    model_dir = resolve_model(None, progress=False)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    enc = _encode(tokenizer, DEFAULT_PROMPT, "cpu")
    _, n, seconds = _timed_generate(model, tokenizer, enc, tokens, dict(do_sample=False), 0)
    print(json.dumps({"tok_s": n / seconds, "tokens": n, "peak_rss_mib": peak_rss_bytes() / 2**20,
                      "threads": torch.get_num_threads()}))


def fp8_run(tokens: int) -> dict:
    """`fp8now run` as a user runs it; tokens/s and process peak RSS parsed from its output."""
    proc = subprocess.run([sys.executable, "-m", "fp8now", "run", "--mode", "greedy",
                           "--max-new-tokens", str(tokens)], capture_output=True, text=True, env=_env())
    if proc.returncode:
        raise RuntimeError(f"fp8now run failed: {proc.stderr[-2000:]}")
    speed = re.search(r"--- greedy: (\d+) tokens in ([\d.]+) s", proc.stdout)  # the printed rate is rounded
    peak = re.search(r"process peak RSS: ([\d.]+) MiB", proc.stdout)
    load = re.search(r"load: ([\d.]+) s; peak RSS by its end ([\d.]+) MiB, RSS after it ([\d.]+) MiB",
                     proc.stdout)
    return {"tok_s": int(speed[1]) / float(speed[2]), "tokens": int(speed[1]), "peak_rss_mib": float(peak[1]),
            "load_s": float(load[1]), "load_peak_rss_mib": float(load[2]), "rss_after_load_mib": float(load[3])}


def bf16_run(tokens: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child-bf16", "--tokens", str(tokens)],
                          capture_output=True, text=True, env=_env())
    if proc.returncode:
        raise RuntimeError(f"bf16 child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def eval_forward(repeats: int, n_tokens: int) -> list[dict]:
    """Seconds of the FP8 (channel, default backend) and bf16 forwards over eval's default windows."""
    import torch

    from fp8now import Fp8Config, load
    from fp8now.cli.evaluate import batches, bundled_text, load_bf16, tokenize, windows
    from fp8now.hf.models import resolve_model

    model_dir = resolve_model(None, progress=False)
    wins = windows(tokenize(model_dir, bundled_text()[1])[:n_tokens], 512)
    fp8, _ = load(model_dir, Fp8Config(scheme="channel"), device="cpu", measure_error=False)
    models = {"fp8": fp8, "bf16": load_bf16(model_dir, torch.device("cpu"))}

    def forward_s(model) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for x in batches(wins, 4):
                model(input_ids=x, use_cache=False)
        return time.perf_counter() - start

    forward_s(fp8), forward_s(models["bf16"])  # warm-up
    rows = []
    for r in range(repeats):
        t = {name: forward_s(m) for name, m in models.items()}
        rows.append({"target": "eval_forward", "repeat": r, "tokens": sum(w.numel() for w in wins),
                     "fp8_s": t["fp8"], "bf16_s": t["bf16"], "ratio": t["fp8"] / t["bf16"]})
        print(f"eval forward {r}: fp8 {t['fp8']:.2f} s, bf16 {t['bf16']:.2f} s, {rows[-1]['ratio']:.2f}x",
              file=sys.stderr)
    return rows


def _meta(args) -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import record   # the commit whose files run (record.commit: "+dirty" where they are no commit's)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": None, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "torch": torch.__version__, "triton": triton_version, "commit": record.commit(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def _summary(rows: list[dict]) -> dict:
    out = {}
    for target in ("decode_tok_s", "peak_rss", "eval_forward"):
        ratios = [r["ratio"] for r in rows if r["target"] == target]
        if ratios:
            out[target] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved pairs per target (default: 3)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per run (default: 64)")
    p.add_argument("--eval-tokens", type=int, default=QUICK_EVAL_TOKENS,
                   help=f"tokens of the eval forward (default: {QUICK_EVAL_TOKENS}, eval's default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu.json"),
                   help="results file (default: benchmarks/results/cpu.json)")
    p.add_argument("--only", choices=("eval", "decode"), default=None,
                   help="run one of the two targets (default: both)")
    p.add_argument("--child-bf16", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_bf16:
        return bf16_child(args.tokens)
    meta = _meta(args)
    rows: list[dict] = [] if args.only == "decode" else eval_forward(args.repeats, args.eval_tokens)
    _write(args.out, meta, rows)
    for r in range(0 if args.only == "eval" else args.repeats):
        fp8, bf16 = fp8_run(args.tokens), bf16_run(args.tokens)
        rows.append({"target": "decode_tok_s", "repeat": r, "fp8": fp8["tok_s"], "bf16": bf16["tok_s"],
                     "ratio": fp8["tok_s"] / bf16["tok_s"], "tokens": [fp8["tokens"], bf16["tokens"]]})
        rows.append({"target": "peak_rss", "repeat": r, "fp8_mib": fp8["peak_rss_mib"],
                     "bf16_mib": bf16["peak_rss_mib"], "ratio": fp8["peak_rss_mib"] / bf16["peak_rss_mib"],
                     "fp8_load_s": fp8["load_s"], "fp8_load_peak_mib": fp8["load_peak_rss_mib"],
                     "fp8_rss_after_load_mib": fp8["rss_after_load_mib"]})
        print(f"decode {r}: fp8 {fp8['tok_s']:.1f} tok/s, bf16 {bf16['tok_s']:.1f} tok/s "
              f"({rows[-2]['ratio']:.2f}x); peak RSS {fp8['peak_rss_mib']:.0f} / {bf16['peak_rss_mib']:.0f} MiB "
              f"({rows[-1]['ratio']:.2f}x)", file=sys.stderr)
        _write(args.out, meta, rows)   # after every pair: a long run interrupted keeps what it measured
    print(json.dumps(_summary(rows), indent=1))


def _write(out: str, meta: dict, rows: list[dict]) -> None:
    meta["load_average_end"] = os.getloadavg()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"meta": meta, "rows": rows, "summary": _summary(rows)}, indent=1) + "\n")

if __name__ == "__main__":
    main()

"""`fp8now bench`: the whole-model measurement of benchmarks/bench_model.py for one model and fp8now's
schemes against plain transformers bf16 (torchao's peers are the benchmark script's)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time


def bench_command(args, device) -> int:
    """bf16 and fp8now's scheme(s) of `args` on `device` (None: auto) through bench.measure; prints the
    ratio table, or one JSON object (output.envelope) with --json. Returns the exit status."""
    from .bench import measure, ratio_table
    from .bench_alone import measure_alone
    from .bench_load import bf16_loader, fp8now_loader
    from .bench_args import options
    from .flags import flag_config, layer_options
    from .bench_presets import bench_model_dir
    from .evaluate import config_dict, expand_schemes
    from ..loading.load import resolve_device
    from .output import dumps, envelope, scheme_entry

    opts = options(args)
    keys = expand_schemes(args.scheme.split(","))
    device = resolve_device(device)
    workdir = args.workdir or tempfile.mkdtemp(prefix="fp8now-bench-")
    rows: list[dict] = []
    def log(text: str) -> None:
        if not args.json:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
    try:
        name, folder = bench_model_dir(args.model, workdir, args.layers, device, log=log)
        layers = layer_options(args)   # --fp8-head / --fp8-embedding
        impls = {"bf16": bf16_loader, **{f"fp8now-{k}": fp8now_loader(k, **layers) for k in keys}}
        alone = None
        plain = {"head": False, "embedding": False, "weight_numerics": "spec", "keep_bf16": None}
        if layers == plain:   # bench_alone's names (keep_bf16 runs in this process)
            alone = lambda impl, reload: measure_alone([sys.executable, "-m", "fp8now.cli.bench_alone"], impl,  # noqa: E731
                                                       folder, device, opts.cold, reload)
        reports = measure(name, folder, impls, device, opts, rows.append, log, alone=alone)["reports"]
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        options_out = {k: getattr(args, k) for k in ("scheme", "phases", "prefill", "decode", "context",
                                                     "decode_mode", "reps", "prompts", "layers", "fp8_head",
                                                     "fp8_embedding")}
        schemes = {k: scheme_entry(config_dict(flag_config(args, k)[1]),
                                   r.to_dict() if (r := reports.get(f"fp8now-{k}")) is not None else None,
                                   {"rows": [row for row in rows if row["impl"] == f"fp8now-{k}"]}) for k in keys}
        results = {"name": name, "rows": [row for row in rows if row["impl"] == "bf16"]}
        print(dumps(envelope("bench", folder, str(device), options_out, schemes, results)))
        return 0
    print(f"{folder} on {device}: bf16 against FP8 ({', '.join(keys)})")
    print(ratio_table(rows))
    return 0

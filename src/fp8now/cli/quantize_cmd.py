"""`fp8now quantize`: quantize a checkpoint while loading it and write an FP8 checkpoint (compressed-tensors or
transformers' fp8) for vLLM, SGLang or transformers; text or, with --json, one JSON object."""

from __future__ import annotations

import contextlib
import io

from ..export import check_export, quantize
from ..hf.models import resolve_model
from .evaluate import config_dict
from .flags import flag_config
from .output import dumps, envelope, quantize_summary, scheme_entry


def quantize_command(args, device, progress: bool) -> int:
    """Quantize MODEL while loading it and write it in --format to --out; the summary (or one JSON object)."""
    key, config = flag_config(args)
    check_export(config, args.format, args.out)   # before converting or loading anything
    with contextlib.redirect_stdout(io.StringIO()) if args.json else contextlib.nullcontext():
        model_dir = resolve_model(args.model, progress=progress)
        out, report = quantize(model_dir, args.out, config, args.format, device=device)
    summary = quantize_summary(report, out, args.format, key)
    if args.json:
        options = {k: getattr(args, k) for k in ("scheme", "format", "out", "fp8_head", "fp8_embedding")}
        entry = scheme_entry(config_dict(config), report.to_dict(), {"out": str(out), "format": args.format})
        print(dumps(envelope("quantize", model_dir, report.device, options, {key: entry})))
        return 0
    print(summary)
    return 0

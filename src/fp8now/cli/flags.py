"""The CLI flags that quantize the output head and the input embedding too (Fp8Config(head=, embedding=)),
choose the weight numerics (Fp8Config(weight_numerics=)) and keep the most sensitive layers in bf16
(Fp8Config(keep_bf16=)), shared by every command that takes `--scheme`."""

from __future__ import annotations

import argparse

from ..config import WEIGHT_NUMERICS


def add_layer_flags(command: argparse.ArgumentParser) -> None:
    """`--fp8-head`, `--fp8-embedding`, `--weight-numerics` and `--keep-bf16` on one subcommand."""
    command.add_argument("--fp8-head", action="store_true",
                         help="also quantize the output head (lm_head) like the block linears (default: off, "
                         "kept in bf16); a tied model (tie_word_embeddings) needs --fp8-embedding with it")
    command.add_argument("--fp8-embedding", action="store_true",
                         help="also store the input embedding as FP8 rows with per-row scales (default: off); a "
                         "tied model needs --fp8-head with it; not exportable (quantize refuses it)")
    command.add_argument("--weight-numerics", choices=tuple(WEIGHT_NUMERICS), default="spec",
                         help="spec: fp8now's float32 rules (default); llm-compressor: the FP8 weight bytes and "
                         "scales llm-compressor writes for FP8_DYNAMIC (--scheme channel) and FP8_BLOCK (block), "
                         "bf16 scales included; llm-compressor-triton: those it writes when run on a Hopper or "
                         "newer GPU (see the README)")
    command.add_argument("--keep-bf16", default=None, metavar="auto:F",
                         help="keep in bf16 the layers a data-free sensitivity pass ranks highest, within the fraction "
                         "F of the quantizable weight bytes, e.g. auto:0.05 (scored once per checkpoint and scheme, "
                         "then read from the fp8now cache; see `fp8now sensitivity`) (default: off)")


def layer_options(args: argparse.Namespace) -> dict:
    """Fp8Config's `head`, `embedding`, `weight_numerics` and `keep_bf16` from the parsed flags."""
    return {"head": bool(getattr(args, "fp8_head", False)), "embedding": bool(getattr(args, "fp8_embedding", False)),
            "weight_numerics": getattr(args, "weight_numerics", "spec"), "keep_bf16": getattr(args, "keep_bf16", None)}


def flag_config(args: argparse.Namespace, name: str | None = None):
    """(scheme key, Fp8Config) of scheme `name` (default: --scheme) with the command's --fast-accum (where it
    has one), --fp8-head, --fp8-embedding, --weight-numerics and --keep-bf16."""
    from .evaluate import scheme_config

    return scheme_config(name or args.scheme, getattr(args, "fast_accum", False), **layer_options(args))

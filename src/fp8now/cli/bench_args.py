"""The options of a whole-model benchmark, shared by `fp8now bench` and benchmarks/bench_model.py so that
both take the same flags with the same defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

PHASES = ("load", "reload", "accuracy", "prefill", "decode")
DECODE_MODES = ("graph", "compile", "eager")


@dataclass(frozen=True)
class Options:
    """What to measure: the phases, prefill calls (batch, tokens), decode batches at `context` tokens of
    context, how a decode step runs (None: graph on CUDA, eager on the CPU), repetitions per timing,
    the accuracy prompts (count, tokens; random presets only), the seed of every input."""

    phases: tuple[str, ...] = PHASES
    prefill: tuple[tuple[int, int], ...] = ((1, 2048), (8, 2048))
    decode: tuple[int, ...] = (1, 8, 64)
    context: int = 512
    decode_mode: str | None = None
    reps: int = 5
    prompts: tuple[int, int] = (4, 128)
    seed: int = 0
    cold: bool = False   # load rows: the checkpoint evicted from the page cache first


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what} values must be at least 1, got {text!r}")
    return values


def _pairs(text: str, what: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        b, x, t = part.partition("x")
        if not x:
            raise ValueError(f"{what} takes BxT pairs such as 1x2048,8x2048, got {part!r}")
        pairs.append(tuple(_ints(f"{b},{t}", what)))
    return tuple(pairs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The measuring options (the model and the implementations are the caller's)."""
    d = Options()
    p.add_argument("--phases", default=",".join(d.phases), help=f"comma list of {', '.join(PHASES)} "
                   f"(default: all)")
    p.add_argument("--prefill", default=",".join(f"{b}x{t}" for b, t in d.prefill), metavar="BxT,...",
                   help="prefill calls: sequences x tokens (default: %(default)s)")
    p.add_argument("--decode", default=",".join(map(str, d.decode)), metavar="B,...",
                   help="decode batch sizes (default: %(default)s)")
    p.add_argument("--context", type=int, default=d.context, metavar="T",
                   help="tokens in the static KV cache before the timed decode step (default: %(default)s)")
    p.add_argument("--decode-mode", choices=DECODE_MODES, default=None,
                   help="the decode step captured in one CUDA graph, under torch.compile "
                   "(reduce-overhead), or eager (default: graph on CUDA, eager on the CPU)")
    p.add_argument("--reps", type=int, default=d.reps, help="timed calls per prefill figure, median; decode "
                   "takes 4x as many steps (default: %(default)s)")
    p.add_argument("--prompts", default="x".join(map(str, d.prompts)), metavar="PxT",
                   help="accuracy prompts of random token ids: count x tokens, for models without a "
                   "tokenizer (default: %(default)s)")
    p.add_argument("--cold", action="store_true", help="load rows from a cold page cache (the files evicted "
                   "first; default: warm, the files read once before every load)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of a preset (default: the preset's own: all 32 for llama3.1-8b, 8 "
                   "for qwen3-30b-a3b)")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="where presets are written and reused (default: a temporary folder, removed after)")


def add_command(sub, common: argparse.ArgumentParser, scheme_help: str) -> None:
    """The `fp8now bench` subcommand on the CLI's subparsers."""
    from .bench_presets import NAMES
    from .flags import add_layer_flags

    be = sub.add_parser("bench", parents=[common], help="whole-model speed and accuracy of FP8 against bf16: "
                        "load, prefill, decode (CUDA graph), KL", description="MODEL may also be a preset, "
                        f"written once as a random-weight checkpoint of real shapes: {', '.join(NAMES)}")
    be.add_argument("--scheme", default="channel", help=scheme_help + "; a comma list, or all (default: channel)")
    add_layer_flags(be)
    add_arguments(be)


def options(args: argparse.Namespace) -> Options:
    """Options from parsed arguments; a clear error for a bad list."""
    phases = tuple(v.strip() for v in args.phases.split(",") if v.strip())
    bad = [v for v in phases if v not in PHASES]
    if bad or not phases:
        raise ValueError(f"--phases takes a comma list of {', '.join(PHASES)}, got {args.phases!r}")
    if args.context < 1 or args.reps < 1:
        raise ValueError(f"--context and --reps must be at least 1, got {args.context} and {args.reps}")
    prompts = _pairs(args.prompts, "--prompts")
    if len(prompts) != 1:
        raise ValueError(f"--prompts takes one PxT pair such as 4x128, got {args.prompts!r}")
    return Options(phases=phases, prefill=_pairs(args.prefill, "--prefill"), decode=_ints(args.decode, "--decode"),
                   context=args.context, decode_mode=args.decode_mode, reps=args.reps, prompts=prompts[0],
                   cold=args.cold)

"""`fp8now run | eval | inspect | quantize | bench | sensitivity`: each defaults to the embedded SmolLM2-135M-Instruct.

Results go to stdout, progress bars and errors to stderr. An error is one line and exit status 1
(`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

from .flags import add_layer_flags, flag_config, layer_options
from .output import dumps, error_object
from .sensitivity import add_command as add_sensitivity_command, sensitivity_command

DEFAULT_PROMPT = "Explain in two sentences why smaller number formats make language models faster."
SAMPLE_TEMPERATURE = 0.7
RUN_MODES = ("greedy", "sampled", "both")
WARMUP_TOKENS = 8        # an untimed generate first: the first calls of a process are slow
QUICK_EVAL_TOKENS = 4096


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="Hugging Face checkpoint folder or repo id (org/name, from the local Hugging Face "
                        "cache or the Hub) (default: the embedded SmolLM2-135M-Instruct)")
    common.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    common.add_argument("--debug", action="store_true", help="show the traceback on errors (default: off)")
    common.add_argument("--json", action="store_true",
                        help="print one JSON object instead of text (see fp8now.cli.output; default: text)")
    p = argparse.ArgumentParser(prog="fp8now", description="Run bf16 LLM checkpoints in FP8, quantized "
                                "while they load.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    scheme_help = "channel, block, tensor, tensor-tensor (per-tensor activations); vLLM/llm-compressor names too"

    run = sub.add_parser("run", parents=[common], help="load in FP8 and generate text")
    run.add_argument("--scheme", default="channel", help=scheme_help + " (default: channel)")
    run.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the user message (default: {DEFAULT_PROMPT!r})")
    run.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                     help="tokens to generate per mode (default: 64)")
    run.add_argument("--mode", choices=RUN_MODES, default="greedy",
                     help=f"greedy decoding, sampling (temperature {SAMPLE_TEMPERATURE}), or both (default: greedy)")
    run.add_argument("--seed", type=int, default=0, help="seed of the sampled generation (default: 0)")

    ev = sub.add_parser("eval", parents=[common], help="perplexity, KL and top-1 agreement of FP8 vs bf16")
    ev.add_argument("--scheme", default="channel", help=scheme_help + ", or all (default: channel)")
    ev.add_argument("--text", default=None, metavar="FILE",
                    help="UTF-8 text to evaluate on (default: the bundled licence texts, ~29k tokens)")
    ev.add_argument("--max-tokens", type=int, default=QUICK_EVAL_TOKENS, metavar="N",
                    help=f"use only the first N tokens of the text; 0 for all of it (default: {QUICK_EVAL_TOKENS}, "
                         "a quick check: 8 windows of 512)")
    ev.add_argument("--seq-len", type=int, default=512, metavar="L", help="window length (default: 512)")
    ev.add_argument("--batch-size", type=int, default=4, metavar="B", help="windows per forward (default: 4)")
    ev.add_argument("--plot", default=None, metavar="PATH",
                    help="write a PNG of mean KL and top-1 agreement per scheme, with standard errors "
                         "(default: no plot)")
    ev.add_argument("--layers", action="store_true", help="also print every layer's weight SQNR (default: off)")

    ins = sub.add_parser("inspect", parents=[common], help="load in FP8 and print the load report")
    ins.add_argument("--scheme", default="channel", help=scheme_help + " (default: channel)")
    ins.add_argument("--layers", action="store_true",
                     help="print every layer (default: one summary row per projection type)")
    for command in (run, ev, ins):
        add_layer_flags(command)
        command.add_argument("--fast-accum", action="store_true",
                             help="tensor/channel GEMMs with the tensor cores' fast FP8 accumulation, as torchao "
                             "does by default (GPU with FP8 tensor cores only; block refuses it) (default: off, "
                             "float32 accumulation per K-block)")
    qz = sub.add_parser("quantize", parents=[common], help="quantize while loading, save an FP8 checkpoint "
                        "(compressed-tensors or transformers' fp8) for vLLM, SGLang or transformers")
    qz.add_argument("--scheme", default="channel", help=scheme_help + " (default: channel)")
    qz.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "fp8"),
                    help="compressed-tensors (every scheme; default) or fp8 (block only)")
    qz.add_argument("--out", required=True, metavar="DIR", help="new folder to write (must not exist)")
    add_layer_flags(qz)

    from .bench_args import add_command

    add_command(sub, common, scheme_help)
    add_sensitivity_command(sub, common, scheme_help)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `fp8now` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return {"run": cmd_run, "eval": cmd_eval, "inspect": cmd_inspect,
                "quantize": cmd_quantize, "bench": cmd_bench, "sensitivity": sensitivity_command}[args.command](args)
    except KeyboardInterrupt as e:
        print("fp8now: interrupted", file=sys.stderr)
        if args.json:
            print(dumps(error_object(args, e, "interrupted")))
        return 130
    except Exception as e:  # one clear line, unless --debug; with --json also one JSON object on stdout
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"fp8now: error: {message}", file=sys.stderr)
        if args.json:
            print(dumps(error_object(args, e, message)))
        return 1


def _device(name: str | None):
    import torch

    if name is None:
        return None
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None


def _progress() -> bool:
    """Progress bars only where someone watches: stderr is a terminal."""
    return sys.stderr.isatty()


def _load(args, measure_error: bool = True, model_dir=None):
    """Check the scheme first (fast), then resolve the model folder and load it in FP8."""
    from ..sensitivity.keep import load
    from ..hf.models import resolve_model

    key, config = flag_config(args)
    device = _device(args.device)
    model_dir = model_dir or resolve_model(args.model, progress=_progress())
    model, report = load(model_dir, config, device=device, measure_error=measure_error)
    return key, model_dir, model, report


def cmd_inspect(args) -> int:
    from .evaluate import config_dict
    from .output import dumps, envelope, experts_summary, format_inspect, projection_summary, scheme_entry

    key, model_dir, _, report = _load(args)
    data = report.to_dict()
    summary = projection_summary(data["layers"]) + experts_summary(data["experts"])
    if args.json:
        entry = scheme_entry(config_dict(flag_config(args, key)[1]), data, {"summary": summary})
        print(dumps(envelope("inspect", model_dir, report.device, {"layers": args.layers}, {key: entry})))
        return 0
    print(f"{model_dir} as FP8 ({key})")
    print(report.format_table() if args.layers else format_inspect(report, summary))
    print("\n".join(report.plan_lines()))
    return 0


def cmd_run(args) -> int:
    """Generate; with --json the text lines are dropped and one JSON object printed instead."""
    with contextlib.redirect_stdout(io.StringIO()) if args.json else contextlib.nullcontext():
        key, model_dir, report, generations = _run(args)
    if args.json:
        from .evaluate import config_dict
        from .output import dumps, envelope, scheme_entry

        options = {k: getattr(args, k) for k in ("scheme", "prompt", "max_new_tokens", "mode", "seed", "fast_accum",
                                                 "fp8_head", "fp8_embedding", "keep_bf16")}
        entry = scheme_entry(config_dict(flag_config(args, key)[1]), report.to_dict(),
                             {"generations": generations})
        print(dumps(envelope("run", model_dir, report.device, options, {key: entry})))
    return 0


def _run(args):
    """The text output of `run`; returns (scheme key, model folder, load report, generation rows)."""
    from ..host_memory import current_rss_bytes
    from ..hf.models import resolve_model
    from .output import memory_summary
    from ..hf.tokenizer import check_token_ids, load_tokenizer

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    flag_config(args)   # a bad scheme fails before any read
    model_dir = resolve_model(args.model, progress=_progress())
    tokenizer = load_tokenizer(model_dir)            # before any weight is read
    check_token_ids(_encode(tokenizer, args.prompt, "cpu")["input_ids"], model_dir)
    key, model_dir, model, report = _load(args, measure_error=False, model_dir=model_dir)
    rss_after_load = current_rss_bytes()
    enc = _encode(tokenizer, args.prompt, next(model.parameters()).device)
    print(f"model: {model_dir}  scheme: {key}  device: {report.device}")
    print(f"prompt: {args.prompt}")
    generations = []
    for title, kwargs in _modes(args):
        text, n, seconds = _timed_generate(model, tokenizer, enc, args.max_new_tokens, kwargs, args.seed)
        generations.append({"mode": title.split(" ")[0], **kwargs, "seed": args.seed, "text": text,
                            "new_tokens": n, "seconds": seconds, "tokens_per_s": n / seconds})
        print(f"\n--- {title}: {n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s after a "
              f"{min(WARMUP_TOKENS, args.max_new_tokens)}-token warm-up)")
        print(text)
    print()
    print(memory_summary(report, rss_after_load))
    return key, model_dir, report, generations


def _modes(args) -> list[tuple[str, dict]]:
    """(title, generate kwargs) of each generation `--mode` asks for."""
    modes = []
    if args.mode in ("greedy", "both"):
        modes.append(("greedy", dict(do_sample=False)))
    if args.mode in ("sampled", "both"):
        modes.append((f"sampled (temperature {SAMPLE_TEMPERATURE}, seed {args.seed})",
                      dict(do_sample=True, temperature=SAMPLE_TEMPERATURE, top_k=0, top_p=1.0)))
    return modes


def _encode(tokenizer, prompt: str, device):
    """The prompt as model inputs: through the chat template when the tokenizer has one."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=not chat, return_tensors="pt").to(device)


def _timed_generate(model, tokenizer, enc, max_new_tokens: int, kwargs: dict, seed: int
                    ) -> tuple[str, int, float]:
    """An untimed warm-up generate of a few tokens, then the timed one (same seed for sampling)."""
    import torch

    _generate(model, tokenizer, enc, min(WARMUP_TOKENS, max_new_tokens), kwargs)
    torch.manual_seed(seed)
    return _generate(model, tokenizer, enc, max_new_tokens, kwargs)


def _generate(model, tokenizer, enc, max_new_tokens: int, kwargs: dict) -> tuple[str, int, float]:
    """(new text, new tokens, seconds) of one `generate` call."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad, **kwargs)
    seconds = max(time.perf_counter() - start, 1e-9)
    new = out[0, enc["input_ids"].shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True).strip(), int(new.numel()), seconds


def cmd_eval(args) -> int:
    from .evaluate import bundled_text, evaluate, expand_schemes, plot_schemes
    from .output import dumps, eval_envelope, format_eval
    from ..hf.models import resolve_model

    keys = expand_schemes([args.scheme])
    for key in keys:                                 # e.g. block with --fast-accum fails before anything is read
        flag_config(args, key)
    device = _device(args.device)
    if args.text is None:
        name, text = bundled_text()
    else:
        path = Path(args.text)
        try:
            name, text = path.name, path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --text {path}: {e}; pass a UTF-8 text file") from None
    if args.max_tokens is not None and args.max_tokens != 0 and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2 (or 0 for the whole text), got {args.max_tokens}")
    max_tokens = args.max_tokens or None
    model_dir = resolve_model(args.model, progress=_progress())
    print(f"fp8now eval: {name}, " + (f"its first {max_tokens} tokens (--max-tokens 0: all of it)"
                                       if max_tokens else "all of it"), file=sys.stderr)
    results = evaluate(model_dir, keys, text, max_tokens=max_tokens, seq_len=args.seq_len,
                       device=device, batch_size=args.batch_size, text_name=name, progress=_progress(),
                       fast_accum=args.fast_accum, **layer_options(args))
    if args.plot:
        results["plot"] = str(plot_schemes(results, args.plot))
    if args.json:
        options = {k: getattr(args, k) for k in ("scheme", "text", "max_tokens", "seq_len", "batch_size",
                                                  "fast_accum", "fp8_head", "fp8_embedding", "keep_bf16")}
        print(dumps(eval_envelope(results, options)))
        return 0
    print(format_eval(results, layers=args.layers))
    if args.plot:
        print(f"\nKL and top-1 plot: {results['plot']}")
    return 0


def cmd_quantize(args) -> int:
    from .quantize_cmd import quantize_command

    return quantize_command(args, _device(args.device), _progress())


def cmd_bench(args) -> int:
    from .bench_cli import bench_command

    return bench_command(args, _device(args.device))


if __name__ == "__main__":
    raise SystemExit(main())

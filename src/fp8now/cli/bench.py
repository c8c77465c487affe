"""Whole-model speed and accuracy of one checkpoint folder under several implementations, one model on
the device at a time, every implementation measured by the same code:

- load: wall time from the folder to a ready model, peak device memory, resident weight bytes;
- accuracy: KL(bf16 || impl) (float64 softmax) and top-1 agreement of next-token distributions on a fixed
  prompt set, against bf16 logits computed once;
- prefill: tokens/s of a forward over B x T tokens (no cache, logits of the last position only);
- decode: tokens/s of one step of B sequences with `context` tokens in a transformers StaticCache,
  the step captured in a CUDA graph (or compiled, or eager), with an explicit causal mask over the cache.

Rows: model, impl, phase, batch, seq, tokens_per_s, seconds, peak_gb (None on the CPU), and per phase
resident_gb (load), kl / top1 / tokens (accuracy), rel_to_eager (decode: the timed step's logits
against an eager step's); a failed measurement is a row with `error`.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Callable

import torch
import transformers
from torch import nn

from .bench_args import Options
from .bench_decode import captured, decode_step, random_ids
from .bench_load import Loader, bf16_loader, read_through, resident_bytes

GB = 1e9
# Accuracy prompts for models with a tokenizer (the embedded SmolLM2): plain sentences of several kinds.
SENTENCES = (
    "The river rose overnight, and by morning the lower fields were under a foot of brown water.",
    "To compile the project, install a C compiler, run the configure script, and then type make.",
    "She counted the coins twice, wrote the total in the ledger, and locked the drawer before leaving.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the leaf.",
    "If the train leaves at nine and the trip takes three hours, we will arrive shortly after noon.",
    "The committee postponed its vote because two members were travelling and could not attend.",
)
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def free(device: torch.device) -> None:
    """Drop what the last model left behind (call after deleting it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls after one untimed call: CUDA events around each call
    on the GPU (a host-bound call shows as such), wall time on the CPU."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def prompt_set(folder: Path, vocab: int, opts: Options) -> list[torch.Tensor]:
    """Token ids [T] per prompt: SENTENCES through the folder's tokenizer when it has one, else seeded
    random ids (opts.prompts = count, tokens)."""
    from ..hf.tokenizer import has_tokenizer, load_tokenizer

    if has_tokenizer(folder):
        tok = load_tokenizer(folder)
        return [torch.tensor(tok(s, add_special_tokens=False)["input_ids"]) for s in SENTENCES]
    count, tokens = opts.prompts
    return list(random_ids((count, tokens), vocab, opts.seed + 1, torch.device("cpu")))


@torch.inference_mode()
def logits_of(model: nn.Module, prompts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Next-token logits [T, V] of every position of every prompt (one prompt per forward), on the host."""
    return [model(input_ids=p[None].to(device), use_cache=False).logits[0].cpu() for p in prompts]


def agreement(ref: list[torch.Tensor], got: list[torch.Tensor], device: torch.device) -> dict:
    """Mean KL(ref || got) per position with float64 softmax, top-1 agreement, positions compared."""
    kl, same, n = 0.0, 0, 0
    for r, g in zip(ref, got):
        lr = torch.log_softmax(r.to(device).double(), dim=-1)
        lg = torch.log_softmax(g.to(device).double(), dim=-1)
        kl += float((lr.exp() * (lr - lg)).sum())
        same += int((lr.argmax(-1) == lg.argmax(-1)).sum())
        n += r.shape[0]
    return {"kl": kl / n, "top1": same / n, "tokens": n}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64 over all elements."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def decode_mode(opts: Options, device: torch.device) -> str:
    """How decode steps run: as asked, else replayed from a CUDA graph on CUDA and eager on the CPU."""
    return opts.decode_mode or ("graph" if device.type == "cuda" else "eager")


def _cases(opts: Options, model: nn.Module, ref: list | None, prompts: list, vocab: int, device: torch.device,
           profile: Callable[[Callable[[], object]], dict] | None):
    """(phase, batch, seq, measure() -> row fields) of every measurement after the load, in order;
    `profile(call)` adds its fields to the prefill and decode rows (e.g. GPU time per kernel)."""
    mode = decode_mode(opts, device)

    def accuracy():
        t0 = time.perf_counter()
        got = logits_of(model, prompts, device)
        return {"seconds": time.perf_counter() - t0, **agreement(ref, got, device)}

    def prefill(b, t):
        ids = random_ids((b, t), vocab, opts.seed + b * 10007 + t, device)
        with torch.inference_mode():
            call = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
            s = median_seconds(call, device, opts.reps)
            return {"tokens_per_s": b * t / s, "seconds": s, **(profile(call) if profile else {})}

    def decode(b):
        step = decode_step(model, b, opts.context, vocab, opts.seed + b, device)
        eager = step().clone()
        timed = captured(step, mode, device)
        check = rel(timed(), eager)
        s = median_seconds(timed, device, 4 * opts.reps)   # steps are short: more of them
        return {"tokens_per_s": b / s, "seconds": s, "mode": mode, "rel_to_eager": check,
                **(profile(timed) if profile else {})}

    if "accuracy" in opts.phases and ref is not None:
        yield "accuracy", len(prompts), max(len(p) for p in prompts), accuracy
    if "prefill" in opts.phases:
        for b, t in opts.prefill:
            yield "prefill", b, t, lambda b=b, t=t: prefill(b, t)
    if "decode" in opts.phases:
        for b in opts.decode:
            yield "decode", b, opts.context, lambda b=b: decode(b)


def measure(model_name: str, folder: Path, impls: dict[str, Loader], device: torch.device, opts: Options,
            emit: Callable[[dict], None], log: Callable[[str], None] = lambda s: None,
            reference: list[torch.Tensor] | None = None,
            profile: Callable[[Callable[[], object]], dict] | None = None,
            alone: Callable[[str, bool], list[dict]] | None = None) -> dict:
    """Measure every implementation in turn (bf16 first if present); `emit` gets each row as it is made.
    `reference`: bf16 logits of `prompt_set` from an earlier run, else bf16 is loaded to make them when
    an accuracy row needs them; `profile`: see _cases; `alone(impl, reload)`: the load (and reload) rows of
    `impl` measured alone in a fresh process (bench_alone), else the load row is the in-process load's.
    Returns {"reports": {impl: LoadReport}, "reference": bf16 logits}."""
    from ..hf.skeleton import read_config

    vocab = read_config(folder).get_text_config().vocab_size
    prompts = prompt_set(folder, vocab, opts) if "accuracy" in opts.phases else []
    reports: dict = {}
    log(f"read {read_through(folder) / GB:.1f} GB of checkpoint files into the page cache")
    later = [p for p in opts.phases if p not in ("load", "reload")]
    for name in sorted(impls, key=lambda n: n != "bf16"):
        loader = impls[name]
        # transformers' version with every row: its attention path (e.g. the decode step's GQA copy) differs by version
        base = {"model": model_name, "impl": name, "transformers": transformers.__version__}
        if alone is not None and ("load" in opts.phases or "reload" in opts.phases):
            log(f"{name}: load alone in a fresh process")
            for row in alone(name, "reload" in opts.phases and name.startswith("fp8now")):
                if row["phase"] in opts.phases:
                    emit({**base, "batch": None, "seq": None, "tokens_per_s": None, **row})
            if not later:
                continue
        if prompts and reference is None and name != "bf16":
            log(f"bf16 reference logits of {len(prompts)} prompts")
            model = bf16_loader(folder, device)[0]
            reference = logits_of(model, prompts, device)
            del model
            free(device)
        log(f"{name}: load")
        free(device)
        try:
            if hasattr(loader, "warm"):
                loader.warm(folder, device)
            free(device)
            reset_peak(device)
            t0 = time.perf_counter()
            model, reports[name] = loader(folder, device)
            sync(device)
            seconds = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a failed load is a result; the other impls still run
            emit({**base, "phase": "load", "batch": None, "seq": None, "error": f"{type(e).__name__}: {e}"[:400]})
            free(device)
            continue
        if "load" in opts.phases and alone is None:
            emit({**base, "phase": "load", "batch": None, "seq": None, "tokens_per_s": None, "seconds": seconds,
                  "peak_gb": peak_gb(device), "resident_gb": resident_bytes(model) / GB})
        if name == "bf16" and prompts:
            reference = logits_of(model, prompts, device)
        for phase, batch, seq, run in _cases(opts, model, None if name == "bf16" else reference, prompts,
                                             vocab, device, profile):
            log(f"{name}: {phase} B={batch} T={seq}")
            free(device)
            reset_peak(device)
            row = {**base, "phase": phase, "batch": batch, "seq": seq, "tokens_per_s": None}
            try:
                row.update(run())
                row["peak_gb"] = peak_gb(device)
            except Exception as e:  # noqa: BLE001 - e.g. a step that cannot be captured: say why
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            emit(row)
        run = None   # the last case's closure holds the model
        del model
        torch._dynamo.reset()   # a compiled peer's graphs and guards go with its model
        free(device)
    return {"reports": reports, "reference": reference}


def _cell(phase: str, r: dict, b: dict | None) -> str:
    """One implementation's figure against bf16's row `b` of the same case (its own figure without one)."""
    if "error" in r:
        return "failed"
    if phase == "accuracy":
        return f"KL {r['kl']:.4g}, top-1 {r['top1']:.3f}"
    if phase in ("load", "load cold"):
        if b is None or b is r:
            return f"{r['seconds']:.1f} s, {r['resident_gb']:.2f} GB"
        return f"{r['seconds'] / b['seconds']:.2f}x time, {r['resident_gb'] / b['resident_gb']:.2f}x bytes"
    if phase == "reload":   # against a device copy of the same bytes
        return f"{r['seconds']:.3f} s, {r['ratio_to_copy']:.1f}x copy"
    if b is None or b is r:
        return f"{r['tokens_per_s']:,.0f} tok/s"
    return f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x"


def ratio_table(rows: list[dict]) -> str:
    """Per model and case: bf16's own figure, every other implementation against it (speed-ups in tokens/s;
    load time and resident bytes as multiples of bf16's; KL and top-1 against bf16), then the failures."""
    from .output import table

    impls = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] != "bf16"))
    case = lambda r: (r["model"], r["phase"] + " cold" * bool(r.get("cold")), r.get("mode"),  # noqa: E731
                      r["batch"], r["seq"])
    cases = list(dict.fromkeys(case(r) for r in rows))
    by = {(*case(r), r["impl"]): r for r in rows}
    lines = []
    for key in cases:
        model, phase, mode, batch, seq = key
        base = by.get((*key, "bf16"))
        base_ok = base if base is not None and "error" not in base else None
        cells = [_cell(phase, r, base_ok) if (r := by.get((*key, i))) else "-" for i in ("bf16", *impls)]
        shape = "" if batch is None else f"{batch} x {seq}"
        lines.append((model, phase if mode is None else f"{phase} ({mode})", shape, *cells))
    out = table(("model", "phase", "B x T", "bf16", *impls), lines, right_from=3)
    out += [f"failed: {r['model']} {r['impl']} {r['phase']} B={r['batch']}: {r['error'][:200]}"
            for r in rows if "error" in r]
    return "\n".join(out)

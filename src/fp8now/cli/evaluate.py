"""How much FP8 changes a model: perplexity, KL(bf16 || fp8), top-1 agreement, per-layer weight error.

The text is tokenized once and cut into non-overlapping windows of `seq_len` tokens (the last, shorter
window is kept when it has at least 2 tokens); inside a window every token is predicted from the ones
before it, so a window of L tokens gives L - 1 predictions.

Memory choice: KL needs the whole bf16 distribution at every position, which for the bundled text is
29k x 49k float32 = 5.7 GB, too much to cache. Instead every requested FP8 model stays loaded next to
the bf16 one and the loop runs window by window: the bf16 model runs once per window, each FP8 model
runs on the same window, and only per-token values (NLL, KL, agreement) are kept. That costs one extra FP8 copy of the model
per scheme (about half the bf16 size each), which is small for the embedded 135M model; for large
models evaluate one scheme at a time. FP8 models are loaded before the bf16 one so that the first
load report's peak memory is not inflated by the reference model (later ones say what was held).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from ..config import Fp8Config, scheme_key
from ..hf.bf16 import load_bf16  # noqa: F401  (public here too)
from ..kl_stats import summarize
from .plot import plot_schemes  # noqa: F401  (public here too)

# `--scheme all`: the three schemes, plus per-tensor weights with per-tensor activations, the
# configuration users usually compare against.
ALL_SCHEMES = ("channel", "block", "tensor", "tensor-tensor")
BUNDLED_TEXT = "licenses.txt"


def scheme_config(name: str, fast_accum: bool = False, head: bool = False, embedding: bool = False,
                  weight_numerics: str = "spec", keep_bf16: str | None = None) -> tuple[str, Fp8Config]:
    """(fp8now's name, config) for any scheme name config.py accepts, e.g. `ptpc` -> `channel`."""
    config = Fp8Config(scheme=name, fast_accum=fast_accum, head=head, embedding=embedding,
                       weight_numerics=weight_numerics, keep_bf16=keep_bf16)
    return scheme_key(config.scheme, config.act_kind()), config


def expand_schemes(names: Sequence[str]) -> list[str]:
    """Canonical scheme keys in order, without repeats; `all` expands to ALL_SCHEMES."""
    keys: list[str] = []
    for name in names:
        try:
            expanded = ALL_SCHEMES if str(name).strip().lower() == "all" else (scheme_config(name)[0],)
        except ValueError as e:
            raise ValueError(f"{e} (eval also takes all: {', '.join(ALL_SCHEMES)})") from None
        keys += [k for k in expanded if k not in keys]
    if not keys:
        raise ValueError(f"no scheme given; choose one of {', '.join(ALL_SCHEMES)} or all")
    return keys


def bundled_text() -> tuple[str, str]:
    """(name, text) of the evaluation text shipped with fp8now (licence texts, see data/README.md)."""
    return BUNDLED_TEXT, resources.files("fp8now").joinpath("data", BUNDLED_TEXT).read_text("utf-8")


def windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping windows `[L]` of a token row `[T]`; a final window shorter than 2 is dropped."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    return [w for w in ids.split(seq_len) if w.numel() >= 2]


def batches(wins: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Stacks `[B, L]` of equal-length windows (the short last window forms its own batch)."""
    i = 0
    while i < len(wins):
        j = i
        while j < len(wins) and j - i < batch_size and wins[j].numel() == wins[i].numel():
            j += 1
        yield torch.stack(wins[i:j])
        i = j


@dataclass
class _Tokens:
    """Per-token values of one model, one tensor per batch (float64 NLL and KL, bool agreement)."""

    nll: list[torch.Tensor] = field(default_factory=list)
    kl: list[torch.Tensor] = field(default_factory=list)
    same_top: list[torch.Tensor] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Comparison:
    """Per-token values of `compare_models`: reference NLL and, per model, NLL, KL and top-1 agreement."""

    predicted: int = 0
    ref_nll: list[torch.Tensor] = field(default_factory=list)
    ref_seconds: float = 0.0
    tokens: dict[str, _Tokens] = field(default_factory=dict)

    def metrics(self, key: str) -> dict[str, float]:
        """llama.cpp's KL statistics (see kl_stats.summarize: ppl_*, kl*, top1*, with standard errors)
        plus eval_s, the seconds spent in this model's forwards."""
        t = self.tokens[key]
        stats = summarize(torch.cat(self.ref_nll), torch.cat(t.nll), torch.cat(t.kl), torch.cat(t.same_top))
        return {**stats, "eval_s": t.seconds}


def _log_probs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax of the next-token logits at every position but the last: [B, L-1, V]."""
    logits = model(input_ids=x, use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def compare_models(ref: nn.Module, models: dict[str, nn.Module], wins: list[torch.Tensor],
                   batch_size: int = 4, device: torch.device | str = "cpu", progress: bool = True
                   ) -> Comparison:
    """Run `ref` once per batch of windows and every model in `models` on the same batch; keep per
    token the NLL of the true next token, KL(ref || model) over the vocabulary and argmax agreement."""
    from tqdm.auto import tqdm

    out = Comparison(tokens={k: _Tokens() for k in models})
    bar = tqdm(total=sum(w.numel() for w in wins), desc="fp8now eval", unit="tok", disable=not progress,
               leave=False)
    with bar:
        for x in batches(wins, batch_size):
            x = x.to(device)
            target = x[:, 1:, None]                                  # [B, L-1, 1]
            t0 = time.perf_counter()
            lp_ref = _log_probs(ref, x)                              # [B, L-1, V]
            p_ref = lp_ref.exp()
            top_ref = lp_ref.argmax(-1)                              # [B, L-1]
            out.ref_nll.append(-lp_ref.gather(-1, target).double().flatten().cpu())
            out.ref_seconds += time.perf_counter() - t0
            out.predicted += target.numel()
            for key, model in models.items():
                t0 = time.perf_counter()
                lp = _log_probs(model, x)
                t = out.tokens[key]
                t.nll.append(-lp.gather(-1, target).double().flatten().cpu())
                t.kl.append((p_ref * (lp_ref - lp)).sum(-1, dtype=torch.float64).flatten().cpu())
                t.same_top.append((lp.argmax(-1) == top_ref).flatten().cpu())
                t.seconds += time.perf_counter() - t0
                del lp
            bar.update(x.numel())
    return out


def tokenize(model_dir: Path, text: str) -> torch.Tensor:
    """The text as one row of token ids `[T]`, without special tokens."""
    from transformers.utils import logging as hf_logging

    from ..hf.custom_code import CustomCodeError
    from ..hf.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_dir)   # names the missing files; never the folder's own code
    except CustomCodeError:
        raise                                    # already one line saying why and what to do
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir}: no usable tokenizer ({str(e).splitlines()[0]}); evaluation needs "
                         "the checkpoint's tokenizer files (tokenizer.json / tokenizer_config.json)") from None
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "longer than the model's maximum length" note does not apply
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        hf_logging.set_verbosity(level)
    return torch.tensor(ids, dtype=torch.long)


def evaluate(model_dir: str | os.PathLike, schemes: Sequence[str], text: str, *,
             max_tokens: int | None = None, seq_len: int = 512, device: torch.device | str | None = None,
             batch_size: int = 4, progress: bool = True, text_name: str = "text", fast_accum: bool = False,
             head: bool = False, embedding: bool = False, weight_numerics: str = "spec",
             keep_bf16: str | None = None) -> dict:
    """Compare the bf16 model with its FP8 versions on `text`.

    Returns `{"model", "device", "text": {"name", "tokens", "windows", "seq_len", "predicted"},
    "bf16_eval_s", "schemes": {key: {<kl_stats.summarize keys>, "eval_s", "config",
    "layers": [per-layer rows], "load_report": {...}}}}`. `kl` is the mean KL(bf16 || fp8) in nats
    per predicted token, `top1` the fraction of positions where both argmaxes agree, each with `_se`.
    `load_report` is `LoadReport.to_dict()` without its `layers` (they are under `layers`).
    Scheme keys: "channel", "block", "tensor", "tensor-tensor" (any name config.py accepts, and "all").
    `fast_accum`, `head`, `embedding`, `weight_numerics`, `keep_bf16`: every FP8 model with those Fp8Config fields.
    """
    from tqdm.auto import tqdm

    from ..hf.tokenizer import check_token_ids
    from ..loading.load import resolve_device
    from ..sensitivity.keep import load

    model_dir = Path(model_dir)
    keys = expand_schemes(schemes)
    configs = {k: scheme_config(k, fast_accum, head, embedding, weight_numerics, keep_bf16)[1] for k in keys}
    device = resolve_device(device)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    ids = tokenize(model_dir, text)
    check_token_ids(ids, model_dir)   # a tokenizer of another model fails here, before any weight is read
    total_tokens = ids.numel()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    wins = windows(ids, seq_len)
    if not wins:
        raise ValueError(f"the text {text_name!r} has {ids.numel()} token(s) after --max-tokens; "
                         "evaluation needs at least 2")
    models: dict[str, nn.Module] = {}
    reports = {}
    with tqdm(total=len(keys) + 1, desc="fp8now eval: loading", unit="model", disable=not progress,
              leave=False) as bar:
        for key in keys:
            bar.set_postfix_str(f"fp8 {key}")
            models[key], reports[key] = load(model_dir, configs[key], device=device)
            bar.update()
        bar.set_postfix_str("bf16 reference")
        ref = load_bf16(model_dir, device)
        bar.update()
    comparison = compare_models(ref, models, wins, batch_size, device, progress)
    results: dict = {
        "model": str(model_dir), "device": str(device),
        "text": {"name": text_name, "tokens": int(ids.numel()), "tokens_in_text": int(total_tokens),
                 "windows": len(wins), "seq_len": seq_len, "predicted": comparison.predicted},
        "bf16_eval_s": comparison.ref_seconds, "schemes": {},
    }
    for key in keys:
        report = reports[key].to_dict()
        layers = report.pop("layers")
        results["schemes"][key] = {**comparison.metrics(key), "config": config_dict(configs[key]),
                                   "layers": layers, "load_report": report}
    return results


def config_dict(config: Fp8Config) -> dict:
    """The parts of a config that say what ran (the JSON output's "config")."""
    return {"scheme": config.scheme.value, "activation": config.act_kind(), "backend": config.backend,
            "fast_accum": config.fast_accum, "head": config.head, "embedding": config.embedding,
            "weight_numerics": config.weight_numerics, "keep_bf16": config.keep_bf16}

"""How much FP8 changes a model: perplexity, KL(bf16 || fp8), top-1 agreement, per-layer weight error.

The text is tokenized once and cut into non-overlapping windows of `seq_len` tokens (the last, shorter
window is kept when it has at least 2 tokens); inside a window every token is predicted from the ones
before it, so a window of L tokens gives L - 1 predictions.

Memory choice: KL needs the whole bf16 distribution at every position, which for the bundled text is
29k x 49k float32 = 5.7 GB, too much to cache. Instead every requested FP8 model stays loaded next to
the bf16 one and the loop runs window by window: the bf16 model runs once per window, each FP8 model
runs on the same window, and only running sums are kept. That costs one extra FP8 copy of the model
per scheme (about half the bf16 size each), which is small for the embedded 135M model; for large
models evaluate one scheme at a time. FP8 models are loaded before the bf16 one so that the first
load report's peak memory is not inflated by the reference model (later ones say what was held).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from .config import Fp8Config, Scheme
from .models import _umask

# `--scheme all`: the three schemes, plus per-tensor weights with per-tensor activations, the
# configuration users usually compare against.
ALL_SCHEMES = ("channel", "block", "tensor", "tensor-pt")
EXTRA_SCHEMES = {"tensor-pt": dict(scheme=Scheme.TENSOR, activation="tensor")}
BUNDLED_TEXT = "licenses.txt"


def scheme_config(name: str) -> tuple[str, Fp8Config]:
    """(canonical key, config) for a scheme name or alias; `tensor-pt` is tensor with per-tensor act."""
    key = str(name).strip().lower().replace("_", "-")
    if key in EXTRA_SCHEMES:
        return key, Fp8Config(**EXTRA_SCHEMES[key])
    try:
        scheme = Scheme.parse(key)
    except ValueError as e:
        raise ValueError(f"{e}, {', '.join(EXTRA_SCHEMES)} (and `all` for eval)") from None
    return scheme.value, Fp8Config(scheme=scheme)


def expand_schemes(names: Sequence[str]) -> list[str]:
    """Canonical scheme keys in order, without repeats; `all` expands to ALL_SCHEMES."""
    keys: list[str] = []
    for name in names:
        expanded = ALL_SCHEMES if str(name).strip().lower() == "all" else (scheme_config(name)[0],)
        keys += [k for k in expanded if k not in keys]
    if not keys:
        raise ValueError("no scheme given; choose one of channel, block, tensor, tensor-pt or all")
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
class _Sums:
    """Running totals for one model against the reference."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    seconds: float = 0.0


@dataclass
class Comparison:
    """Totals of `compare_models`: reference NLL and, per model, NLL, KL and top-1 agreement."""

    predicted: int = 0
    ref_nll: float = 0.0
    ref_seconds: float = 0.0
    sums: dict[str, _Sums] = field(default_factory=dict)

    def metrics(self, key: str) -> dict[str, float]:
        """ppl_bf16, ppl_fp8, ppl_delta_pct, kl (mean per predicted token, nats), top1 (fraction)."""
        s, n = self.sums[key], max(self.predicted, 1)
        ppl_ref, ppl = math.exp(self.ref_nll / n), math.exp(s.nll / n)
        return {"ppl_bf16": ppl_ref, "ppl_fp8": ppl, "ppl_delta_pct": 100.0 * (ppl / ppl_ref - 1.0),
                "kl": s.kl / n, "top1": s.agree / n, "eval_s": s.seconds}


def _log_probs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax of the next-token logits at every position but the last: [B, L-1, V]."""
    logits = model(input_ids=x, use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def compare_models(ref: nn.Module, models: dict[str, nn.Module], wins: list[torch.Tensor],
                   batch_size: int = 4, device: torch.device | str = "cpu", progress: bool = True
                   ) -> Comparison:
    """Run `ref` once per batch of windows and every model in `models` on the same batch; sum
    NLL (of the true next token), KL(ref || model) over the vocabulary, and argmax agreement."""
    from tqdm.auto import tqdm

    out = Comparison(sums={k: _Sums() for k in models})
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
            out.ref_nll -= float(lp_ref.gather(-1, target).sum(dtype=torch.float64))
            out.ref_seconds += time.perf_counter() - t0
            out.predicted += target.numel()
            for key, model in models.items():
                t0 = time.perf_counter()
                lp = _log_probs(model, x)
                s = out.sums[key]
                s.nll -= float(lp.gather(-1, target).sum(dtype=torch.float64))
                s.kl += float((p_ref * (lp_ref - lp)).sum(dtype=torch.float64))
                s.agree += int((lp.argmax(-1) == top_ref).sum())
                s.seconds += time.perf_counter() - t0
                del lp
            bar.update(x.numel())
    return out


def tokenize(model_dir: Path, text: str) -> torch.Tensor:
    """The text as one row of token ids `[T]`, without special tokens."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
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


def load_bf16(model_dir: Path, device: torch.device) -> nn.Module:
    """The unquantized reference: plain transformers in bf16, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def evaluate(model_dir: str | os.PathLike, schemes: Sequence[str], text: str, *,
             max_tokens: int | None = None, seq_len: int = 512, device: torch.device | str | None = None,
             batch_size: int = 4, progress: bool = True, text_name: str = "text") -> dict:
    """Compare the bf16 model with its FP8 versions on `text`.

    Returns `{"model", "device", "text": {"name", "tokens", "windows", "seq_len", "predicted"},
    "bf16_eval_s", "schemes": {key: {"ppl_bf16", "ppl_fp8", "ppl_delta_pct", "kl", "top1",
    "eval_s", "layers": [per-layer rows], "load_report": {...}}}}`. `kl` is the mean KL(bf16 || fp8)
    in nats per predicted token; `top1` the fraction of positions where both argmaxes agree.
    `load_report` is `LoadReport.to_dict()` without its `layers` (they are under `layers`).
    Scheme keys: "channel", "block", "tensor", "tensor-pt" (aliases and "all" accepted).
    """
    from tqdm.auto import tqdm

    from .loader import load, resolve_device

    model_dir = Path(model_dir)
    keys = expand_schemes(schemes)
    configs = {k: scheme_config(k)[1] for k in keys}
    device = resolve_device(device)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    ids = tokenize(model_dir, text)
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
        results["schemes"][key] = {**comparison.metrics(key), "config": _config_dict(configs[key]),
                                   "layers": layers, "load_report": report}
    return results


def _config_dict(config: Fp8Config) -> dict:
    return {"scheme": config.scheme.value, "activation": config.act_kind(), "backend": config.backend}


def plot_layer_errors(results: dict, path: str | os.PathLike) -> Path:
    """A PNG of per-layer weight SQNR (dB) per scheme, written to a temporary file then renamed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: run `pip install matplotlib`") from None
    path = Path(path)
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg rendering without pyplot's global state
    ax = fig.add_subplot()
    names: list[str] = []
    for i, (key, res) in enumerate(results["schemes"].items()):
        rows = res["layers"]
        names = names or [r["name"] for r in rows]
        y = [math.nan if r["sqnr_db"] is None else r["sqnr_db"] for r in rows]
        style = ("-", "--", "-.", ":")[i % 4]  # tensor and tensor-pt share weights: keep both visible
        ax.plot(range(len(rows)), y, linestyle=style, marker=".", linewidth=0.8, markersize=3,
                label=f"{key} (KL {res['kl']:.2e}, top-1 {100 * res['top1']:.1f}%)")
    _block_ticks(ax, names)
    ax.set_ylabel("weight SQNR (dB, higher is better)")
    ax.set_title(f"FP8 weight error per layer: {Path(results.get('model', '')).name or 'model'}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it private; a plot is an ordinary file
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _block_ticks(ax, names: list[str]) -> None:
    """X ticks at the first layer of each transformer block (labelled with the block number)."""
    ticks, labels, last = [], [], None
    for i, name in enumerate(names):
        block = next((p for p in name.split(".") if p.isdigit()), None)
        if block != last:
            ticks.append(i)
            labels.append(block or name)
            last = block
    step = max(1, len(ticks) // 30)
    ax.set_xticks(ticks[::step], labels[::step], fontsize=7)
    ax.set_xlabel("transformer block (each point is one quantized linear, in model order)")

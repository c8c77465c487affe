"""llama.cpp's KL-divergence statistics from per-token values: PPL ratio, KL percentiles, top-1 agreement.

The same quantities `llama-perplexity --kl-divergence` prints, computed the same way:
- a mean's standard error is sqrt(population variance / (n - 1));
- ln(PPL(fp8)/PPL(bf16)) is the mean per-token NLL difference, so its standard error is the difference's
  (llama.cpp writes it as var(a) + var(b) - 2 cov(a, b), the same number); PPL and the ratio carry
  exp(mean) * SE, the first-order propagation;
- percentiles interpolate linearly between sorted values at fraction * (n - 1);
- top-1 agreement's standard error is sqrt(p (1 - p) / (n - 1)).
Unlike llama.cpp, every predicted token of a window is scored, not only its second half.
"""

from __future__ import annotations

import math

import torch

KL_PERCENTILES = {"kl_p99": 0.99, "kl_p999": 0.999}


def mean_and_se(x: torch.Tensor) -> tuple[float, float]:
    """(mean, standard error of the mean) of a 1-D tensor, in float64; the error is 0 for n < 2."""
    x = x.double()
    n = x.numel()
    mean = float(x.mean())
    if n < 2:
        return mean, 0.0
    var = float((x * x).mean()) - mean * mean  # population variance, as llama.cpp
    return mean, math.sqrt(max(var, 0.0) / (n - 1))


def percentile(sorted_x: torch.Tensor, fraction: float) -> float:
    """Linear interpolation between sorted values at `fraction * (n - 1)`."""
    pos = fraction * (sorted_x.numel() - 1)
    lo = min(int(pos), sorted_x.numel() - 1)
    hi = min(lo + 1, sorted_x.numel() - 1)
    w = pos - lo
    return float(sorted_x[lo]) * (1.0 - w) + float(sorted_x[hi]) * w


def summarize(nll_ref: torch.Tensor, nll: torch.Tensor, kl: torch.Tensor, same_top: torch.Tensor) -> dict:
    """The statistics of one model against the reference from per-token values, each `[n]`.

    nll_ref / nll: negative log-likelihood of the true next token (nats) under the reference / the model;
    kl: KL(ref || model) over the vocabulary at each position; same_top: both argmaxes agree.
    """
    n = nll.numel()
    if n == 0 or not (nll_ref.numel() == kl.numel() == same_top.numel() == n):
        raise ValueError(f"per-token values must be non-empty and of one length, got {nll_ref.numel()}, "
                         f"{n}, {kl.numel()}, {same_top.numel()}")
    ln_ref, ln_ref_se = mean_and_se(nll_ref)
    ln_q, ln_q_se = mean_and_se(nll)
    ln_ratio, ln_ratio_se = mean_and_se(nll.double() - nll_ref.double())
    ppl_ref, ppl_q, ratio = math.exp(ln_ref), math.exp(ln_q), math.exp(ln_ratio)
    kl_mean, kl_se = mean_and_se(kl)
    kl_sorted = kl.double().sort().values
    top1 = float(same_top.double().mean())
    top1_se = math.sqrt(top1 * (1.0 - top1) / (n - 1)) if n > 1 else 0.0
    return {
        "ppl_bf16": ppl_ref, "ppl_bf16_se": ppl_ref * ln_ref_se,
        "ppl_fp8": ppl_q, "ppl_fp8_se": ppl_q * ln_q_se,
        "ln_ppl_ratio": ln_ratio, "ln_ppl_ratio_se": ln_ratio_se,
        "ppl_ratio": ratio, "ppl_ratio_se": ratio * ln_ratio_se,
        "ppl_delta_pct": 100.0 * (ratio - 1.0),
        "kl": kl_mean, "kl_se": kl_se, "kl_median": percentile(kl_sorted, 0.5),
        **{key: percentile(kl_sorted, f) for key, f in KL_PERCENTILES.items()},
        "kl_max": float(kl_sorted[-1]),
        "top1": top1, "top1_se": top1_se, "predicted": n,
    }

"""kl_stats: llama.cpp's KL-divergence statistics against numpy on fresh random logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8now.kl_stats import summarize


def _per_token(n: int, vocab: int, noise: float, seed: int):
    """Per-token values of a reference and a perturbed model, computed with numpy in float64."""
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 3, (n, vocab))
    b = a + rng.normal(0, noise, (n, vocab))
    y = rng.integers(0, vocab, n)
    la = a - np.log(np.exp(a - a.max(1, keepdims=True)).sum(1, keepdims=True)) - a.max(1, keepdims=True)
    lb = b - np.log(np.exp(b - b.max(1, keepdims=True)).sum(1, keepdims=True)) - b.max(1, keepdims=True)
    nll_a, nll_b = -la[np.arange(n), y], -lb[np.arange(n), y]
    kl = (np.exp(la) * (la - lb)).sum(1)
    same = a.argmax(1) == b.argmax(1)
    return nll_a, nll_b, kl, same


def _llama_cpp_style(nll_a, nll_b, kl, same) -> dict:
    """The statistics as llama.cpp's perplexity tool forms them: running sums, sums of squares, covariance."""
    n = len(kl)

    def mean_unc(s, s2):
        f = s / n
        return f, math.sqrt((s2 / n - f * f) / (n - 1))

    ln_q, ln_q_unc = mean_unc(nll_b.sum(), (nll_b ** 2).sum())
    ln_b, ln_b_unc = mean_unc(nll_a.sum(), (nll_a ** 2).sum())
    cov = ((nll_a * nll_b).sum() / n - ln_q * ln_b) / (n - 1)
    ratio_unc = math.sqrt(ln_q_unc ** 2 + ln_b_unc ** 2 - 2 * cov)
    kl_mean, kl_unc = mean_unc(kl.sum(), (kl ** 2).sum())
    p = same.mean()
    return {"ppl_fp8": math.exp(ln_q), "ppl_fp8_se": math.exp(ln_q) * ln_q_unc,
            "ppl_bf16": math.exp(ln_b), "ppl_bf16_se": math.exp(ln_b) * ln_b_unc,
            "ln_ppl_ratio": ln_q - ln_b, "ln_ppl_ratio_se": ratio_unc,
            "ppl_ratio": math.exp(ln_q - ln_b), "ppl_ratio_se": math.exp(ln_q - ln_b) * ratio_unc,
            "kl": kl_mean, "kl_se": kl_unc, "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_p999": float(np.percentile(kl, 99.9)),
            "kl_max": float(kl.max()), "top1": float(p), "top1_se": math.sqrt(p * (1 - p) / (n - 1))}


@pytest.mark.parametrize("n,vocab,noise,seed", [(1000, 50, 0.3, 1), (2001, 17, 1.5, 2), (150, 300, 0.05, 3)])
def test_statistics_equal_numpy_on_random_logits(n, vocab, noise, seed):
    nll_a, nll_b, kl, same = _per_token(n, vocab, noise, seed)
    assert 0 < same.mean() < 1  # both branches of the agreement count are exercised
    got = summarize(torch.from_numpy(nll_a), torch.from_numpy(nll_b), torch.from_numpy(kl),
                    torch.from_numpy(same))
    want = _llama_cpp_style(nll_a, nll_b, kl, same)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert got["predicted"] == n
    assert got["ppl_delta_pct"] == pytest.approx(100 * (want["ppl_ratio"] - 1), rel=1e-9)


def test_standard_errors_shrink_like_one_over_root_n():
    small = summarize(*(torch.from_numpy(v) for v in _per_token(400, 40, 0.5, 7)))
    large = summarize(*(torch.from_numpy(v) for v in _per_token(6400, 40, 0.5, 7)))
    for key in ("kl_se", "top1_se", "ln_ppl_ratio_se"):
        assert 2.5 < small[key] / large[key] < 6.5, key  # sqrt(16) = 4, within sampling spread


def test_identical_models_and_bad_lengths():
    nll = torch.rand(50, dtype=torch.float64)
    same = summarize(nll, nll, torch.zeros(50), torch.ones(50, dtype=torch.bool))
    assert same["kl"] == same["kl_se"] == same["kl_p999"] == 0.0
    assert same["ppl_ratio"] == 1.0 and same["ln_ppl_ratio_se"] == 0.0
    assert same["top1"] == 1.0 and same["top1_se"] == 0.0
    with pytest.raises(ValueError, match="one length"):
        summarize(nll, nll[:-1], torch.zeros(50), torch.ones(50, dtype=torch.bool))

"""The numbers of the sensitivity pass: per-token KL to bf16 and the magnified single-layer error.

Why the single-layer measurement magnifies the error: on the embedded model a layer whose FP8 error is made
ten times smaller still costs about as much KL as the real one (1.1-1.7e-3 nats per token at 1/10 of the
error, 1.2-2.9e-3 at full size, 8 layers tried): any change to one layer moves every later bf16 rounding of
the residual stream, and that costs a KL of its own, about the same for any small change. The layer's own
contribution grows with the square of its error, so magnified 8 times it stands 64 times higher over that
floor, whose share of KL / 64 is then about 2e-5 against 3e-5 - 2e-3 for the layers themselves (with that
share taken off, KL / magnification^2 at 4 and at 8 agree within about 30%: the error still acts nearly
linearly). So `alone` = KL(bf16 + 8 (fp8 - bf16) in this layer only) / 64.

The other end, "every layer in FP8 but this one" (its gain = all-FP8 KL minus that KL), was measured too and
dropped: it meets the same floor without a way to magnify past it. On the embedded model its standard errors
(0.6-2.9e-3 nats per token, tensor scheme) were larger than most layers' costs, its 210 values summed to -0.18
against an all-FP8 KL of 0.03, and weighted with `alone` by inverse variance it changed no choice:
keep_bf16="auto:0.05" kept the same layers with and without it, for each of tensor, channel and block. It
doubled the pass.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kl_stats import mean_and_se


MAGNIFY = 8.0   # the single-layer error's magnification; its KL is divided by MAGNIFY ** 2
CHUNK = 8       # tokens per KL step: 8 float32 rows of a 49k vocabulary take 1.5 MiB, a core's L2 cache


class Magnified(nn.Module):
    """A layer whose output is `bf16(x) + factor * (fp8(x) - bf16(x))`, added in float32: its FP8 error x factor."""

    def __init__(self, bf16: nn.Module, fp8: nn.Module, factor: float = MAGNIFY) -> None:
        super().__init__()
        self.bf16, self.fp8, self.factor = bf16, fp8, factor

    def forward(self, *args, **kwargs) -> torch.Tensor:
        exact = self.bf16(*args, **kwargs)
        error = self.fp8(*args, **kwargs).float() - exact.float()
        return (exact.float() + self.factor * error).to(exact.dtype)


class Reference:
    """The bf16 distribution of the scored tokens, and KL(bf16 || q) of another model's logits per token."""

    def __init__(self, ref_logits: torch.Tensor) -> None:
        self.logits = ref_logits.float()                     # [B, N, V]
        self.p = torch.softmax(self.logits, dim=-1)

    def kl(self, q_logits: torch.Tensor) -> torch.Tensor:
        """Per token log(sum p e^d) - sum p d with d = q - ref logits, float64 `[B * N]`: sum p (log p - log q)
        without the cancellation of two large logsumexps in float32. CHUNK tokens at a time, so that the
        float32 rows being worked on stay in cache (4x faster on the CPU than whole tensors); where e^d
        overflows float32 (a logit moved by more than 88), d is shifted by its maximum first."""
        b, n, v = self.logits.shape
        out = torch.empty(b, n, dtype=torch.float64, device=self.logits.device)
        buf = torch.empty(CHUNK, v, dtype=torch.float32, device=self.logits.device)
        for row in range(b):
            for i in range(0, n, CHUNK):
                j = min(i + CHUNK, n)
                out[row, i:j] = self._chunk(buf[:j - i], q_logits[row, i:j], row, slice(i, j))
        return out.flatten().cpu()

    def _chunk(self, d: torch.Tensor, q: torch.Tensor, row: int, cols: slice) -> torch.Tensor:
        p = self.p[row, cols]
        d.copy_(q)
        d -= self.logits[row, cols]
        mean = torch.linalg.vecdot(p, d)                      # sum p d
        shift = d.amax(-1) if bool(d.max() > 80) else None    # e^d would overflow: shift by the max
        if shift is not None:
            d -= shift[:, None]
        d.exp_()
        out = torch.log(torch.linalg.vecdot(p, d)) - mean
        return out if shift is None else out + shift


def stats(per_token: torch.Tensor, scale: float = 1.0) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-token values, times `scale`: the statistics `fp8now eval`
    reports (kl_stats.mean_and_se, llama.cpp's)."""
    mean, se = mean_and_se(per_token)
    return mean * scale, se * scale

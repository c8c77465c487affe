"""The `reference` backend: exact float64 products of the quantized operands; runs anywhere.

FP8 e4m3 values are multiples of 2^-9 below 2^9, so each product is a multiple of 2^-18 below 2^18
and any sum of fewer than 2^17 of them is exact in float64: the matmul is exact whatever its order.
That makes this backend the test oracle and batch-invariant by construction.
"""

from __future__ import annotations

import torch

from ..config import WEIGHT_GROUP, Scheme
from ..numerics import quantize_activation
from .plan import Path, Weights

_TEMP_BYTES = 64 << 20  # float64 weight temporary per output-row chunk


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """Runs everywhere (slowly on GPUs)."""
    return None


def exact_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                 w_scale: torch.Tensor, scheme: Scheme, temp_bytes: int = _TEMP_BYTES) -> torch.Tensor:
    """float64 `(x_q * x_scale) @ (w_q * w_scale).T` for FP8 operands: [M, K] x [N, K] -> [M, N].

    The weight is widened to float64 `temp_bytes` at a time, in chunks of output rows (for block
    scaling, whole 128-row tiles, so that each chunk starts on a weight-scale row).
    """
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=torch.float64, device=x_q.device)
    step = max(1, temp_bytes // (8 * max(k, 1)))
    if scheme is Scheme.BLOCK and WEIGHT_GROUP[scheme] == (128, 128):
        step = max(128, step - step % 128)
        x64 = x_q.double()
        xs = x_scale.double()                                  # [M, KB]
        for r in range(0, n, step):
            w64 = w_q[r:r + step].double()                     # [n', K]
            ws = w_scale[r // 128: (r + w64.shape[0] + 127) // 128].double()  # [NB', KB]
            ws_cols = ws.repeat_interleave(128, dim=0)[: w64.shape[0]]         # [n', KB]
            acc = torch.zeros((m, w64.shape[0]), dtype=torch.float64, device=x_q.device)
            for kb in range(0, (k + 127) // 128):
                part = x64[:, kb * 128:(kb + 1) * 128] @ w64[:, kb * 128:(kb + 1) * 128].T
                acc += part * (xs[:, kb:kb + 1] * ws_cols[:, kb][None, :])
            out[:, r:r + w64.shape[0]] = acc
        return out
    x64 = x_q.double()
    xs = x_scale.double().reshape(-1, 1) if x_scale.dim() else x_scale.double()
    ws_all = w_scale.double().reshape(-1) if w_scale.dim() else w_scale.double()
    for r in range(0, n, step):
        w64 = w_q[r:r + step].double()
        ws = ws_all[r:r + w64.shape[0]][None, :] if ws_all.dim() else ws_all
        out[:, r:r + w64.shape[0]] = (x64 @ w64.T) * xs * ws
    return out


def linear(x: torch.Tensor, weights: Weights, path: Path) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T + bias, computed exactly then rounded to float32, then x.dtype."""
    w_q, w_scale, bias, _ = weights
    x_q, x_scale = quantize_activation(x, path.act)
    y = exact_matmul(x_q, x_scale, w_q, w_scale, path.scheme).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

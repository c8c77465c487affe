"""The `triton` backend (sm_89+): it executes a `plan.Path` (Triton or torch-op quantizer, then the
GEMM the plan names); every per-call choice and its reason lives in `plan.py`.

All of it is launches only: no host synchronization, so it captures in CUDA graphs.
"""

from __future__ import annotations

import torch

from .. import numerics
from ..config import Scheme
from . import device_class, torch_mm, triton_decode, triton_gemv, triton_quant
from .plan import DECODE_MAX_M, Path, Table, Weights, plan
from .triton_block import block_gemm
from .triton_jit import available as gemm_available
from .triton_rowwise import rowwise_gemm

GRAPHED = True   # small-M calls are host-bound Python launches: Fp8Linear replays them from CUDA graphs


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """None if the Triton path can run this layer, else why not."""
    for why in (triton_quant.available(device), gemm_available(device)):
        if why is not None:
            return why
    if device.type != "cuda" and device.type != "cpu":   # CPU tensors: Triton's interpreter (the checks above)
        return "the triton backend runs on CUDA GPUs"
    if act_kind == "tensor":
        return "per-tensor activations need a global amax; the triton backend quantizes per token"
    if n % 16 or k % 16:
        return f"FP8 GEMMs need N and K divisible by 16 (N={n}, K={k})"
    if scheme is Scheme.BLOCK and k % 128:
        return f"block GEMMs need K divisible by 128 (K={k})"
    return None


def workspace(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool, table: Table | None) -> torch.Tensor | None:
    """A layer's int32 decode workspace: the decode kernel's per-tile ticket counters (zeros), then,
    where the plan (by `table`, default the device class's) adds two K splits by exchange at some M,
    the exchange slots for up to 16 rows (EMPTY). Both are back to these values after every launch;
    None where no call decodes."""
    dclass = device_class(torch.device(device))
    gemms = {plan("triton", scheme, act_kind, m, n, k, dclass, batch_invariant, table=table).gemm
             for m in range(1, DECODE_MAX_M + 1)}
    if not any(g.startswith("triton-decode") for g in gemms):
        return None
    tickets = triton_decode.ticket_counters(n, device)
    if "triton-decode-exchange" not in gemms:
        return tickets
    return torch.cat([tickets, triton_decode.exchange_slots(n, 2, device)])


def exchange_slots_of(ws: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The exchange slots inside a layer's decode workspace, or fresh ones when it has none."""
    start = -(-n // 16)   # the ticket counters come first
    if ws is not None and ws.numel() >= start + triton_decode.MAX_M * n:
        return ws[start:]
    return triton_decode.exchange_slots(n, 2, device)


def quantize(x: torch.Tensor, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation's FP8 values and scales as `path` says: per-token [M, 1] or 1x128-group
    [M, K/128] scales (strides (1, M) for cuBLAS blockwise), by the Triton kernel or numerics' torch ops."""
    col_major = path.gemm == "cublas-blockwise"
    if path.quant == "torch":
        q, s = numerics.quantize_activation(x, path.act)
        return q, (s.t().contiguous().t() if col_major else s)
    if path.act == "token":
        return triton_quant.quantize_act_token(x, early_launch=path.pdl)
    return triton_quant.quantize_act_group(x, col_major=col_major, early_launch=path.pdl)


def linear(x: torch.Tensor, weights: Weights, path: Path) -> torch.Tensor:
    """y [M, N] = quantize(x [M, K]) @ W.T + bias in x.dtype, run as `path` says."""
    w_q, w_s, bias, ws = weights
    if path.quant == "fused":   # the GEMM quantizes x itself
        if path.gemm == "triton-gemv":
            return triton_gemv.gemv(x, w_q, w_s, path.scheme.value, bias, x_scale=None, out_dtype=x.dtype,
                                    config=dict(path.config) or None)
        return _decode(x, None, x.dtype, weights, path)
    x_q, x_s = quantize(x, path)
    return linear_fp8(x_q, x_s, x.dtype, weights, path)


def linear_fp8(x_q: torch.Tensor, x_s: torch.Tensor, out_dtype: torch.dtype, weights: Weights, path: Path
               ) -> torch.Tensor:
    """y [M, N] in `out_dtype` from the FP8 activation x_q [M, K] and its scales x_s ([M, 1] per token,
    [M, K/128] per group), quantized by the Triton quantizer or by a producer (path.quant names it)."""
    w_q, w_s, bias, ws = weights
    gemm, fast = path.gemm, path.fast_accum
    if gemm == "triton-gemv":
        return triton_gemv.gemv(x_q, w_q, w_s, path.scheme.value, bias, x_scale=x_s, out_dtype=out_dtype,
                                pdl=path.pdl, config=dict(path.config) or None)
    if gemm.startswith("triton-decode"):
        return _decode(x_q, x_s, out_dtype, weights, path)
    if gemm == "triton-block":
        return block_gemm(x_q, x_s, w_q, w_s, bias, out_dtype, batch_invariant=path.invariant)
    if gemm == "triton-rowwise":
        return rowwise_gemm(x_q, x_s, w_q, w_s, bias, out_dtype, batch_invariant=path.invariant, fast_accum=fast,
                            config=dict(path.config) or None)
    if gemm == "cublas-blockwise":   # column-major scales (the quantizer's col_major; a producer's row-major)
        return torch_mm.blockwise_mm(x_q, x_s.t().contiguous().t(), w_q, w_s, bias, out_dtype)
    if gemm == "cublas-tensorwise":
        return torch_mm.rowwise_mm(x_q, x_s.reshape(()), w_q, w_s.reshape(()), bias, out_dtype, fast)
    if gemm == "cublas-rowwise":
        return torch_mm.rowwise_mm(x_q, x_s, w_q, w_s, bias, out_dtype, fast)
    raise ValueError(f"the triton backend does not run {path.name!r}")


def _decode(x: torch.Tensor, x_s: torch.Tensor | None, out_dtype: torch.dtype, weights: Weights, path: Path
            ) -> torch.Tensor:
    """The split-K decode kernel on bf16 rows it quantizes (x_s None) or on FP8 rows and their scales."""
    w_q, w_s, bias, ws = weights
    slots = exchange_slots_of(ws, w_q.shape[0], w_q.device) if path.gemm == "triton-decode-exchange" else None
    return triton_decode.decode_linear(x, w_q, w_s, path.scheme.value, path.act, bias, x_scale=x_s, counters=ws,
                                       out_dtype=out_dtype, pdl=path.pdl, config=dict(path.config) or None,
                                       slots=slots, fast_accum=path.fast_accum)

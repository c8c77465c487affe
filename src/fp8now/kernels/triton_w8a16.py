"""The `triton-w8a16` backend: weights stay FP8 in memory and are dequantized inside a bf16/fp16 GEMM,
for GPUs without FP8 tensor cores (sm_80/86). Activations are not quantized, so the `channel` scheme
(whose point is per-token activation quantization) refuses it (SPEC §9).

The fp8 bytes are decoded with integer ops (e4m3fn -> fp16 bit pattern, times 2^8 folded into the
scale), so no fp8 type support is needed from the compiler or the GPU.
"""

import torch

from ..config import WEIGHT_GROUP, Scheme
from .plan import Path, Weights
from .triton_jit import (FP8_DTYPE, SCALE_BLOCK, cdiv, check_bias, check_block_scale, check_out_dtype,
                         check_scale, flatten_act, grouped_pid, merge_config, pick, reason, store_tile,
                         tile_offsets)
from .triton_support import require_triton, tl, triton


def available(device: torch.device, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False) -> str | None:
    """None if the weight-only kernel can run this layer, else why not."""
    if scheme is Scheme.CHANNEL:
        return ("the channel scheme quantizes activations per token; a weight-only kernel would "
                "silently drop that")
    if batch_invariant:
        return "the weight-only kernel has no fixed-configuration (batch-invariant) variant"
    return available_gemm(device)


def available_gemm(device) -> str | None:
    """None if `w8a16_gemm` can run on `device` (CUDA >= 8.0), else why not."""
    return reason(device, (8, 0), "the W8A16 GEMM (bf16/fp16 tensor cores)")


def linear(x: torch.Tensor, weights: Weights, path: Path) -> torch.Tensor:
    """y [M, N] = x @ (W_q * s).T + bias, x left in bf16/fp16."""
    w_q, w_scale, bias, _ = weights
    return w8a16_gemm(x, w_q, w_scale, WEIGHT_GROUP[path.scheme], bias, out_dtype=x.dtype)


W8A16_TABLE = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)


@triton.jit(do_not_specialize=["M"])
def _w8a16_gemm_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                       M, N, K,
                       stride_xm, stride_xk, stride_wn, stride_wk, stride_wsn, stride_wsk,
                       stride_ym, stride_yn,
                       UPCAST_DOT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, offs_k, rm, rn = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk        # [BM, BK]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn        # [BK, BN] bytes
    ws_ptrs = ws_ptr + (rn // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        u = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0).to(tl.uint16)
        # e4m3fn bits seeeemmm -> fp16 bits s0eeeemmm0000000: the same value times 2^-8 (subnormals too)
        h = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)
        sw = tl.load(ws_ptrs + (k0 // 128) * stride_wsk) * 256.0
        b = (h.to(tl.float32) * sw[None, :]).to(a.dtype)
        if UPCAST_DOT:  # Triton's interpreter computes bf16 dots wrongly; same operand values in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    store_tile(y_ptr, acc, b_ptr, rn, offs_m, offs_n, M, N, stride_ym, stride_yn, HAS_BIAS)


def w8a16_gemm(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group: tuple[int, int],
               bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
               config: dict | None = None) -> torch.Tensor:
    """Weight-only FP8: y [..., N] = x @ (w_q * w_s).T (+ bias), x bf16/fp16 left unquantized.

    group (-1, -1): tensor scale w_s 0-d / [1]; (128, 128): block scales [ceil(N/128), ceil(K/128)].
    The per-channel scheme (1, -1) is refused: its activations are meant to be quantized per token,
    and a weight-only kernel would silently drop that.
    """
    require_triton()
    group = tuple(group)
    if group == (1, -1):
        raise ValueError("w8a16_gemm refuses the 'channel' scheme: weight-only FP8 would silently drop "
                         "its per-token activation quantization; use an FP8 GEMM (or the reference "
                         "backend) for channel-quantized layers")
    if group not in ((-1, -1), (SCALE_BLOCK, SCALE_BLOCK)):
        raise ValueError(f"w8a16_gemm supports weight groups (-1, -1) and (128, 128), got {group}")
    if w_q.dim() != 2 or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"w_q must be a 2-D {FP8_DTYPE} tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    N, K = w_q.shape
    x2 = flatten_act(x, K)
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w8a16_gemm needs a bf16 or fp16 activation, got {x2.dtype}")
    if x2.device != w_q.device:
        raise ValueError(f"x on {x2.device} but w_q on {w_q.device}")
    if group == (-1, -1):
        if w_s.numel() != 1:
            raise ValueError(f"a tensor-scaled weight needs one scale, got shape {tuple(w_s.shape)}")
        check_scale(w_s, "w_s", w_q.device)
        swn = swk = 0
    else:
        check_block_scale(w_s, N, K, "w_s", w_q.device, SCALE_BLOCK)
        swn, swk = w_s.stride(0), w_s.stride(1)
    bias = check_bias(bias, N, w_q.device)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_out_dtype(out_dtype)
    M = x2.shape[0]
    cfg = merge_config(pick(W8A16_TABLE, M), config)
    if SCALE_BLOCK % cfg["BLOCK_K"]:
        raise ValueError(f"w8a16_gemm needs BLOCK_K dividing {SCALE_BLOCK}, got {cfg['BLOCK_K']}")
    w_u8 = w_q.view(torch.uint8)
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    if M > 0 and N > 0:
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
        _w8a16_gemm_kernel[grid](
            x2, w_u8, w_s, bias if bias is not None else w_s, y,
            M, N, K,
            x2.stride(0), x2.stride(1), w_u8.stride(0), w_u8.stride(1), swn, swk,
            y.stride(0), y.stride(1),
            UPCAST_DOT=x2.device.type == "cpu", HAS_BIAS=bias is not None,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], N)

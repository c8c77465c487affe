"""What the Triton kernel modules share: @triton.jit helpers, launch-config tables, and the operand checks
of their wrappers (pure Python on shapes and dtypes: trace-friendly, no host sync).

Conventions (SPEC §3, §4): weights `w_q [N, K]` float8_e4m3fn row-major (like nn.Linear), activations
`x [M, K]`, `y = x @ W.T (+ bias)`. A scale is the dequantization multiplier.
"""

import torch

from ..numerics import E4M3FN
from .triton_support import TRITON_ERROR, device_reason, interpreted, tl, triton

FP8_DTYPE = E4M3FN.dtype
SCALE_BLOCK = 128                  # weight tiles 128x128, activation groups 1x128

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K"}


# ----------------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------------

@triton.jit
def grouped_pid(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), walking GROUP_M tile rows per column for L2 reuse."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    return pid_m, pid_n


@triton.jit
def tile_offsets(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile's row, column and K offsets, and its rows / columns wrapped onto real ones (`rm`, `rn`,
    int64): loads stay unmasked in M and N, only `store_tile` masks."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return offs_m, offs_n, offs_k, (offs_m % M).to(tl.int64), (offs_n % N).to(tl.int64)


@triton.jit
def store_tile(y_ptr, acc, b_ptr, rn, offs_m, offs_n, M, N, stride_ym, stride_yn, HAS_BIAS: tl.constexpr):
    """The float32 tile `acc` (+ bias[n] in float32) cast to y's dtype, stored where it lies inside [M, N]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def abs_bits(x):
    """|x| as int32 bit patterns. Non-negative floats order like their bits, and NaN sits above inf,
    so an integer max of these is the float amax with NaN propagated, like torch.amax (a float tl.max
    would drop NaN on the GPU)."""
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def as_f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_fp8(y, q_ptr, FMAX: tl.constexpr):
    """Clamp to ±FMAX (NaN stays NaN), then the round-to-nearest-even cast to q_ptr's FP8 type."""
    y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    return y.to(q_ptr.dtype.element_ty)


# ----------------------------------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------------------------------

def reason(device, min_cap: tuple[int, int], what: str) -> str | None:
    """None if these kernels run on `device` with compute capability >= `min_cap`, else why not."""
    return device_reason(device, interpreted(grouped_pid), TRITON_ERROR, min_cap, what)


def available(device) -> str | None:
    """None if the FP8 GEMMs can run on `device`, else the reason they cannot."""
    return reason(device, (8, 9), "FP8 tensor-core GEMM")


# ----------------------------------------------------------------------------------------------------
# Wrapper helpers
# ----------------------------------------------------------------------------------------------------

def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pick(table, m: int) -> dict:
    """The config of the first (bound, config) row with m <= bound; the last row (None) catches all."""
    for bound, cfg in table:
        if bound is None or m <= bound:
            return cfg
    raise AssertionError("config table must end with a catch-all row")


def merge_config(default: dict, override: dict | None, *, block_k: int | None = None) -> dict:
    """`default` updated by `override`, validated. `block_k` forces BLOCK_K (block-scaled kernels)."""
    cfg = dict(default)
    if override:
        unknown = set(override) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; valid: {sorted(CONFIG_KEYS)}")
        cfg.update(override)
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"config {key}={v} must be a power of two >= 16")
    if block_k is not None and cfg["BLOCK_K"] != block_k:
        raise ValueError(f"this kernel needs BLOCK_K={block_k} (one scale group per K step), "
                         f"got {cfg['BLOCK_K']}")
    if not isinstance(cfg.get("SPLIT_K", 0), int) or cfg.get("SPLIT_K", 0) < 0:
        raise ValueError(f"config SPLIT_K must be an int >= 1 (or 0: choose from the shape), got {cfg['SPLIT_K']}")
    if cfg["GROUP_M"] < 1 or cfg["num_warps"] < 1 or cfg["num_stages"] < 1:
        raise ValueError(f"config GROUP_M, num_warps, num_stages must be >= 1: {cfg}")
    return cfg


def check_fp8_operands(x_q: torch.Tensor, w_q: torch.Tensor) -> tuple[int, int, int]:
    """(M, N, K) of FP8 operands x_q [M, K] and w_q [N, K] on one device."""
    if x_q.dim() != 2 or w_q.dim() != 2:
        raise ValueError(f"expected x_q [M, K] and w_q [N, K], got {tuple(x_q.shape)} and {tuple(w_q.shape)}")
    if x_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        raise TypeError(f"x_q and w_q must be {FP8_DTYPE}, got {x_q.dtype} and {w_q.dtype}")
    if x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"K mismatch: x_q {tuple(x_q.shape)} vs w_q {tuple(w_q.shape)}")
    if x_q.device != w_q.device:
        raise ValueError(f"x_q on {x_q.device} but w_q on {w_q.device}")
    return x_q.shape[0], w_q.shape[0], x_q.shape[1]


def check_scale(s: torch.Tensor, name: str, device: torch.device) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got "
                        f"{s.dtype if isinstance(s, torch.Tensor) else type(s).__name__}")
    if s.device != device:
        raise ValueError(f"{name} on {s.device} but the operands are on {device}")


def vector_scale(s: torch.Tensor, n: int, name: str, device: torch.device) -> int:
    """Stride that indexes a per-row scale `[n, 1]` / `[n]`, or 0 for a single (0-d / [1]) scale."""
    check_scale(s, name, device)
    if s.numel() == 1 and s.dim() <= 2:
        return 0
    if s.dim() in (1, 2) and s.shape[0] == n and s.numel() == n:
        return s.stride(0)
    raise ValueError(f"{name} must be 0-d / [1] or [{n}, 1], got shape {tuple(s.shape)}")


def check_block_scale(s: torch.Tensor, rows: int, k: int, name: str, device: torch.device,
                      row_group: int) -> None:
    check_scale(s, name, device)
    want = (cdiv(rows, row_group), cdiv(k, SCALE_BLOCK))
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape [{want[0]}, {want[1]}], got {tuple(s.shape)}")


def check_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    if not bias.is_floating_point() or bias.device != device:
        raise ValueError(f"bias must be a floating tensor on {device}, got {bias.dtype} on {bias.device}")
    return bias


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def flatten_act(x: torch.Tensor, k: int, name: str = "x") -> torch.Tensor:
    """x [..., K] bf16/fp16/fp32 as [M, K]."""
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name} must be [..., {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    return x.reshape(-1, k)

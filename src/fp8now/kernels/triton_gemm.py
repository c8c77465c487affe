"""Triton FP8 GEMMs: block-scaled, row-scaled, fused-quantization decode kernels, and weight-only W8A16.

Conventions (SPEC §3, §4): weights `w_q [N, K]` float8_e4m3fn row-major (like nn.Linear), activations
`x [M, K]`, `y = x @ W.T (+ bias)`. A scale is the dequantization multiplier. Every kernel accumulates
in float32, applies the scales in float32, adds the bias in float32 and casts once at the store.

Kernels and their wrappers (each wrapper: check -> allocate -> launch; no host sync, no env lookups):
- `block_gemm`: 1x128 activation groups x 128x128 weight tiles, the scale product applied per K-block.
- `rowwise_gemm`: per-token ([M, 1] or 0-d) x per-channel ([N, 1] or 0-d) scales, applied once after K.
- `fused_token_gemm` / `fused_group_gemm`: for decode (small M) - one launch that quantizes the bf16/fp16
  activation inside the kernel (bit-identical to `numerics.quantize_activation`) and runs the FP8 GEMM.
- `w8a16_gemm`: fp8 weights dequantized in-kernel, bf16/fp16 tensor-core dot (GPUs without FP8 MMA).
With `batch_invariant=True` (SPEC §8) a GEMM uses one fixed configuration whatever M, and no kernel here
ever splits K, so row m of the output depends only on row m of the input.

Under TRITON_INTERPRET=1 (CPU tensors) Triton's fp32 -> fp8 cast is wrong when rounding carries into the
next binade (SPEC §2), so the in-kernel quantizers round to the e4m3 grid in float32 first (exact) when the
tensors live on the CPU; on a GPU the hardware conversion (round to nearest even) is used directly.
"""

import torch

from ..numerics import E4M3FN, GROUP_AMAX_FLOOR

from .triton_support import device_reason

try:
    import triton
    import triton.language as tl
    _TRITON_ERROR = None
except ImportError as _e:  # keep the module importable so available() can say why
    _TRITON_ERROR = _e

    class _Missing:
        """Stand-in so the decorated definitions below still parse without triton."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = tl = _Missing()

FP8_DTYPE = E4M3FN.dtype
FMAX = E4M3FN.fmax                 # 448.0, the clamp range
ROW_MIN_SCALE = E4M3FN.min_scale   # 1 / (448 * 512): per-token scale floor
SCALE_BLOCK = 128                  # weight tiles 128x128, activation groups 1x128

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}


# ----------------------------------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------------------------------

def _interpreting() -> bool:
    """Were this module's kernels built for Triton's interpreter (TRITON_INTERPRET=1 at import)?"""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(_block_gemm_kernel, InterpretedFunction)


def _available(device, min_cap: tuple[int, int], what: str) -> str | None:
    return device_reason(device, _interpreting(), _TRITON_ERROR, min_cap, what)


def available(device) -> str | None:
    """None if the FP8 kernels (all but W8A16) can run on `device`, else the reason they cannot."""
    return _available(device, (8, 9), "FP8 tensor-core GEMM")


def available_w8a16(device) -> str | None:
    """None if the weight-only `w8a16_gemm` can run on `device` (CUDA >= 8.0), else why not."""
    return _available(device, (8, 0), "the W8A16 GEMM (bf16/fp16 tensor cores)")


# ----------------------------------------------------------------------------------------------------
# Shared wrapper helpers (pure Python on shapes and dtypes: trace-friendly)
# ----------------------------------------------------------------------------------------------------

def _require_triton() -> None:
    if _TRITON_ERROR is not None:
        raise RuntimeError(f"triton is not importable ({_TRITON_ERROR})")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _pick(table, m: int) -> dict:
    for bound, cfg in table:
        if bound is None or m <= bound:
            return cfg
    raise AssertionError("config table must end with a catch-all row")


def _merge_config(default: dict, override: dict | None, *, block_k: int | None = None) -> dict:
    """`default` updated by `override`, validated. `block_k` forces BLOCK_K (block-scaled kernels)."""
    cfg = dict(default)
    if override:
        unknown = set(override) - _CONFIG_KEYS
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; valid: {sorted(_CONFIG_KEYS)}")
        cfg.update(override)
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"config {key}={v} must be a power of two >= 16")
    if block_k is not None and cfg["BLOCK_K"] != block_k:
        raise ValueError(f"this kernel needs BLOCK_K={block_k} (one scale group per K step), "
                         f"got {cfg['BLOCK_K']}")
    if cfg["GROUP_M"] < 1 or cfg["num_warps"] < 1 or cfg["num_stages"] < 1:
        raise ValueError(f"config GROUP_M, num_warps, num_stages must be >= 1: {cfg}")
    return cfg


def _check_fp8_operands(x_q: torch.Tensor, w_q: torch.Tensor) -> tuple[int, int, int]:
    if x_q.dim() != 2 or w_q.dim() != 2:
        raise ValueError(f"expected x_q [M, K] and w_q [N, K], got {tuple(x_q.shape)} and {tuple(w_q.shape)}")
    if x_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        raise TypeError(f"x_q and w_q must be {FP8_DTYPE}, got {x_q.dtype} and {w_q.dtype}")
    if x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"K mismatch: x_q {tuple(x_q.shape)} vs w_q {tuple(w_q.shape)}")
    if x_q.device != w_q.device:
        raise ValueError(f"x_q on {x_q.device} but w_q on {w_q.device}")
    return x_q.shape[0], w_q.shape[0], x_q.shape[1]


def _check_scale(s: torch.Tensor, name: str, device: torch.device) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got "
                        f"{s.dtype if isinstance(s, torch.Tensor) else type(s).__name__}")
    if s.device != device:
        raise ValueError(f"{name} on {s.device} but the operands are on {device}")


def _vector_scale(s: torch.Tensor, n: int, name: str, device: torch.device) -> int:
    """Stride that indexes a per-row scale `[n, 1]` / `[n]`, or 0 for a single (0-d / [1]) scale."""
    _check_scale(s, name, device)
    if s.numel() == 1 and s.dim() <= 2:
        return 0
    if s.dim() in (1, 2) and s.shape[0] == n and s.numel() == n:
        return s.stride(0)
    raise ValueError(f"{name} must be 0-d / [1] or [{n}, 1], got shape {tuple(s.shape)}")


def _check_block_scale(s: torch.Tensor, rows: int, k: int, name: str, device: torch.device,
                       row_group: int) -> None:
    _check_scale(s, name, device)
    want = (_cdiv(rows, row_group), _cdiv(k, SCALE_BLOCK))
    if tuple(s.shape) != want:
        raise ValueError(f"{name} must have shape [{want[0]}, {want[1]}], got {tuple(s.shape)}")


def _check_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    if not bias.is_floating_point() or bias.device != device:
        raise ValueError(f"bias must be a floating tensor on {device}, got {bias.dtype} on {bias.device}")
    return bias


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


def _flatten_act(x: torch.Tensor, k: int, name: str = "x") -> torch.Tensor:
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name} must be [..., {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    return x.reshape(-1, k)


# ----------------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _grouped_pid(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
def _to_e4m3(v, EXACT: tl.constexpr):
    """fp32 already clamped to +-448 -> float8e4nv, round to nearest even.

    With EXACT the value is first rounded onto the e4m3 grid in float32 (adding and subtracting
    2^(e+20), where 2^e is the value's binade, at least 2^-6 for subnormals, leaves 3 mantissa bits);
    the cast of a representable value is then exact even in Triton's interpreter.
    """
    if EXACT:
        binade = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, 121 << 23)
        magic = (binade + (20 << 23)).to(tl.float32, bitcast=True)
        r = (tl.abs(v) + magic) - magic
        v = tl.where(v < 0, -r, r)
    return v.to(tl.float8e4nv)


# ----------------------------------------------------------------------------------------------------
# 1. Block-scaled FP8 GEMM: 1x128 activation groups x 128x128 weight tiles
# ----------------------------------------------------------------------------------------------------

# M bucket -> config, tuned for Hopper (H100/H200): small tiles and more programs for decode-sized M,
# 128x128 tiles with 8 warps for prefill. BLOCK_K is the scale group (128).
_BLOCK_TABLE = (
    (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)),
)
# One configuration for every M (SPEC §8): 64-row tiles keep wgmma usable, 64 columns keep enough
# programs for decode-sized batches.
_INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M"])
def _block_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                       M, N, K,
                       stride_xm, stride_xk, stride_xsm, stride_xsk,
                       stride_wn, stride_wk, stride_wsn, stride_wsk,
                       stride_ym, stride_yn,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns wrap onto valid ones (loads stay unmasked in M/N; the store masks).
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk        # [BM, BK]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn        # [BK, BN], K-major
    xs_ptrs = xs_ptr + rm * stride_xsm
    if 128 % BLOCK_N == 0:  # the tile lies in one weight-scale row: one scalar per K-block
        ws_ptrs = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn
    else:                   # wider tiles: one scale per column (n // 128)
        ws_ptrs = ws_ptr + (rn // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(xs_ptrs + (k0 // 128) * stride_xsk)
        sb = tl.load(ws_ptrs + (k0 // 128) * stride_wsk)
        # fresh fp32 block product, promoted into the accumulator with this K-block's scales
        if 128 % BLOCK_N == 0:
            acc += tl.dot(a, b) * (sa * sb)[:, None]
        else:
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def block_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
               config: dict | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """y [M, N] = sum_kb (x_q[:, kb] @ w_q[:, kb].T) * x_s[:, kb] * w_s[n // 128, kb] (+ bias).

    x_q [M, K] fp8, x_s [M, ceil(K/128)] float32 (any strides, e.g. column-major), w_q [N, K] fp8,
    w_s [ceil(N/128), ceil(K/128)] float32. `config` (BLOCK_M, BLOCK_N, GROUP_M, num_warps,
    num_stages; BLOCK_K must stay 128) overrides the M-bucket table; `batch_invariant` uses one
    fixed configuration instead of the table (a given `config` still wins).
    """
    _require_triton()
    M, N, K = _check_fp8_operands(x_q, w_q)
    _check_block_scale(x_s, M, K, "x_s", x_q.device, 1)
    _check_block_scale(w_s, N, K, "w_s", x_q.device, SCALE_BLOCK)
    bias = _check_bias(bias, N, x_q.device)
    _check_out_dtype(out_dtype)
    base = _INVARIANT_CONFIG if batch_invariant else _pick(_BLOCK_TABLE, M)
    cfg = _merge_config(base, config, block_k=SCALE_BLOCK)
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    grid = (_cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"]),)
    # Without bias, b_ptr gets a read-only stand-in (never y: no argument aliases the written output).
    _block_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, y,
        M, N, K,
        x_q.stride(0), x_q.stride(1), x_s.stride(0), x_s.stride(1),
        w_q.stride(0), w_q.stride(1), w_s.stride(0), w_s.stride(1),
        y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


# ----------------------------------------------------------------------------------------------------
# 2. Row-scaled FP8 GEMM: per-token x per-channel (or tensor) scales
# ----------------------------------------------------------------------------------------------------

_ROWWISE_TABLE = _BLOCK_TABLE
_ROWWISE_INVARIANT_CONFIG = _INVARIANT_CONFIG


@triton.jit(do_not_specialize=["M"])
def _rowwise_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                         M, N, K,
                         stride_xm, stride_xk, stride_xs, stride_wn, stride_wk, stride_ws,
                         stride_ym, stride_yn,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk        # [BM, BK]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn        # [BK, BN], K-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        # separate add: each K-block's product is promoted to a full fp32 accumulator (Hopper's FP8
        # MMA accumulates with reduced precision inside one instruction chain)
        acc += tl.dot(a, b)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    sa = tl.load(xs_ptr + rm * stride_xs)
    sb = tl.load(ws_ptr + rn * stride_ws)
    acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def rowwise_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
                 batch_invariant: bool = False, config: dict | None = None) -> torch.Tensor:
    """y [M, N] = (x_q @ w_q.T) * x_s[m] * w_s[n] (+ bias), the dot over all of K in float32.

    x_s: per-token [M, 1] (or [M]) or a single scale (0-d / [1]); w_s: per-channel [N, 1] (or [N])
    or 0-d / [1]. `batch_invariant` uses one fixed configuration for every M; `config` overrides.
    """
    _require_triton()
    M, N, K = _check_fp8_operands(x_q, w_q)
    sx = _vector_scale(x_s, M, "x_s", x_q.device)
    sw = _vector_scale(w_s, N, "w_s", x_q.device)
    bias = _check_bias(bias, N, x_q.device)
    _check_out_dtype(out_dtype)
    base = _ROWWISE_INVARIANT_CONFIG if batch_invariant else _pick(_ROWWISE_TABLE, M)
    cfg = _merge_config(base, config)
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    grid = (_cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"]),)
    _rowwise_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, y,
        M, N, K,
        x_q.stride(0), x_q.stride(1), sx, w_q.stride(0), w_q.stride(1), sw,
        y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


# ----------------------------------------------------------------------------------------------------
# 3. Fused decode kernels: quantize the activation in-kernel, then the FP8 GEMM, in one launch
# ----------------------------------------------------------------------------------------------------
# Each program owns BLOCK_N output columns for BLOCK_M (16) rows and loops over all of K: the weight
# slice is read once, no split-K, no atomics. The product is computed transposed (W tile as the
# left operand, acc [BLOCK_N, BLOCK_M]) so the weight takes the MMA's wide side and the few tokens
# its narrow side: BLOCK_N=64 compiles to Hopper wgmma m64n16k32 (e4m3); BLOCK_N=32 (more programs
# for N <= 8192) to mma.sync with the fp8 operands widened to fp16 in registers (exact).
# Program axis 0 walks the M tiles, so tiles sharing a weight slice run together.
# The configuration depends on N only, so these kernels are batch-invariant too.

def _fused_config(n: int, override: dict | None) -> dict:
    # >= ~128 programs for N >= 4096 on H200's 132 SMs; wider tiles once N gives enough programs.
    block_n = 32 if n <= 8192 else 64
    base = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    return _merge_config(base, override)


@triton.jit(do_not_specialize=["M"])
def _fused_token_gemm_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                             M, N, K,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_ws,
                             stride_ym, stride_yn,
                             FMAX: tl.constexpr, MIN_SCALE: tl.constexpr, EXACT_CAST: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    xt_base = x_ptr + rm[None, :] * stride_xm + offs_k[:, None] * stride_xk      # x^T tile [BK, BM]
    # pass 1: per-token amax over all of K -> s = max(amax / FMAX, MIN_SCALE) (IEEE division)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(xt_base + k0 * stride_xk,
                     mask=offs_k[:, None] < K - k0, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=0))
    s = tl.maximum(tl.math.div_rn(amax, FMAX), MIN_SCALE)
    # pass 2: quantize x^T tiles on the fly (q = fp8(clamp(x / s))) and multiply with the weight.
    # The clamp keeps NaN (a NaN in a row makes that row's outputs NaN, as the torch reference does).
    w_ptrs = w_ptr + rn[:, None] * stride_wn + offs_k[None, :] * stride_wk          # [BN, BK], K-major
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        xt = tl.load(xt_base + k0 * stride_xk,
                     mask=offs_k[:, None] < k_left, other=0.0).to(tl.float32)
        q = tl.math.div_rn(xt, s[None, :])
        q = _to_e4m3(tl.clamp(q, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), EXACT_CAST)
        w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        acc += tl.dot(w, q)
        w_ptrs += BLOCK_K * stride_wk
    sw = tl.load(ws_ptr + rn * stride_ws)
    acc = acc * (sw[:, None] * s[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n.to(tl.int64)[:, None] * stride_yn
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fused_token_gemm(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                     bias: torch.Tensor | None = None, *, scheme: str = "channel",
                     out_dtype: torch.dtype | None = None, config: dict | None = None,
                     batch_invariant: bool = False) -> torch.Tensor:
    """Per-token activation quantization fused with the FP8 GEMM, for small M (decode, M <= 64).

    x [..., K] bf16/fp16/fp32 (unquantized); w_q [N, K] fp8; w_s [N, 1] for scheme "channel", 0-d
    (or [1]) for "tensor". The FP8 operands equal `quantize_activation(x, "token")` exactly, so the
    result is that of `rowwise_gemm` on them. Returns [..., N] in `out_dtype` (default x.dtype).
    Larger M works but re-reads the weight once per 16 rows. The configuration depends on N only,
    so the kernel is always batch-invariant (`batch_invariant` is accepted for a uniform call).
    """
    _require_triton()
    if scheme not in ("channel", "tensor"):
        raise ValueError(f"fused_token_gemm scheme must be 'channel' or 'tensor', got {scheme!r}")
    if w_q.dim() != 2 or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"w_q must be a 2-D {FP8_DTYPE} tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    N, K = w_q.shape
    x2 = _flatten_act(x, K)
    if x2.device != w_q.device:
        raise ValueError(f"x on {x2.device} but w_q on {w_q.device}")
    if scheme == "tensor" and w_s.numel() != 1:
        raise ValueError(f"scheme 'tensor' needs a single weight scale, got shape {tuple(w_s.shape)}")
    if scheme == "channel" and w_s.dim() != 2:
        raise ValueError(f"scheme 'channel' needs w_s [{N}, 1], got shape {tuple(w_s.shape)}")
    sw = _vector_scale(w_s, N, "w_s", w_q.device)
    bias = _check_bias(bias, N, w_q.device)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_out_dtype(out_dtype)
    cfg = _fused_config(N, config)
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    if M > 0 and N > 0:
        grid = (_cdiv(M, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"]))
        _fused_token_gemm_kernel[grid](
            x2, w_q, w_s, bias if bias is not None else w_s, y,
            M, N, K,
            x2.stride(0), x2.stride(1), w_q.stride(0), w_q.stride(1), sw,
            y.stride(0), y.stride(1),
            FMAX=FMAX, MIN_SCALE=ROW_MIN_SCALE, EXACT_CAST=x2.device.type == "cpu",
            HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], N)


@triton.jit(do_not_specialize=["M"])
def _fused_group_gemm_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                             M, N, K,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_wsn, stride_wsk,
                             stride_ym, stride_yn,
                             FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, EXACT_CAST: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    xt_ptrs = x_ptr + rm[None, :] * stride_xm + offs_k[:, None] * stride_xk      # x^T tile [BK, BM]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + offs_k[None, :] * stride_wk       # [BN, BK], K-major
    if 128 % BLOCK_N == 0:  # the tile lies in one weight-scale row: one scalar per K-block
        ws_ptrs = ws_ptr + ((tl.program_id(1) * BLOCK_N) // 128) * stride_wsn
    else:
        ws_ptrs = ws_ptr + (rn // 128) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # one K-block is one 1x128 group: s = max(amax, 1e-10) / FMAX, q = fp8(clamp(x / s))
        k_left = K - k0
        xt = tl.load(xt_ptrs, mask=offs_k[:, None] < k_left, other=0.0).to(tl.float32)
        s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xt), axis=0), AMAX_FLOOR), FMAX)
        q = tl.math.div_rn(xt, s[None, :])
        q = _to_e4m3(tl.clamp(q, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), EXACT_CAST)
        w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        sw = tl.load(ws_ptrs + (k0 // 128) * stride_wsk)
        if 128 % BLOCK_N == 0:
            acc += tl.dot(w, q) * (sw * s)[None, :]
        else:
            acc += tl.dot(w, q) * (sw[:, None] * s[None, :])
        xt_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n.to(tl.int64)[:, None] * stride_yn
    mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fused_group_gemm(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                     bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
                     config: dict | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """1x128-group activation quantization fused with the block-scaled FP8 GEMM (small M, decode).

    x [..., K] bf16/fp16/fp32; w_q [N, K] fp8; w_s [ceil(N/128), ceil(K/128)] float32. The FP8
    operands equal `quantize_activation(x, "group")` exactly. Returns [..., N] in `out_dtype`
    (default x.dtype). Always batch-invariant, like `fused_token_gemm`.
    """
    _require_triton()
    if w_q.dim() != 2 or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"w_q must be a 2-D {FP8_DTYPE} tensor, got {w_q.dtype} {tuple(w_q.shape)}")
    N, K = w_q.shape
    x2 = _flatten_act(x, K)
    if x2.device != w_q.device:
        raise ValueError(f"x on {x2.device} but w_q on {w_q.device}")
    _check_block_scale(w_s, N, K, "w_s", w_q.device, SCALE_BLOCK)
    bias = _check_bias(bias, N, w_q.device)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_out_dtype(out_dtype)
    cfg = _fused_config(N, config)
    if cfg["BLOCK_K"] != SCALE_BLOCK:
        raise ValueError(f"fused_group_gemm needs BLOCK_K={SCALE_BLOCK} (one group per K step)")
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    if M > 0 and N > 0:
        grid = (_cdiv(M, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"]))
        _fused_group_gemm_kernel[grid](
            x2, w_q, w_s, bias if bias is not None else w_s, y,
            M, N, K,
            x2.stride(0), x2.stride(1), w_q.stride(0), w_q.stride(1), w_s.stride(0), w_s.stride(1),
            y.stride(0), y.stride(1),
            FMAX=FMAX, AMAX_FLOOR=GROUP_AMAX_FLOOR, EXACT_CAST=x2.device.type == "cpu",
            HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], N)


# ----------------------------------------------------------------------------------------------------
# 4. Weight-only FP8 (W8A16) for GPUs without FP8 tensor cores (sm_80 / sm_86)
# ----------------------------------------------------------------------------------------------------
# The fp8 bytes are decoded with integer ops (e4m3fn -> fp16 bit pattern, times 2^8 folded into the
# scale), so no fp8 type support is needed from the compiler or the GPU.

_W8A16_TABLE = (
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
    pid_m, pid_n = _grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n.to(tl.int64)[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def w8a16_gemm(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group: tuple[int, int],
               bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
               config: dict | None = None) -> torch.Tensor:
    """Weight-only FP8: y [..., N] = x @ (w_q * w_s).T (+ bias), x bf16/fp16 left unquantized.

    group (-1, -1): tensor scale w_s 0-d / [1]; (128, 128): block scales [ceil(N/128), ceil(K/128)].
    The per-channel scheme (1, -1) is refused: its activations are meant to be quantized per token,
    and a weight-only kernel would silently drop that.
    """
    _require_triton()
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
    x2 = _flatten_act(x, K)
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w8a16_gemm needs a bf16 or fp16 activation, got {x2.dtype}")
    if x2.device != w_q.device:
        raise ValueError(f"x on {x2.device} but w_q on {w_q.device}")
    if group == (-1, -1):
        if w_s.numel() != 1:
            raise ValueError(f"a tensor-scaled weight needs one scale, got shape {tuple(w_s.shape)}")
        _check_scale(w_s, "w_s", w_q.device)
        swn = swk = 0
    else:
        _check_block_scale(w_s, N, K, "w_s", w_q.device, SCALE_BLOCK)
        swn, swk = w_s.stride(0), w_s.stride(1)
    bias = _check_bias(bias, N, w_q.device)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_out_dtype(out_dtype)
    M = x2.shape[0]
    cfg = _merge_config(_pick(_W8A16_TABLE, M), config)
    if SCALE_BLOCK % cfg["BLOCK_K"]:
        raise ValueError(f"w8a16_gemm needs BLOCK_K dividing {SCALE_BLOCK}, got {cfg['BLOCK_K']}")
    w_u8 = w_q.view(torch.uint8)
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    if M > 0 and N > 0:
        grid = (_cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"]),)
        _w8a16_gemm_kernel[grid](
            x2, w_u8, w_s, bias if bias is not None else w_s, y,
            M, N, K,
            x2.stride(0), x2.stride(1), w_u8.stride(0), w_u8.stride(1), swn, swk,
            y.stride(0), y.stride(1),
            UPCAST_DOT=x2.device.type == "cpu", HAS_BIAS=bias is not None,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], N)

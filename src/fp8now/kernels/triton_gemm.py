"""Triton FP8 GEMMs: block-scaled, row-scaled (both with split-K for decode), and weight-only W8A16.

Conventions (SPEC §3, §4): weights `w_q [N, K]` float8_e4m3fn row-major (like nn.Linear), activations
`x [M, K]`, `y = x @ W.T (+ bias)`. A scale is the dequantization multiplier. Every kernel accumulates
in float32, applies the scales in float32, adds the bias in float32 and casts once at the store.

Kernels and their wrappers (each wrapper: check -> allocate -> launch; no host sync, no env lookups):
- `block_gemm`: 1x128 activation groups x 128x128 weight tiles, the scale product applied per K-block.
- `rowwise_gemm`: per-token ([M, 1] or 0-d) x per-channel ([N, 1] or 0-d) scales, applied once after K.
- `w8a16_gemm`: fp8 weights dequantized in-kernel, bf16/fp16 tensor-core dot (GPUs without FP8 MMA).
Decode-sized M (few output tiles) splits K over SPLIT_K programs per tile: each writes its float32
partial sum to a workspace, and a second small kernel adds the partials in a fixed order, applies the
row scales and the bias, and casts (deterministic; no atomics). With `batch_invariant=True` (SPEC §8)
a GEMM uses one fixed configuration whatever M and never splits K, so row m of the output depends
only on row m of the input.
"""

import torch

from ..numerics import E4M3FN

from .triton_support import device_reason, memo

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
SCALE_BLOCK = 128                  # weight tiles 128x128, activation groups 1x128

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONFIG_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K"}


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
    if not isinstance(cfg.get("SPLIT_K", 0), int) or cfg.get("SPLIT_K", 0) < 0:
        raise ValueError(f"config SPLIT_K must be an int >= 1 (or 0: choose from the shape), got {cfg['SPLIT_K']}")
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


# ----------------------------------------------------------------------------------------------------
# Split-K (decode) and the partial-sum reduction
# ----------------------------------------------------------------------------------------------------

SPLIT_MIN_K = 512   # every split covers at least this much of K


@memo(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small but > 1, so tests exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(cfg: dict, m: int, n: int, k: int, device: torch.device) -> int:
    """Programs per output tile along K: the config's SPLIT_K, or (0 = auto) enough for about four
    programs per SM when the tiles alone are fewer, each split at least SPLIT_MIN_K long (H200:
    benchmarks/tune_decode.py; decode GEMMs are memory-bound and need many loads in flight)."""
    split = cfg.get("SPLIT_K", 0)
    if split:
        return split
    tiles = _cdiv(m, cfg["BLOCK_M"]) * _cdiv(n, cfg["BLOCK_N"])
    want = _cdiv(4 * _sm_count(device), tiles)
    return max(1, min(want, k // SPLIT_MIN_K))


def _k_per_split(k: int, split: int, block_k: int) -> int:
    """K elements per split, a multiple of BLOCK_K (so split edges fall on 128-wide scale groups)."""
    return _cdiv(_cdiv(k, split), block_k) * block_k


def _split_sizes(cfg: dict, m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(K per split, number of splits) of a launch."""
    k_split = _k_per_split(k, _split_k(cfg, m, n, k, device), cfg["BLOCK_K"])
    return k_split, _cdiv(k, k_split)


def _split_workspace(splits: int, y: torch.Tensor) -> torch.Tensor:
    """Where the GEMM kernel writes: `y` itself for one split, else a float32 workspace
    [splits, M, N] of partial sums."""
    return y if splits == 1 else torch.empty((splits, *y.shape), dtype=torch.float32, device=y.device)


def _split_plan(cfg: dict, m: int, n: int, k: int, y: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(K per split, number of splits, where the GEMM kernel writes; see `_split_workspace`)."""
    k_split, splits = _split_sizes(cfg, m, n, k, y.device)
    return k_split, splits, _split_workspace(splits, y)


@triton.jit
def _store_partial(p_ptr, acc, offs_m, offs_n, M, N):
    """This program's float32 partial sum into slice program_id(1) of the workspace [SPLITS, M, N]."""
    p_ptrs = (p_ptr + tl.program_id(1).to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N
              + offs_n.to(tl.int64)[None, :])
    tl.store(p_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(p_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, stride_xs, stride_ws,
                         stride_ym, stride_yn, SPLITS: tl.constexpr, SCALED: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = (sum of the SPLITS partials [SPLITS, M, N], in order) * x_s[m] * w_s[n] + bias, cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + i * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if SCALED:
        acc = acc * (tl.load(xs_ptr + m * stride_xs, mask=mask, other=0.0)
                     * tl.load(ws_ptr + n * stride_ws, mask=mask, other=0.0))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _reduce_splits(part: torch.Tensor, x_s, sx: int, w_s, sw: int, bias, y: torch.Tensor,
                   scaled: bool) -> None:
    splits, m, n = part.shape
    block = 1024
    _split_reduce_kernel[(_cdiv(m * n, block),)](
        part, x_s, w_s, bias if bias is not None else part, y, m, n, sx, sw, y.stride(0), y.stride(1),
        SPLITS=splits, SCALED=scaled, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


# ----------------------------------------------------------------------------------------------------
# 1. Block-scaled FP8 GEMM: 1x128 activation groups x 128x128 weight tiles
# ----------------------------------------------------------------------------------------------------

# M bucket -> config, tuned for Hopper (H100/H200): 16-row tiles and split-K (auto) for decode-sized M
# (BLOCK_N=64 won on 12 of 14 H200 decode rows), 128x128 tiles with 8 warps for prefill: 4 stages beat
# 3 by 1.03-1.15x at M = 4096 / 16384 over 5 shapes, and 13 other tile configurations were slower
# (benchmarks/probe_kernels.py block, H200, 2026-12-03). BLOCK_K is the scale group (128).
_BLOCK_TABLE = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=0)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4, SPLIT_K=0)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SPLIT_K=1)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4, SPLIT_K=1)),
)
# One configuration for every M (SPEC §8): 64-row tiles keep wgmma usable, 64 columns keep enough
# programs for decode-sized batches, and K is never split.
_INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4,
                         SPLIT_K=1)


@triton.jit(do_not_specialize=["M"])
def _block_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
                       M, N, K, K_SPLIT,
                       stride_xm, stride_xk, stride_xsm, stride_xsk,
                       stride_wn, stride_wk, stride_wsn, stride_wsk,
                       stride_ym, stride_yn,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows/columns wrap onto valid ones (loads stay unmasked in M/N; the store masks).
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_begin + offs_k[None, :]) * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + (k_begin + offs_k[:, None]) * stride_wk + rn[None, :] * stride_wn  # [BK, BN]
    xs_ptrs = xs_ptr + rm * stride_xsm
    if 128 % BLOCK_N == 0:  # the tile lies in one weight-scale row: one scalar per K-block
        ws_ptrs = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn
    else:                   # wider tiles: one scale per column (n // 128)
        ws_ptrs = ws_ptr + (rn // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_left = k_end - k0
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
    if PARTIAL:  # split-K: this split's scaled partial sum
        _store_partial(y_ptr, acc, offs_m, offs_n, M, N)
    else:
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
    num_stages, SPLIT_K; BLOCK_K must stay 128) overrides the M-bucket table; `batch_invariant` uses
    one fixed configuration instead of the table (a given `config` still wins).
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
    k_split, splits, out = _split_plan(cfg, M, N, K, y)
    grid = (_cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"]), splits)
    # Without bias, b_ptr gets a read-only stand-in (never y: no argument aliases the written output).
    _block_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, out,
        M, N, K, k_split,
        x_q.stride(0), x_q.stride(1), x_s.stride(0), x_s.stride(1),
        w_q.stride(0), w_q.stride(1), w_s.stride(0), w_s.stride(1),
        y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        _reduce_splits(out, w_s, 0, w_s, 0, bias, y, scaled=False)
    return y


# ----------------------------------------------------------------------------------------------------
# 2. Row-scaled FP8 GEMM: per-token x per-channel (or tensor) scales
# ----------------------------------------------------------------------------------------------------

_ROWWISE_TABLE = _BLOCK_TABLE
_ROWWISE_INVARIANT_CONFIG = _INVARIANT_CONFIG


@triton.jit(do_not_specialize=["M"])
def _rowwise_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, one,
                         M, N, K, K_SPLIT,
                         stride_xm, stride_xk, stride_xs, stride_wn, stride_wk, stride_ws,
                         stride_ym, stride_yn,
                         HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _grouped_pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_begin + offs_k[None, :]) * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + (k_begin + offs_k[:, None]) * stride_wk + rn[None, :] * stride_wn  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_left = k_end - k0
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        # Each K-block's product is promoted into a full float32 accumulator: Hopper's FP8 MMA keeps
        # fewer bits while it accumulates, and `acc += dot` would be folded into the MMA's own
        # accumulator. Multiplying by the run-time 1.0 `one` keeps the two apart.
        acc += tl.dot(a, b) * tl.cast(one, tl.float32)  # (torch.compile passes the float as fp64)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if PARTIAL:  # split-K: the unscaled partial sum (the reduction applies the row scales)
        _store_partial(y_ptr, acc, offs_m, offs_n, M, N)
    else:
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
    or 0-d / [1]. `batch_invariant` uses one fixed configuration for every M; `config` (BLOCK_M,
    BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K) overrides.
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
    k_split, splits, out = _split_plan(cfg, M, N, K, y)
    grid = (_cdiv(M, cfg["BLOCK_M"]) * _cdiv(N, cfg["BLOCK_N"]), splits)
    _rowwise_gemm_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else w_s, out, 1.0,
        M, N, K, k_split,
        x_q.stride(0), x_q.stride(1), sx, w_q.stride(0), w_q.stride(1), sw,
        y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, PARTIAL=splits > 1, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        _reduce_splits(out, x_s, sx, w_s, sw, bias, y, scaled=True)
    return y


# ----------------------------------------------------------------------------------------------------
# 3. Weight-only FP8 (W8A16) for GPUs without FP8 tensor cores (sm_80 / sm_86)
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

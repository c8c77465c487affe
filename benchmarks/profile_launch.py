"""Where does the per-call host time of a small-M FP8 linear go? Wall-clock per call (host-bound
at decode sizes) for each layer of the call stack, and a cProfile of the full Fp8Linear call."""

import cProfile
import io
import pstats
import time

import torch

from fp8now import Fp8Config, Fp8Linear
from fp8now.kernels import triton_fp8, triton_gemm, triton_quant


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    n, k, m = 4096, 4096, 1
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme="channel"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, s = layer.weight, layer.weight_scale
    rows = {
        "F.linear bf16": lambda: torch.nn.functional.linear(x, lin.weight),
        "empty((1,4096))": lambda: torch.empty((m, n), device="cuda", dtype=torch.bfloat16),
        "quantize_act_token": lambda: triton_quant.quantize_act_token(x),
        "rowwise_gemm (split-K)": lambda: triton_gemm.rowwise_gemm(*triton_quant.quantize_act_token(x), w, s),
        "triton_fp8.linear": lambda: triton_fp8.linear(x, w, s, None, layer.scheme, "token"),
        "Fp8Linear(x)": lambda: layer(x),
    }
    for name, fn in rows.items():
        print(f"{name:24s} {per_call_us(fn):8.1f} us/call", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        layer(x)
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(22)
    print(buf.getvalue()[-6000:])


if __name__ == "__main__":
    main()

"""GPU checks of triton_launch's shortcut: after a key's first launch, the kernels run through the kept
compiled kernel (triton's own launch path is not entered again), with the bytes of triton's path on
fresh inputs, a new key for a misaligned tensor, the caller's current stream, and triton's path
whenever launch hooks are set."""

import contextlib

import pytest
import torch

from fp8now.kernels import triton_decode, triton_gemm, triton_launch, triton_quant
from fp8_oracle import varied

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (run through the device tool)")]


def fresh(shape, seed, dtype=torch.bfloat16):
    return varied(shape, torch.float32, seed=seed, spread=3).cuda().to(dtype)


@contextlib.contextmanager
def shortcut(on: bool):
    before = triton_launch.ENABLED
    triton_launch.ENABLED = on
    try:
        yield
    finally:
        triton_launch.ENABLED = before


@contextlib.contextmanager
def triton_entries(*kernels):
    """Counts the calls that enter triton's own launch path (JITFunction.run) of `kernels`."""
    seen = []
    hook = lambda *a, **k: seen.append(1)  # noqa: E731
    for kern in kernels:
        kern.pre_run_hooks.append(hook)
    try:
        yield seen
    finally:
        for kern in kernels:
            kern.pre_run_hooks.remove(hook)


def weights(n, k, kind):
    w = varied((n, k), torch.float32, seed=n + k, spread=4).cuda().to(torch.bfloat16) * 0.02
    return triton_quant.quantize_weight(w, kind)


def _decode_channel(x, w_q, w_s, counters):
    x_q, x_s = triton_quant.quantize_act_token(x)
    return (triton_decode.decode_linear(x_q, w_q, w_s, "channel", "token", x_scale=x_s, counters=counters),)


# name -> (call(x) -> tuple of tensors, K, the kernels it launches)
def _cases():
    n, k = 512, 1024
    wc, sc = weights(n, k, "channel")
    wb, sb = weights(n, k, "block")
    cnt = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
    tq, tg, td = triton_quant, triton_gemm, triton_decode
    return {
        "act token": (lambda x: tq.quantize_act_token(x), [tq._row_quant_kernel]),
        "act group col": (lambda x: tq.quantize_act_group(x, col_major=True), [tq._group_quant_kernel]),
        "act tensor": (lambda x: tq.quantize_act_tensor(x), [tq._amax_kernel, tq._tensor_quant_kernel]),
        "weight block": (lambda x: tq.quantize_weight(x, "block"), [tq._block_quant_kernel]),
        "decode channel": (lambda x: _decode_channel(x[:4], wc, sc, cnt), [td._decode_kernel]),
        "decode block fused": (lambda x: (td.decode_linear(x[:1], wb, sb, "block", "group", counters=cnt),),
                               [td._decode_kernel]),
        "rowwise gemm": (lambda x: (tg.rowwise_gemm(*tq.quantize_act_token(x), wc, sc),),
                         [tg._rowwise_gemm_kernel]),
        "block gemm": (lambda x: (tg.block_gemm(*tq.quantize_act_group(x), wb, sb),),
                       [tg._block_gemm_kernel]),
    }, k


@pytest.mark.parametrize("name", ["act token", "act group col", "act tensor", "weight block",
                                  "decode channel", "decode block fused", "rowwise gemm", "block gemm"])
def test_shortcut_launches_give_the_bytes_of_tritons_path(name):
    cases, k = _cases()
    call, kernels = cases[name]
    m = 48
    with shortcut(True):
        call(fresh((m, k), seed=1))        # the first launch of this key may go through triton
        xs = [fresh((m, k), seed=s) for s in (2, 3)]
        with triton_entries(*kernels) as entered:
            got = [call(x) for x in xs]
            torch.cuda.synchronize()
        assert not entered, f"{name}: later launches went through triton's launch path"
    with shortcut(False), triton_entries(*kernels) as entered:
        want = [call(x) for x in xs]
        assert entered, "the switched-off shortcut must use triton's path"
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), name


def test_a_misaligned_tensor_is_a_new_key():
    k = 1024
    with shortcut(True):
        triton_quant.quantize_act_token(fresh((8, k), seed=4))
        buf = fresh((1, 8 * k + 1), seed=5).view(-1)
        x_odd = buf[1:].view(8, k)                  # 2-byte aligned address
        assert x_odd.data_ptr() % 16
        with triton_entries(triton_quant._row_quant_kernel) as entered:
            q, s = triton_quant.quantize_act_token(x_odd)
        assert entered, "a misaligned input must not reuse the aligned specialization"
    with shortcut(False):
        q0, s0 = triton_quant.quantize_act_token(x_odd.clone())
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)


def test_launches_on_the_current_stream():
    m, k = 64, 4096
    x = fresh((m, k), seed=6)
    with shortcut(True):
        triton_quant.quantize_act_token(x)          # keep the key
        want = triton_quant.quantize_act_token(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        y = torch.zeros_like(x)
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e8))              # the copy below lands well after the launch call
            y.copy_(x)
            q, s = triton_quant.quantize_act_token(y)
        side.synchronize()
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])


def test_launch_hooks_send_every_launch_through_triton():
    hooks = triton_launch._HOOKS
    calls = []
    x = fresh((16, 2048), seed=7)
    with shortcut(True):
        triton_quant.quantize_act_token(x)
        hook = lambda *a: calls.append(1)  # noqa: E731
        chain = hooks.launch_enter_hook
        if hasattr(chain, "add"):          # newer triton: a HookChain
            chain.add(hook)
        else:
            hooks.launch_enter_hook = hook
        try:
            for _ in range(3):
                triton_quant.quantize_act_token(x)
        finally:
            if hasattr(chain, "add"):
                chain.remove(hook)
            else:
                hooks.launch_enter_hook = chain
    assert len(calls) == 3


def test_keys_are_kept():
    x = fresh((16, 2048), seed=8)
    with shortcut(True):
        for _ in range(2):
            triton_quant.quantize_act_token(x)
    assert triton_launch.kept() >= 1

"""The launch shortcut's key (fp8now.kernels.triton_launch) separates every argument property that
triton specializes a compiled kernel on; on the CPU the shortcut itself stays off (interpreter)."""

import torch

from fp8now.kernels import triton_launch as tl


def test_tensor_keys_separate_dtype_and_16_byte_alignment():
    buf = torch.randn(64, dtype=torch.float32)
    assert tl._arg_key(buf) == tl._arg_key(torch.randn(8))
    assert tl._arg_key(buf) != tl._arg_key(buf[1:])            # 4-byte offset: not 16-aligned
    assert tl._arg_key(buf[4:]) == tl._arg_key(buf)            # 16-byte offset: aligned
    assert tl._arg_key(buf) != tl._arg_key(buf.to(torch.bfloat16))


def test_integer_keys_separate_one_divisibility_and_width():
    k = tl._arg_key
    assert k(1) != k(2) and k(1) != k(17)
    assert k(16) == k(4096) and k(16) != k(24)
    assert k(2 ** 31 - 16) != k(2 ** 31) and k(2 ** 31) != k(2 ** 63)
    assert k(True) != k(1) and k(False) != k(0)


def test_the_shortcut_is_off_under_the_interpreter():
    if tl.INTERPRETED:            # CPU runs (conftest sets TRITON_INTERPRET=1 without a GPU)
        assert not tl.ENABLED
    else:
        assert torch.cuda.is_available()

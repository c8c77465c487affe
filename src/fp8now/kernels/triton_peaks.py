"""max |x| of many tensors in a few launches (a reload's check of every tensor before its first write): a work
list of (address, length, tensor index) chunks, one program per chunk, an integer atomic max per tensor of the
bits of |x| (NaN above inf, as `triton_jit.abs_bits`), so a NaN anywhere gives NaN and an infinity inf.

One launch per dtype for any number of tensors, where `torch.aminmax` costs about three launches per tensor:
a per-expert checkpoint (Qwen3-30B-A3B: 18,432 expert tensors) is checked in a handful of launches.
"""

from __future__ import annotations

import torch

from .triton_jit import abs_bits
from .triton_support import TRITON_ERROR, device_reason, interpreted, tl, triton

CHUNK = 1 << 16   # elements per program
BLOCK = 2048      # elements per step of a program
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _peaks_kernel(work_ptr, bits_ptr, WORKS, DTYPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.program_id(0)
    addr = tl.load(work_ptr + w)
    n = tl.load(work_ptr + WORKS + w)
    t = tl.load(work_ptr + 2 * WORKS + w)
    x_ptr = addr.to(tl.pointer_type(DTYPE))
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, abs_bits(x))
    tl.atomic_max(bits_ptr + t, tl.max(acc, axis=0))


def available(device: torch.device | str | None = None) -> str | None:
    """None when the kernel runs on `device` (any CUDA GPU Triton supports; CPU tensors under TRITON_INTERPRET=1),
    otherwise why not."""
    return device_reason(device, interpreted(_peaks_kernel), TRITON_ERROR, (7, 0), "the peaks kernel")


def usable(t: torch.Tensor) -> bool:
    """Can `peaks` take `t` (a contiguous bf16/fp16/float32 tensor)?"""
    return t.dtype in DTYPES and t.is_contiguous()


def _works(tensors: list[torch.Tensor], index: list[int]) -> torch.Tensor:
    """int64 `[3, chunks]` on the host: the address, the length and the tensor index of every CHUNK-element piece
    of `tensors` (built with a few vector ops, whatever the number of tensors)."""
    base = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    numel = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    size = torch.tensor([t.element_size() for t in tensors], dtype=torch.int64)
    count = (numel + CHUNK - 1) // CHUNK
    which = torch.repeat_interleave(torch.arange(len(tensors)), count)
    first = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    start = (torch.arange(int(count.sum())) - first) * CHUNK
    return torch.stack([base[which] + start * size[which], torch.clamp(numel[which] - start, max=CHUNK),
                        torch.tensor(index, dtype=torch.int64)[which]])


def peaks(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 `[len(tensors)]` on their (one) device: max |t| of each (NaN if it holds NaN, inf if an infinity;
    0 for an empty one). Every tensor must be `usable`; one launch per dtype present."""
    if not tensors:
        raise ValueError("peaks: no tensors")
    device = tensors[0].device
    bits = torch.zeros(len(tensors), dtype=torch.int32, device=device)
    for dtype in DTYPES:
        index = [i for i, t in enumerate(tensors) if t.dtype == dtype and t.numel()]
        if not index:
            continue
        chosen = [tensors[i] for i in index]
        if any(t.device != device or not t.is_contiguous() for t in chosen):
            raise ValueError("peaks: every tensor must be contiguous and on one device")
        works = _works(chosen, index).to(device)
        count = works.shape[1]
        kind = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
        _peaks_kernel[(count,)](works, bits, count, DTYPE=kind, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
    return bits.view(torch.float32)

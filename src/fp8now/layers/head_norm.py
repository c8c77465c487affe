"""Qwen3's per-head RMSNorms (`q_norm`, `k_norm`: each head's D values of q_proj's and k_proj's output) as one
Triton kernel each, where the attention's q_proj runs on the triton backend.

Why: transformers' RMSNorm is eight elementwise launches (the cast to float32, the square, the mean, + eps,
rsqrt, the product, the cast back, the weight's product), and a decode step of Qwen3 runs two per layer: 14
launches a layer more than one kernel each. On an H100 the Qwen3-30B-A3B preset's one-token step (8 layers) went
from 1.80 to 1.56 ms with them (1.47x -> 1.71x bf16, two calls; the "other" kernels 834 -> 632 µs; BENCHMARKS.md
"Whole model"). The kernel is `kernels.triton_norm.rms_norm` without FP8 output (no linear reads these rows):
transformers' formula and rounding points, its own sum of squares, so a bf16 output can differ by one rounding
step in rare elements, as the producers' norm's (tests/test_head_norm.py).

When: the q_proj's table has `head_norm_kernel` and the producers' RMSNorm (`"rmsnorm"` in
`Table.producer_kernels`), the q_proj is on the triton backend on the input's device, and no torch.compile
traces the call (inductor fuses transformers' ops itself); else transformers' own forward. The module keeps the
norm's `weight` parameter under the same name, so state dicts, exports and reloads see the model they saw.
Installed at load beside the producers (`shared_input.share_inputs`); idempotent; not for models split by tensor
parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import triton_norm
from .linear import Fp8Linear
from .producers import FEEDABLE_BACKEND, KernelRMSNorm, kernel_runs

HEAD_NORM_CLASSES = ("Qwen3RMSNorm", "Qwen3MoeRMSNorm")   # weight * norm(x) over the last dim (head_dim)
HEAD_NORMS = (("q_norm", "q_proj"), ("k_norm", "k_proj"))   # (norm, the linear whose output it reads)


class HeadRMSNorm(KernelRMSNorm):
    """An RMSNorm over the last dim (the same `weight`) as one kernel while `owner`'s table has the RMSNorm
    producer; transformers' forward otherwise."""

    def __init__(self, norm: nn.Module, owner: Fp8Linear) -> None:
        super().__init__(norm)
        self.owner = [owner]   # a plain list: the linear is registered in the attention module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self.owner[0]
        if (not (kernel_runs("rmsnorm", owner, x) and owner.table.head_norm_kernel)
                or triton_norm.unfit(x, self.weight) is not None):
            return self.original_forward(self, x)
        return self.kernel(x)[0]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, as {self.original}, one kernel"


def install(model: nn.Module) -> int:
    """Put a HeadRMSNorm in place of each per-head norm of HEAD_NORM_CLASSES whose linear is an FP8 linear on the
    triton backend; returns the number replaced. Idempotent."""
    if getattr(model, "_fp8now_tp", None) is not None:   # split layers run their own forwards (tp_forward)
        return 0
    replaced = 0
    for block in list(model.modules()):
        for norm_name, linear_name in HEAD_NORMS:
            norm, linear = getattr(block, norm_name, None), getattr(block, linear_name, None)
            if (type(norm).__name__ in HEAD_NORM_CLASSES and isinstance(linear, Fp8Linear)
                    and linear.backend == FEEDABLE_BACKEND):
                setattr(block, norm_name, HeadRMSNorm(norm, linear))
                replaced += 1
    return replaced

"""The ops in front of FP8 linears as one Triton kernel each, writing the FP8 input of the linears too
(what vLLM's compile passes fuse): RMSNorm -> q/k/v and gate/up, SiLU(gate) * up -> down_proj.

On the triton backend every linear quantizes its own input: q, k and v each read the normalized
activation and quantize it again, after a norm of several eager torch ops. `install` puts, in each
decoder layer of a known family (NORM_CLASSES, MLP_CLASSES, NORM_FEEDS), a `FusedRMSNorm` in place of
the norm and a `FusedGatedMLP` in place of the MLP. Per call:
- the norm runs as one kernel (`kernels.triton_norm`) that writes its bf16 output y and, where the
  plan of one of the linears it feeds says so (`plan.Table.producer_quant`), y's FP8 bytes and scales.
  It leaves those in a `Handoff`; each of those linears reads them when its input *is* that y (and,
  outside torch.compile, unchanged since), so a linear in `ignore`, or any other reader of y, simply
  reads y. The handoff is emptied when the module reading the norm (self_attn / mlp) returns.
- the MLP runs gate and up, then one kernel (`kernels.triton_silu_mul`) that writes either SiLU(g) * u
  or, when down_proj's plan reads a producer's bytes, only their FP8 bytes and scales.
The bytes are those each linear would have made of the kernel's bf16 output (tests/test_producers.py).
Where the kernels cannot run (another backend, dtype or device; a table without the producer in
`producer_kernels`; under torch.compile, which fuses the quantizer itself) the modules run the original
transformers forward. Installed once per model at
load (`shared_input.share_inputs`); idempotent; not for models split by tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import triton_norm
from ..kernels.triton_silu_mul import silu_mul
from . import stacked
from .linear import Fp8Linear

NORM_CLASSES = ("LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm",    # weight * norm(x)
                "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm")   # (MoE: the attention's input norm)
MLP_CLASSES = ("LlamaMLP", "Qwen3MLP", "Qwen2MLP", "MistralMLP")                   # down(act(gate) * up)
SILU_CLASSES = ("SiLU", "SiLUActivation")
# (a decoder layer's norm, the module reading its output, that module's linears reading it)
NORM_FEEDS = (("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
              ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj")))
FEEDABLE_BACKEND = "triton"   # the backend with `linear_fp8`: it reads a producer's bytes


class Handoff:
    """The norm output y a kernel last wrote and its FP8 bytes + `act` scales, until the reader returns."""

    __slots__ = ("y", "version", "act", "fp8")

    def __init__(self) -> None:
        self.y = self.version = self.act = self.fp8 = None

    def put(self, y: torch.Tensor, act: str, q: torch.Tensor, s: torch.Tensor) -> None:
        self.y, self.act, self.fp8 = y, act, (q, s)
        self.version = None if torch.compiler.is_compiling() or y.is_inference() else y._version

    def take(self, x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, s) if `x` is the y they were made of, unchanged, and their scales are `act`'s; else None."""
        if self.y is None or x is not self.y or act != self.act:
            return None
        if self.version is not None and x._version != self.version:
            return None
        return self.fp8

    def clear(self, *_) -> None:
        self.y = self.version = self.act = self.fp8 = None


def kernel_runs(producer: str, consumer: Fp8Linear, x: torch.Tensor) -> bool:
    """Does `producer` run as its kernel in front of `consumer` on input x: its table says so, it is on the
    triton backend on x's device (where the Triton kernels run: the backend checked it), and no torch.compile
    traces it (there inductor fuses the per-token quantizer into transformers' own ops, `Table.compiled_quant`;
    a compile of the producers' kernels failed in Inductor 2.11 on the H100, where the benchmark's step ran under
    inference mode, itself a cause of that failure: pytorch/pytorch#180823; BENCHMARKS.md "Decode fusions")?"""
    return (producer in consumer.table.producer_kernels and consumer.backend == FEEDABLE_BACKEND
            and consumer.weight.device == x.device and not torch.compiler.is_compiling())


class KernelRMSNorm(nn.Module):
    """A transformers RMSNorm (weight * norm(x) over the last dim: the same `weight` parameter and epsilon) that
    runs as `triton_norm.rms_norm` where its subclass says the kernel runs, else the original forward."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.original = type(norm).__name__
        self.original_forward = type(norm).forward

    def kernel(self, x: torch.Tensor, act: str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`triton_norm.rms_norm` of x [..., K] as rows: (y shaped like x, FP8 bytes and scales of y for `act`)."""
        x2 = x.reshape(-1, x.shape[-1])
        y, q, s = triton_norm.rms_norm(x2 if x2.stride(-1) == 1 else x2.contiguous(), self.weight,
                                       self.variance_epsilon, act)
        return y.view(x.shape), q, s


class FusedRMSNorm(KernelRMSNorm):
    """A Llama-style RMSNorm (the same `weight` parameter) feeding `consumers` (FP8 linears) through
    `handoff`; the original forward where the kernel cannot run."""

    def __init__(self, norm: nn.Module, consumers: list[Fp8Linear]) -> None:
        super().__init__(norm)
        self.consumers = list(consumers)   # a plain list: they are registered in the module that reads y
        self.handoff = Handoff()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not kernel_runs("rmsnorm", self.consumers[0], x) or triton_norm.unfit(x, self.weight) is not None:
            return self.original_forward(self, x)
        m = x.numel() // x.shape[-1]
        act = None
        for consumer in self.consumers:   # the first that reads the norm's FP8 bytes sets their scales
            path = consumer.planned(m, True)
            if path.quant == "rmsnorm":
                act = path.act
                break
        y, q, s = self.kernel(x, act)
        if act is not None:
            self.handoff.put(y, act, q, s)
        return y

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, as {self.original}, feeds "
                f"{len(self.consumers)} FP8 linears")


class FusedGatedMLP(nn.Module):
    """A Llama-style MLP (the same linears) whose SiLU(gate) * up is one kernel writing down_proj's
    FP8 input where down_proj's plan reads it; the original forward where the kernel cannot run."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn
        self.original = type(mlp).__name__
        self.original_forward = type(mlp).forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        if not kernel_runs("silu-mul", down, x) or x.dtype not in triton_norm.DTYPES:
            return self.original_forward(self, x)
        g, u = self.gate_proj(x), self.up_proj(x)
        g2, u2 = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])
        if g2.dtype != x.dtype or u2.dtype != x.dtype or g2.stride(-1) != 1 or u2.stride(-1) != 1:
            return down(self.act_fn(g) * u)
        path = down.planned(g2.shape[0], True)
        if path.quant != "silu-mul":
            return down(silu_mul(g2, u2).view(g.shape))
        q, s = silu_mul(g2, u2, path.act)
        return down.forward_fp8(q, s, x.dtype).view(*g.shape[:-1], down.out_features)

    def extra_repr(self) -> str:
        return f"as {self.original}, SiLU(gate) * up in one kernel"


def _feedable(layer: nn.Module | None) -> bool:
    """An FP8 linear on the backend that reads producers' bytes (triton), not fed by one yet."""
    return isinstance(layer, Fp8Linear) and layer.backend == FEEDABLE_BACKEND and layer.producer is None


def install(model: nn.Module) -> int:
    """Put FusedGatedMLP / FusedRMSNorm in the decoder layers where FP8 linears on the triton backend
    read their output; returns the number of modules replaced. Idempotent."""
    if getattr(model, "_fp8now_tp", None) is not None:   # split layers run their own forwards (tp_forward)
        return 0
    replaced = 0
    for block in list(model.modules()):
        mlp = getattr(block, "mlp", None)
        if (type(mlp).__name__ in MLP_CLASSES and type(getattr(mlp, "act_fn", None)).__name__ in SILU_CLASSES
                and _feedable(getattr(mlp, "down_proj", None))):
            mlp.down_proj.producer = "silu-mul"
            block.mlp = FusedGatedMLP(mlp)
            replaced += 1
        for norm_name, reader_name, names in NORM_FEEDS:
            norm, reader = getattr(block, norm_name, None), getattr(block, reader_name, None)
            if type(norm).__name__ not in NORM_CLASSES or reader is None:
                continue
            consumers = [c for c in (getattr(reader, n, None) for n in names) if _feedable(c)]
            if not consumers:
                continue
            fused = FusedRMSNorm(norm, consumers)
            for c in consumers:
                c.producer, c.input_handoff = "rmsnorm", fused.handoff
            reader.register_forward_hook(fused.handoff.clear, always_call=True)
            group = stacked.stack(consumers)   # one buffer per tensor: one-row GEMVs in one launch
            if group is not None:
                reader.register_forward_hook(group.clear, always_call=True)
            setattr(block, norm_name, fused)
            replaced += 1
    return replaced

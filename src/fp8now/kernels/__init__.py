"""Backend dispatch: one explicit table picks a backend per (device class, scheme); `plan.plan` then
picks each call's path.

A backend is one module (named in MODULES, listed in TABLE, planned in `plan.PLANNERS`) with
- `available(device, scheme, act_kind, n, k, batch_invariant) -> str | None`: None, or why it cannot run;
- `linear(x, weights: plan.Weights, path: plan.Path) -> y`: runs the path `plan.plan` chose;
- optionally `workspace(device, scheme, act_kind, n, k, batch_invariant, table) -> Tensor | None`: the
  scratch its calls along the plans of `table` (a `plan.Table`; None: the device class's) need,
  allocated once per layer (`Weights.workspace`);
- optionally `GRAPHED = True`: its small-M calls are host-bound launches worth replaying from CUDA graphs.
Nothing falls back silently: the choice is stored on the layer and reported.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from .. import numerics
from . import llmc
from ..config import Scheme

# Backend name -> module (imported on first use, so missing optional packages only matter when chosen).
MODULES: dict[str, str] = {
    "reference": "fp8now.kernels.reference",
    "cpu": "fp8now.kernels.cpu",
    "torch": "fp8now.kernels.torch_mm",
    "triton": "fp8now.kernels.triton_fp8",
    "triton-w8a16": "fp8now.kernels.triton_w8a16",
}

# (device class, scheme) -> candidates, best first. Device classes: "cuda-fp8" (compute capability
# >= 8.9, FP8 tensor cores), "cuda" (older GPUs), "cpu".
TABLE: dict[tuple[str, Scheme], tuple[str, ...]] = {
    ("cuda-fp8", Scheme.TENSOR): ("triton", "torch", "reference"),
    ("cuda-fp8", Scheme.CHANNEL): ("triton", "torch", "reference"),
    ("cuda-fp8", Scheme.BLOCK): ("triton", "torch", "reference"),
    # No FP8 tensor cores: weight-only FP8; channel refuses it (it would drop activation quantization).
    ("cuda", Scheme.TENSOR): ("triton-w8a16", "reference"),
    ("cuda", Scheme.CHANNEL): ("reference",),
    ("cuda", Scheme.BLOCK): ("triton-w8a16", "reference"),
    # CPU: operands widened to bf16 for oneDNN's bf16 GEMM (`cpu`); the exact float64 `reference`
    # (the test oracle) for other device types, which `cpu` refuses.
    ("cpu", Scheme.TENSOR): ("cpu", "reference"),
    ("cpu", Scheme.CHANNEL): ("cpu", "reference"),
    ("cpu", Scheme.BLOCK): ("cpu", "reference"),
}


# Backends without fast FP8 accumulation (Fp8Config.fast_accum) -> why; the torch backend has it on GPUs only.
NO_FAST_ACCUM: dict[str, str] = {
    "reference": "the exact float64 product (the test oracle) has no fast accumulation",
    "cpu": "oneDNN's bf16 GEMM accumulates in float32; there is no fast FP8 accumulation on a CPU",
    "triton-w8a16": "a bf16/fp16 GEMM on GPUs without FP8 tensor cores: no FP8 accumulator to run fast",
}
NO_FAST_ACCUM_CPU = "torch's CPU _scaled_mm accumulates in float32; fast accumulation is a cuBLAS mode"


def fast_accum_unfit(name: str, dclass: str) -> str | None:
    """None if backend `name` on a `dclass` device has fast FP8 accumulation, else why not."""
    if name == "torch" and dclass == "cpu":
        return NO_FAST_ACCUM_CPU
    return NO_FAST_ACCUM.get(name)


def device_class(device: torch.device) -> str:
    """"cuda-fp8", "cuda" or "cpu" (other device types are treated like CPU: reference only)."""
    if device.type == "cuda":
        return "cuda-fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "cuda"
    return "cpu"


def backend_module(name: str) -> ModuleType:
    """The module implementing backend `name`."""
    if name not in MODULES:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(MODULES)}")
    return importlib.import_module(MODULES[name])


def _reason(name: str, device, scheme, act_kind, n, k, batch_invariant, fast_accum) -> str | None:
    try:
        module = backend_module(name)
    except ImportError as e:
        return f"cannot import ({e})"
    if fast_accum and (why := fast_accum_unfit(name, device_class(device))) is not None:
        return f"fast_accum=True: {why}"
    return module.available(device, scheme, act_kind, n, k, batch_invariant)


def pick_backend(device: torch.device | str, scheme: Scheme, act_kind: str, n: int, k: int,
                 forced: str = "auto", batch_invariant: bool = False, fast_accum: bool = False) -> str:
    """Name of the backend for a layer `[N, K]` on `device`; raises listing every rejected candidate."""
    device = torch.device(device)
    scheme = Scheme.parse(scheme)
    dclass = device_class(device)
    candidates = TABLE[(dclass, scheme)] if forced == "auto" else (forced,)
    reasons = []
    for name in candidates:
        why = _reason(name, device, scheme, act_kind, n, k, batch_invariant, fast_accum)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    what = f"scheme {scheme.value!r} (activation {act_kind}) on {device} ({dclass}) for N={n}, K={k}"
    if batch_invariant:
        what += " with batch_invariant=True"
    if fast_accum:
        what += " with fast_accum=True (a GPU with FP8 tensor cores, or fast_accum=False)"
    raise RuntimeError(f"no FP8 backend fits {what}; rejected: " + "; ".join(reasons)
                       + ". Choose another backend= or scheme, or ignore this layer.")


def workspace(backend: str, device: torch.device | str, scheme: Scheme, act_kind: str, n: int, k: int,
              batch_invariant: bool = False, table=None) -> torch.Tensor | None:
    """The scratch a layer `[N, K]` keeps for `backend`'s calls (its `workspace` hook), or None."""
    hook = getattr(backend_module(backend), "workspace", None)
    return None if hook is None else hook(torch.device(device), scheme, act_kind, n, k, batch_invariant, table)


def quantize_weight(w: torch.Tensor, scheme: Scheme, name: str | None = None, weight_numerics: str = "spec",
                    amax: torch.Tensor | None = None, checked: bool = False,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight quantization at load: the Triton kernel on FP8-capable GPUs (memory speed, same bytes
    as `numerics.quantize_weight`), the chunked torch implementation elsewhere. Other `weight_numerics`
    (llm-compressor's) run `kernels.llmc` with torch ops on every device; `amax` (a TP group's MAX,
    SPEC §6) runs the torch implementation of the chosen numerics. `checked`: the caller checked w for
    NaN/Inf already (a load checks many weights with one host sync). `out`: (bytes, float32 scales) the
    Triton kernel writes in place (`triton_wquant.quantize_weight`); the other paths return new tensors (the
    caller copies them: compare data_ptr)."""
    if weight_numerics != "spec":
        return llmc.quantize_weight(w, scheme, weight_numerics, name=name, amax=amax)
    if amax is not None:
        return numerics.quantize_weight(w, scheme, name=name, amax=amax)
    if triton_weights(w.device):
        from . import triton_wquant
        if not checked and not bool(triton_wquant.weight_all_finite(w)):  # one sync per layer
            raise numerics.nonfinite_error(tuple(w.shape), name)
        return triton_wquant.quantize_weight(w, scheme.value, out=out)
    return numerics.quantize_weight(w, scheme, name=name)


def triton_weights(device: torch.device) -> bool:
    """Do the Triton weight kernels (the load's quantizer, its error pass) run on `device`: an FP8 GPU with Triton?"""
    if device.type != "cuda" or device_class(device) != "cuda-fp8":
        return False
    from . import triton_quant   # importable without triton (`available` then says why)
    return triton_quant.available(device) is None


def writes_in_place(device: torch.device, weight_numerics: str = "spec") -> bool:
    """Does `quantize_weight(..., out=)` on `device` write `out` (the Triton path), stacked experts included?"""
    return weight_numerics == "spec" and triton_weights(device)

"""Which backend runs a layer of routed experts (`Fp8Experts`): the candidates per device class, best
first, and why a candidate cannot run a given layer."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu, device_class
from ..kernels.plan import moe_plan

# Backends that run experts: the Triton grouped FP8 GEMMs (FP8 GPUs; `kernels.triton_moe`), bf16
# working copies and oneDNN GEMMs per expert (CPU; `moe_cpu`, the CPU default, as SPEC §9 has it for
# every layer), and the exact float64 `reference` loop over experts (anywhere). Device class ->
# candidates, best first. A layer split over a tensor-parallel group computes its expert GEMMs in
# tp_moe_forward, which runs SPLIT_BACKENDS only.
EXPERT_BACKENDS = ("auto", "triton", "cpu", "reference")
EXPERT_TABLE = {"cuda-fp8": ("triton", "reference"), "cuda": ("reference",), "cpu": ("cpu", "reference")}
SPLIT_BACKENDS = ("cpu", "reference")
# routed slots per call the report shows a plan for, as tokens of top-PLAN_TOP_K: a decode token, a decode batch
# of 64, a 2048-token prefill (the plan depends on the tokens, the slots and E)
PLAN_SLOTS = (8, 512, 16384)
PLAN_TOP_K = 8


def expert_backend_reason(name: str, device: torch.device, experts: nn.Module) -> str | None:
    """None if backend `name` runs `experts` on `device`, else why not."""
    if experts.split and name not in SPLIT_BACKENDS:
        return f"a tensor-parallel split of the experts runs on {' or '.join(SPLIT_BACKENDS)} only"
    if name == "reference":
        return None
    if name == "cpu":
        return cpu.available(device, experts.scheme, experts.act_kind, 0, 0, experts.batch_invariant)
    from ..kernels import triton_moe   # importable without triton: `available` then says why
    return triton_moe.available(device, experts.gate_kind, experts.act_fn, experts.h_pad, experts.i_pad)


def pick_expert_backend(device: torch.device, experts: nn.Module, forced: str = "auto") -> str:
    """The experts backend on `device` (`forced` unless "auto"); raises listing every rejected candidate."""
    candidates = EXPERT_TABLE[device_class(device)] if forced == "auto" else (forced,)
    reasons = []
    for name in candidates:
        why = expert_backend_reason(name, device, experts)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    raise RuntimeError(f"{experts.name or 'experts'}: no experts backend fits on {device}; rejected: "
                       + "; ".join(reasons) + ". Choose another backend= or ignore the experts.")


def expert_workspace(experts: nn.Module) -> torch.Tensor | None:
    """The scratch a loaded layer keeps for its backend's calls (the triton backend's combine counters,
    zero between calls), or None. The one it has when that fits (a reload keeps its address, so that
    captured CUDA graphs stay valid)."""
    if experts.backend != "triton":
        return None
    from ..kernels.triton_moe_direct import direct_counters
    fresh = direct_counters(experts.h_pad, experts.w13.device)
    old = experts.workspace
    if old is not None and (old.device, old.dtype, old.shape) == (fresh.device, fresh.dtype, fresh.shape):
        return old
    return fresh


def expert_plan_names(experts: nn.Module) -> dict[str, str]:
    """The triton backend's path at each of PLAN_SLOTS routed slots per call (tokens of top-PLAN_TOP_K), or {}
    for a backend without a per-call plan."""
    if experts.backend != "triton":
        return {}
    dclass = device_class(experts.w13.device)
    return {str(s): moe_plan(experts.scheme, s // PLAN_TOP_K, PLAN_TOP_K, experts.num_experts, dclass,
                             experts.batch_invariant,
                             fast_accum=experts.fast_accum).name for s in PLAN_SLOTS}

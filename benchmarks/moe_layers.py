"""The MoE experts layers bench_moe.py times: transformers' experts module of a family (with any of its
experts implementations), a plain bf16 `torch._grouped_mm` implementation, fp8now's `Fp8Experts` built from
the same weights, and the router that feeds them."""

from __future__ import annotations

import copy
import sys

import torch


def family_experts(family: str, e: int, k: int, h: int, i: int) -> tuple[torch.nn.Module, str]:
    """(the family's experts module of a one-layer model built on the meta device, the experts
    implementation transformers chose for that model by default)."""
    from transformers import MixtralConfig, MixtralModel, Qwen3MoeConfig, Qwen3MoeModel
    dims = dict(vocab_size=32, hidden_size=h, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, num_experts_per_tok=k)
    if family == "qwen3_moe":
        config, model_cls = Qwen3MoeConfig(num_experts=e, moe_intermediate_size=i, **dims), Qwen3MoeModel
    else:
        config, model_cls = MixtralConfig(num_local_experts=e, intermediate_size=i, **dims), MixtralModel
    with torch.device("meta"):
        model = model_cls(config)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    return experts, getattr(model.config, "_experts_implementation", None) or "eager"


def other_implementations(default: str) -> list[str]:
    """The experts implementations transformers registers (and "eager"), but the default."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        print(f"transformers offers no other experts implementations here ({e})", file=sys.stderr)
        return []
    return [name for name in ["eager", *ALL_EXPERTS_FUNCTIONS.keys()] if name != default]


def with_implementation(experts: torch.nn.Module, impl: str) -> torch.nn.Module:
    """The same module (same weight tensors) dispatching to experts implementation `impl`."""
    out = copy.copy(experts)
    out.config = copy.deepcopy(experts.config)
    out.config._experts_implementation = impl
    return out


def route(x: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index [T, k], top_k_weights [T, k] in x.dtype) of x [T, H] under router [E, H]."""
    probs = torch.softmax((x @ router.t()).float(), dim=-1)
    weights, index = torch.topk(probs, k, dim=-1)
    return index, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


def grouped_mm_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """Routed experts with two bf16 `torch._grouped_mm` calls: x [T, H], index / weights [T, k],
    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] -> [T, H]. No host sync (graph-capturable)."""
    t, k = index.shape
    e = w13.shape[0]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)                               # slots grouped by expert
    counts = torch.histc(flat.float(), bins=e, min=0, max=e - 1)          # bincount would sync the host
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [T*k, H]
    out = torch.empty_like(y)
    out[order] = y
    return (out.view(t, k, -1).float() * weights.unsqueeze(-1).float()).sum(dim=1).to(x.dtype)


def randn(shape: tuple[int, ...], g: torch.Generator, std: float) -> torch.Tensor:
    """bf16 normal values of standard deviation `std` on the generator's device."""
    return (torch.randn(shape, generator=g, device=g.device) * std).to(torch.bfloat16)


def materialized(proto: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> torch.nn.Module:
    """A copy of the meta experts module `proto` holding w13 [E, 2I, H] and w2 [E, H, I] as its weights."""
    m = copy.copy(proto)
    m._parameters = dict(proto._parameters)
    m.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    m.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return m


def implementations(experts: list, others: list[str], schemes) -> dict:
    """impl -> (its copies, or a function building them; call(copy, x, index, weights)); every copy a
    module owning its tensors."""
    from fp8now import Fp8Config, Fp8Experts
    impls = {"bf16-transformers": (experts, lambda m, x, i, w: m(x, i, w))}
    for name in others:
        impls[f"bf16-transformers-{name}"] = ([with_implementation(m, name) for m in experts],
                                              lambda m, x, i, w: m(x, i, w))
    impls["bf16-grouped_mm"] = (experts, lambda m, x, i, w: grouped_mm_experts(x, i, w, m.gate_up_proj,
                                                                               m.down_proj))
    for scheme in schemes:
        def build(scheme=scheme):
            out = []
            for m in experts:
                e, two_i, h = m.gate_up_proj.shape
                layer = Fp8Experts(e, h, two_i // 2, Fp8Config(scheme=scheme), act_fn=m.act_fn,
                                   device=m.gate_up_proj.device, name=f"{type(m).__name__}[{scheme}]")
                layer.load_(m.gate_up_proj, m.down_proj)
                out.append(layer)
            return out
        impls[f"fp8now-{scheme}"] = (build, lambda m, x, i, w: m(x, i, w))
    return impls

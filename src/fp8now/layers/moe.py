"""Fp8Experts: the routed experts of a MoE layer with FP8 weights, one scale set per expert (SPEC §3).

Weights are stacked as `w13 [E, 2I, H]` (gate rows, then up rows) and `w2 [E, H, I]`. With the block
scheme, H and I are padded with zeros to multiples of 128 (each half of w13 separately), so that a
128-row tile never mixes gate and up rows and any I (e.g. 192) works; the padding changes no real
byte or scale. Expert inputs are quantized per token (tensor, channel) or per 1x128 group (block),
so a token's output never depends on the other tokens of the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Fp8Config, Scheme
from .decode_graphs import DecodeGraphs
from .finite import check_experts_finite
from . import moe_cpu
from ..kernels import cpu, cpu_wquant, quantize_weight, writes_in_place
from ..kernels.reference import exact_matmul
from .moe_rules import combine, expert_act_kind
from .weights import check_float_weight, keep_fp8_on_apply, weight_scale_shape
from .moe_backends import EXPERT_BACKENDS, expert_workspace, pick_expert_backend
from ..numerics import E4M3FN, quantize_activation

# Gated activations by name: "glu" is act(gate) * up (act = the family's act_fn); "clamped_swiglu" is
# GPT-OSS's (gate clamped above, up clamped both ways, gate * sigmoid(alpha * gate) * (up + 1)).
GATES = ("glu", "clamped_swiglu")


def _round_up(n: int, to: int) -> int:
    return n + (-n % to)


class Fp8Experts(nn.Module):
    """Routed experts `y_t = sum_k w_tk * W2_e (gate(W13_e x_t + b13_e)) + b2_e` with FP8 W13, W2.

    `forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`; or, when
    `dense_input` (Llama4), `forward(x [E*T, H]) -> [E*T, H]`, each expert's T rows already scaled
    by the router, all-zero rows meaning "not routed here" (skipped: their output is exactly zero).
    Only experts that received tokens are computed. Fill with `load_(w13, w2, b13, b2)`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 config: Fp8Config | None = None, *, bias: bool = False, gate: str = "glu",
                 act_fn: nn.Module | None = None, alpha: float = 1.702, limit: float = 7.0,
                 dense_input: bool = False, device: torch.device | str | None = "meta",
                 dtype: torch.dtype = torch.bfloat16, name: str = "", split: bool = False) -> None:
        super().__init__()
        config = config or Fp8Config()
        if gate not in GATES:
            raise ValueError(f"unknown gated activation {gate!r} for {name or 'experts'}; valid: {GATES}")
        if gate == "glu" and act_fn is None:
            raise ValueError(f"{name or 'experts'}: gate='glu' needs the family's act_fn")
        if config.backend not in EXPERT_BACKENDS:
            raise ValueError(f"{name or 'experts'}: backend {config.backend!r} has no MoE experts kernel; "
                             f"valid for experts: {', '.join(EXPERT_BACKENDS)} (or ignore the experts)")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.scheme: Scheme = config.expert_scheme
        pad = 128 if self.scheme is Scheme.BLOCK else 1
        self.h_pad, self.i_pad = _round_up(hidden_size, pad), _round_up(intermediate_size, pad)
        e, hp, ip = num_experts, self.h_pad, self.i_pad
        scale_shapes = weight_scale_shape(self.scheme, 2 * ip, hp), weight_scale_shape(self.scheme, hp, ip)
        self.config = config   # what a tensor-parallel split builds this rank's part with
        self.act_kind = expert_act_kind(config)
        self.gate_kind, self.act_fn, self.alpha, self.limit = gate, act_fn, alpha, limit
        self.dense_input = dense_input
        self.name = name
        self.split = split   # this rank's part of a tensor-parallel layer (tp_moe): moe_backends.SPLIT_BACKENDS
        self.forced_backend, self.batch_invariant = config.backend, config.batch_invariant
        self.fast_accum = config.fast_accum   # the triton backend's sorted-path grouped GEMMs (MoePath.fast_accum)
        self.weight_numerics, self.scale_dtype = config.weight_numerics, torch.float32
        self.graphs = DecodeGraphs() if config.decode_graphs else None   # triton: small-T calls replayed
        self.hf_layout = None   # set by hf_moe: how transformers stores these experts (for reload_weights)
        self.backend: str | None = None
        self.w13_work = self.w2_work = None   # the cpu backend's bf16 working copies (moe_cpu; not saved)
        self.act_quantizer = None             # its compiled activation quantizer (cpu_quantizer.install)
        self.register_buffer("workspace", None, persistent=False)   # the backend's scratch (expert_workspace)

        def fp8(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=E4M3FN.dtype, device=device), requires_grad=False)

        def f32(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)

        self.w13, self.w2 = fp8(e, 2 * ip, hp), fp8(e, hp, ip)
        self.w13_scale, self.w2_scale = f32(e, *scale_shapes[0]), f32(e, *scale_shapes[1])
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * ip, dtype=dtype, device=device), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, hp, dtype=dtype, device=device), requires_grad=False)

    @property
    def is_loaded(self) -> bool:
        return self.backend is not None

    def _pad_w13(self, w13: torch.Tensor) -> torch.Tensor:
        """[E, 2I, ...] -> [E, 2Ip, ...]: each of gate and up padded with zero rows to Ip."""
        i, ip = self.intermediate_size, self.i_pad
        if ip == i:
            return w13
        out = w13.new_zeros((w13.shape[0], 2 * ip, *w13.shape[2:]))
        out[:, :i], out[:, ip:ip + i] = w13[:, :i], w13[:, i:]
        return out

    def padded(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float `w13 [E, 2I, H]`, `w2 [E, H, I]` in the stored layout `[E, 2Ip, Hp]`, `[E, Hp, Ip]`
        (the inputs themselves when nothing is padded: no copy of a whole layer)."""
        if (self.h_pad, self.i_pad) == (self.hidden_size, self.intermediate_size):
            return w13, w2
        w13 = nn.functional.pad(self._pad_w13(w13), (0, self.h_pad - self.hidden_size))
        w2 = nn.functional.pad(w2, (0, self.i_pad - self.intermediate_size, 0, self.h_pad - self.hidden_size))
        return w13, w2

    def load_(self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, amax: dict[str, torch.Tensor] | None = None,
              checked: bool = False, quantizer=None) -> torch.Tensor | None:
        """Quantize float `w13 [E, 2I, H]`, `w2 [E, H, I]` (biases `[E, 2I]`, `[E, H]`) one expert at a
        time; in place when storage exists (same tensors, same data_ptr), else created on w13's device.
        `amax` {"w13"/"w2": [E, ...] numerics.weight_amax per expert}: scale amaxes to use instead of
        measuring them (tensor parallelism inside the experts: the MAX over the group, SPEC §6).
        Dtypes, shapes and NaN/Inf of every input are checked before anything is written (NaN/Inf with one
        host sync for the whole layer; not again with `checked`: the caller did, e.g. for a whole reload).
        `quantizer`: a compiled CPU weight quantizer of this scheme (`kernels.cpu_aot_weight`), which also
        measures the error: returns its sums of the padded matrices `[E, 2 (w13, w2), 7]`, else None."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        check_float_weight(w13, f"{self.name}.w13", (e, 2 * i, h))
        check_float_weight(w2, f"{self.name}.w2", (e, h, i))
        has_bias = self.w13_bias is not None
        if has_bias != (b13 is not None) or has_bias != (b2 is not None):
            raise ValueError(f"{self.name or 'experts'}: biases {'required' if has_bias else 'not expected'}"
                             " (both gate_up and down)")
        if has_bias:
            check_float_weight(b13, f"{self.name}.w13_bias", (e, 2 * i))
            check_float_weight(b2, f"{self.name}.w2_bias", (e, h))
        if not checked:
            check_experts_finite(self.name or "experts", w13, w2, b13, b2)
        device = w13.device if self.w13.is_meta else self.w13.device
        p13, p2 = self.padded(w13.to(device), w2.to(device))
        # On a CPU, one pass per expert gives the bytes, the scales and the cpu backend's working copy.
        fast = device.type == "cpu" and amax is None and self.weight_numerics == "spec"
        compiled = quantizer if (fast and quantizer is not None and quantizer.scheme is self.scheme
                                 and quantizer.dtype == p13.dtype) else None
        stats = torch.empty(e, 2, 7, dtype=torch.float64) if compiled is not None else None
        works = {}
        for j, (leaf, w) in enumerate((("w13", p13), ("w2", p2))):
            if getattr(self, leaf).is_meta:
                setattr(self, leaf, nn.Parameter(torch.empty(w.shape, dtype=E4M3FN.dtype, device=device),
                                                 requires_grad=False))
                scale = getattr(self, leaf + "_scale")
                setattr(self, leaf + "_scale", nn.Parameter(torch.empty(scale.shape, device=device),
                                                            requires_grad=False))
            q_all, s_all = getattr(self, leaf), getattr(self, leaf + "_scale")
            if amax is None and writes_in_place(device, self.weight_numerics):   # all experts at once, in place
                quantize_weight(w, self.scheme, f"{self.name}.{leaf}", checked=True, out=(q_all.data, s_all.data))
                self.scale_dtype = torch.float32
                continue
            if fast:
                old = getattr(self, f"{leaf}_work")
                works[leaf] = old if old is not None and old.shape == w.shape else torch.empty(w.shape, dtype=cpu.WORK_DTYPE)
            for x in range(e):
                what = f"{self.name}.{leaf}[{x}]"
                if compiled is not None:
                    q, s, work, stats[x, j] = compiled(w[x], what)
                    q_all.data[x].copy_(q)
                    works[leaf][x].copy_(work)
                    s_all.data[x].copy_(s.reshape(s_all.shape[1:]))
                    continue
                if fast:   # NaN/Inf were checked above (or by the caller): the live storage may be written
                    _, s, _ = cpu_wquant.quantize_weight(w[x], self.scheme, what, q_out=q_all.data[x],
                                                         work_out=works[leaf][x])
                    s_all.data[x].copy_(s.reshape(s_all.shape[1:]))
                    continue
                given = None if amax is None or leaf not in amax else amax[leaf][x]
                q, s = quantize_weight(w[x], self.scheme, what, self.weight_numerics, given, checked=True)
                self.scale_dtype = s.dtype   # llm-compressor's: the weight's dtype (float32 holds it exactly)
                q_all.data[x].copy_(q)
                s_all.data[x].copy_(s.reshape(s_all.shape[1:]))
        if has_bias:
            pb13 = self._pad_w13(b13.to(device))
            pb2 = nn.functional.pad(b2.to(device), (0, self.h_pad - h))
            for leaf, b in (("w13_bias", pb13), ("w2_bias", pb2)):
                old = getattr(self, leaf)
                if old.is_meta:
                    setattr(self, leaf, nn.Parameter(b.to(old.dtype).clone(), requires_grad=False))
                else:
                    old.data.copy_(b)
        self._pick_backend(works or None)
        return stats

    def install_(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor) -> None:
        """Take already quantized tensors in the stored layout (`w13 [E, 2Ip, Hp]` FP8, float32 scales), as
        they are: a pre-quantized checkpoint's bytes; nothing is quantized."""
        for leaf, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            old = getattr(self, leaf)
            if t.shape != old.shape or t.dtype != old.dtype:
                raise ValueError(f"{self.name}.{leaf}: got {t.dtype} {tuple(t.shape)}, the layer stores "
                                 f"{old.dtype} {tuple(old.shape)}")
            setattr(self, leaf, nn.Parameter(t, requires_grad=False))
        self._pick_backend()

    def _pick_backend(self, works: dict[str, torch.Tensor] | None = None) -> None:
        """Choose the backend for the weights' device and (re)build what it derives from the FP8 bytes (`works`:
        the cpu backend's working copies, already made by the quantizer)."""
        self.backend = pick_expert_backend(self.w13.device, self, self.forced_backend)
        self.workspace = expert_workspace(self)
        if self.backend == "cpu":
            moe_cpu.prepare(self, works)
        else:
            moe_cpu.release(self)

    def expert_weight(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's stored (w13 [2Ip, Hp], w13_scale, w2 [Hp, Ip], w2_scale)."""
        return self.w13[e], self.w13_scale[e], self.w2[e], self.w2_scale[e]

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """quantize(x [m, K]) @ w.T (+ b), exact in float64, rounded to float32 then x.dtype."""
        x_q, x_s = quantize_activation(x, self.act_kind)
        y = exact_matmul(x_q, x_s, w, s, self.scheme).float()
        if b is not None:
            y = y + b.float()
        return y.to(x.dtype)

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        """[m, 2Ip] -> [m, Ip] by the family's gated activation."""
        gate, up = h[:, :self.i_pad], h[:, self.i_pad:]
        if self.gate_kind == "glu":
            return self.act_fn(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert_gemm(self, e: int, leaf: str, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """Expert e's `leaf` ("w13" or "w2") GEMM of x [m, K] (+ b) on the layer's backend -> [m, N] in
        x.dtype: the cpu working copy (moe_cpu), else the exact product."""
        if self.backend == "cpu":
            return moe_cpu.gemm(self, x, getattr(self, f"{leaf}_work")[e], b)
        return self._gemm(x, getattr(self, leaf)[e], getattr(self, f"{leaf}_scale")[e], b)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens x [m, H] -> [m, H] (no routing weight)."""
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = None if self.w2_bias is None else self.w2_bias[e]
        x = nn.functional.pad(x, (0, self.h_pad - self.hidden_size))
        h = self.expert_gemm(e, "w13", x, b13)
        return self.expert_gemm(e, "w2", self._gated(h), b2)[:, :self.hidden_size]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError(f"Fp8Experts {self.name} has no weights yet: call load_ first")
        if self.backend == "triton":
            from .moe_triton import triton_forward
            return triton_forward(self, hidden_states, top_k_index, top_k_weights)
        if self.dense_input:
            return self._dense_forward(hidden_states)
        if top_k_index is None or top_k_weights is None:
            raise ValueError(f"{self.name or 'Fp8Experts'}: forward needs top_k_index and top_k_weights")
        x = hidden_states.reshape(-1, self.hidden_size)
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise ValueError(f"{self.name or 'Fp8Experts'}: expert index out of range [0, "
                             f"{self.num_experts})")
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros((t * k, self.hidden_size), dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                slots = order[start:start + n]
                out[slots] = self.expert_forward(e, x[slots // k]).float()
                start += n
        return combine(out, top_k_weights).to(hidden_states.dtype)

    def _dense_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama4 layout: x [E*T, H], expert e owns rows e*T..(e+1)*T; zero rows are skipped."""
        x = hidden_states.reshape(self.num_experts, -1, self.hidden_size)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows = x[e].ne(0).any(dim=-1).nonzero().flatten()
            if rows.numel():
                out[e, rows] = self.expert_forward(e, x[e, rows])
        return out.reshape(hidden_states.shape)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` must not touch FP8 weights or float32 scales: move them only."""
        before = self.w13.device
        out = super()._apply(keep_fp8_on_apply(fn, (self.w13, self.w2, self.w13_scale, self.w2_scale)), recurse)
        if self.backend is not None and self.w13.device != before:
            self._pick_backend()
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate="
                f"{self.intermediate_size}, bias={self.w13_bias is not None}, gate={self.gate_kind}, "
                f"scheme={self.scheme.value}, act={self.act_kind}, backend={self.backend or 'unloaded'}")

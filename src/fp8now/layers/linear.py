"""Fp8Linear: an nn.Linear whose weight is stored in FP8 and whose input is quantized on every call."""

from __future__ import annotations

import torch
from torch import nn

from . import decode_graphs
from ..config import Fp8Config, Scheme
from ..kernels import (backend_module, cpu_wquant, device_class, pick_backend, quantize_weight, workspace,
                       writes_in_place)
from ..kernels.plan import TABLES, Path, Table, Weights, plan
from ..numerics import E4M3FN
from .weights import check_float_weight, keep_fp8_on_apply, weight_scale_shape

_PATHS_KEPT = 512   # distinct M whose planned path a layer remembers (eager calls)


class Fp8Linear(nn.Module):
    """`y = x @ W.T + b` with `W` in FP8 (`weight` [N, K], `weight_scale` float32), `x` quantized per call.

    Build one from an `nn.Linear` with `Fp8Linear.from_linear(linear, config)`, or empty (e.g. on the
    meta device) with `Fp8Linear(in_features, out_features, bias, config, device="meta")` and fill it
    later with `load_(w, b)`. The backend is chosen when the weight arrives, from the table in
    `fp8now.kernels`, and shown by `repr`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 config: Fp8Config | None = None, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, name: str = "") -> None:
        super().__init__()
        config = config or Fp8Config()
        shape = weight_scale_shape(config.scheme, out_features, in_features)
        self.config = config   # what a tensor-parallel split builds this rank's part with
        self.in_features, self.out_features = in_features, out_features
        self.scheme: Scheme = config.scheme
        self.act_kind: str = config.act_kind(config.scheme)
        self.forced_backend: str = config.backend
        self.batch_invariant: bool = config.batch_invariant
        self.fast_accum: bool = config.fast_accum
        self.weight_numerics: str = config.weight_numerics
        self.scale_dtype: torch.dtype = torch.float32   # the dtype its rule gave the scale: what save writes
        self.use_decode_graphs: bool = config.decode_graphs
        self._graphs: decode_graphs.DecodeGraphs | None = None
        self._graph_rows = 0
        self.name = name
        self.backend: str | None = None
        self._impl = None
        self._device_class = "cpu"
        self._paths: dict[tuple[int, bool], Path] = {}   # eager calls: the plan by (M, from the producer)
        self.plan_table: Table | None = None   # None: the device class's (kernels.plan.TABLES); see use_table
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3FN.dtype,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        # Scratch of the backend's calls (its `workspace` hook; e.g. the decode kernel's counters, back to
        # their start values after every call; not saved). The same layer must not run on two streams at once.
        self.register_buffer("workspace", None, persistent=False)
        # State a backend derives from the FP8 bytes (its `prepare` hook: the cpu backend's bf16 working
        # copy). A plain attribute: not in state_dict, not moved by `.to()`; rebuilt on every load_.
        self._work: torch.Tensor | None = None
        # Set by `shared_input.share_inputs`: one activation quantization for siblings reading one input.
        self.input_memo = None
        # Set by `producers.install`: the op in front of this layer whose kernel can write its FP8 input
        # (kernels.plan.PRODUCERS), and for an RMSNorm the handoff it leaves the bytes in.
        self.producer: str | None = None
        self.input_handoff = None
        # Set by `stacked.Stack`: the siblings whose weights share one buffer with this one (one-row GEMVs).
        self.stack = None
        # Set by `cpu_quantizer.install`: the cpu backend's compiled activation quantizer (None: torch ops).
        self.act_quantizer = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config | None = None, name: str = ""
                    ) -> Fp8Linear:
        """Quantize an existing `nn.Linear` (its weight's device becomes the layer's device)."""
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, config,
                    device="meta", dtype=w.dtype, name=name)
        layer.load_(w, None if linear.bias is None else linear.bias.detach())
        return layer

    @property
    def is_loaded(self) -> bool:
        return self.backend is not None

    def load_(self, w: torch.Tensor, bias: torch.Tensor | None = None,
              amax: torch.Tensor | None = None, checked: bool = False, quantizer=None) -> torch.Tensor | None:
        """Quantize a float weight `[N, K]` into this layer, in place when storage exists.

        On the meta device, storage is created on `w.device`; otherwise `w` is moved to the layer's
        device and the results are copied into the existing tensors (same objects, same data_ptr).
        `amax` (numerics.weight_amax's shape): the scale groups' amax to use instead of measuring
        it, e.g. the MAX over a tensor-parallel group (SPEC §6). Every input is checked before anything
        is written (the weight's NaN/Inf too, unless `checked`: the caller did, e.g. for many at once).
        `quantizer`: a compiled CPU weight quantizer of this layer's scheme (`kernels.cpu_aot_weight`) for a
        CPU weight, which also measures the error; returns its sums (`weight_error.error_stats`'), else None.
        """
        check_float_weight(w, self.name, (self.out_features, self.in_features))
        if self.bias is not None:
            if bias is None:
                raise ValueError(f"{self.name or 'layer'} expects a bias of shape ({self.out_features},)")
            check_float_weight(bias, f"{self.name}.bias", (self.out_features,))
            if not checked and not bool(torch.isfinite(bias).all()):
                raise ValueError(f"tensor {self.name + '.bias' if self.name else 'bias'!r} contains NaN or Inf; fix "
                                 "or re-export the weights (nothing of this layer was written)")
        device = w.device if self.weight.is_meta else self.weight.device
        w = w.to(device)
        work = stats = None
        if device.type == "cpu" and amax is None and self.weight_numerics == "spec":
            # one pass: the bytes, the scales and the cpu backend's working copy (NaN/Inf checked by the amax)
            if quantizer is not None and quantizer.scheme is self.scheme and quantizer.dtype == w.dtype:
                q, s, work, stats = quantizer(w, self.name or None)
            else:
                q, s, work = cpu_wquant.quantize_weight(w, self.scheme, self.name or None)
        else:   # on a GPU the kernel writes the existing storage itself (checked before: nothing torn)
            out = None if self.weight.is_meta or not writes_in_place(device, self.weight_numerics) \
                else (self.weight.data, self.weight_scale.data)
            q, s = quantize_weight(w, self.scheme, self.name or None, self.weight_numerics, amax, checked, out)
        self.scale_dtype, s = s.dtype, s.float()   # float32 holds llm-compressor's bf16 scales exactly
        if self.weight.is_meta:
            self.weight = nn.Parameter(q, requires_grad=False)
            self.weight_scale = nn.Parameter(s.reshape(self.weight_scale.shape), requires_grad=False)
        elif q.data_ptr() != self.weight.data_ptr():   # new tensors: copied in
            self.weight.data.copy_(q)
            self.weight_scale.data.copy_(s.reshape(self.weight_scale.shape))
        if self.bias is not None:
            if self.bias.is_meta:
                self.bias = nn.Parameter(bias.to(device=device, dtype=self.bias.dtype).clone(),
                                         requires_grad=False)
            else:
                self.bias.data.copy_(bias)
        if self.backend is None or self._impl is None:
            self.pick_backend(work)
        else:
            self._prepare(work)
        return stats

    def pick_backend(self, work: torch.Tensor | None = None) -> str:
        """(Re)choose the backend for the layer's current device; call again after moving it. `work`: the cpu
        backend's working copy, made with the FP8 bytes (used if that backend is chosen)."""
        self.backend = pick_backend(self.weight.device, self.scheme, self.act_kind, self.out_features,
                                    self.in_features, self.forced_backend, self.batch_invariant, self.fast_accum)
        self._impl = backend_module(self.backend)
        self._device_class = device_class(self.weight.device)
        self._paths = {}
        self.workspace = workspace(self.backend, self.weight.device, self.scheme, self.act_kind,
                                   self.out_features, self.in_features, self.batch_invariant, self.plan_table)
        graphed = getattr(self._impl, "GRAPHED", False) and self.use_decode_graphs
        self._graph_rows = decode_graphs.max_rows(self.out_features, self.in_features) if graphed else 0
        self._graphs = decode_graphs.DecodeGraphs() if self._graph_rows else None
        self._work = None
        self._prepare(work)
        return self.backend

    def path(self, m: int, compiling: bool = False, from_producer: bool = True) -> Path:
        """The kernel path of a call with `m` tokens (`kernels.plan.plan` for this layer): of an input
        the producer in front wrote (if any; `from_producer=False`: of any other input)."""
        if self.backend is None:
            raise RuntimeError(f"Fp8Linear {self.name or ''} has no weight yet: call load_(w) first")
        return plan(self.backend, self.scheme, self.act_kind, m, self.out_features, self.in_features,
                    self._device_class, self.batch_invariant, compiling, self.plan_table, self.fast_accum,
                    self.producer if from_producer else None)

    def planned(self, m: int, from_producer: bool = False) -> Path:
        """`path` of this call: planned afresh under torch.compile, else remembered per (M, producer)."""
        if torch.compiler.is_compiling():
            return self.path(m, True, from_producer)
        path = self._paths.get((m, from_producer))
        if path is None:
            path = self.path(m, False, from_producer)
            if len(self._paths) < _PATHS_KEPT:
                self._paths[(m, from_producer)] = path
        return path

    @property
    def table(self) -> Table:
        """The plan table of this layer's calls (`use_table`'s, or its device class's)."""
        return self.plan_table or TABLES[self._device_class]

    def use_table(self, table: Table | None) -> None:
        """Plan this layer's calls from `table` (None: the device class's), e.g. to test or tune a path."""
        self.plan_table = table
        if self.backend is not None:
            self.pick_backend()

    def _prepare(self, work: torch.Tensor | None = None) -> None:
        """(Re)build the backend's derived state from the current FP8 bytes, in place when it exists (`work`:
        the cpu backend's working copy, already made by the quantizer)."""
        prepare = getattr(self._impl, "prepare", None)
        if work is not None and self.backend == "cpu":
            if self._work is None or self._work.shape != work.shape:
                self._work = work
            else:
                self._work.copy_(work)   # a reload keeps the working copy's storage
        elif prepare is not None:
            with torch.no_grad():
                self._work = prepare(self.weight, self.weight_scale, self.scheme, self._work)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._impl is None:
            raise RuntimeError(f"Fp8Linear {self.name or ''} has no weight yet: call load_(w) first")
        fp8 = None if self.input_handoff is None else self.input_handoff.take(x, self.act_kind)
        if fp8 is not None and self.planned(fp8[0].shape[0], True).quant == self.producer:
            # x came from the RMSNorm in front, which wrote its FP8 bytes for this layer too
            y = None if self.stack is None else self.stack.output(self, *fp8, x.dtype)
            y = self.forward_fp8(*fp8, x.dtype) if y is None else y
            return y.reshape(*x.shape[:-1], self.out_features)
        x2 = x.reshape(-1, self.in_features)
        if 0 < x2.shape[0] <= self._graph_rows and decode_graphs.usable(x2):   # rows > 0: _graphs is set
            y = self._graphs.run(x2, self._launch, self.out_features, self._addresses())
        else:
            y = self._launch(x2, x)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _launch(self, x2: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The backend's linear on x2 [M, K] -> [M, N], along this call's planned path."""
        path = self.planned(x2.shape[0])
        weights = Weights(self.weight, self.weight_scale, self.bias,
                          self.workspace if self._work is None else self._work)
        widen = getattr(self._impl, "widened_activation", None)   # the cpu backend's hook
        if widen is None:
            return self._impl.linear(x2, weights, path)
        if self.input_memo is not None and x is not None and not torch.compiler.is_compiling():
            x_w = self.input_memo.widened(x, lambda: widen(x2, path.act, self.act_quantizer))
        else:
            x_w = widen(x2, path.act, self.act_quantizer)
        return self._impl.linear(x2, weights, path, x_w)

    def forward_fp8(self, x_q: torch.Tensor, x_s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """y [M, N] in `out_dtype` from FP8 rows x_q [M, K] and their scales, written by the producer in
        front (`self.producer`) where this layer's plan reads them (else: ValueError)."""
        path = self.planned(x_q.shape[0], from_producer=True)
        if path.quant != self.producer or getattr(self._impl, "linear_fp8", None) is None:
            raise ValueError(f"Fp8Linear {self.name or ''}: its plan does not read a producer's FP8 input here "
                             f"({path.name}, producer {self.producer}); hand it the bf16 activation instead")
        weights = Weights(self.weight, self.weight_scale, self.bias, self.workspace)

        def call(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return self._impl.linear_fp8(q, s, out_dtype, weights, path)
        if 0 < x_q.shape[0] <= self._graph_rows and decode_graphs.usable(x_q):
            return self._graphs.run((x_q, x_s), call, self.out_features, self._addresses(), out_dtype)
        return call(x_q, x_s)

    def _addresses(self) -> tuple[int, ...]:
        """Where the tensors a captured call reads live (a graph is valid while these stay)."""
        return (self.weight.data_ptr(), self.weight_scale.data_ptr(),
                0 if self.bias is None else self.bias.data_ptr(),
                0 if self.workspace is None else self.workspace.data_ptr())

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` / `.half()` must not touch the FP8 weight or its float32 scale: move them only."""
        before = self.weight.device
        out = super()._apply(keep_fp8_on_apply(fn, (self.weight, self.weight_scale)), recurse)
        if self.weight.device != before:
            if self.stack is not None:   # the members move one by one: the stack's buffers stay behind, unused
                self.stack.dissolve()
            if self._impl is not None:
                self.pick_backend()
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme.value}, act={self.act_kind}, "
                f"backend={self.backend or 'unloaded'}"
                + (", batch_invariant=True" if self.batch_invariant else "")
                + (", fast_accum=True" if self.fast_accum else "")
                + (", stacked with " + ", ".join(m.name.rsplit(".", 1)[-1] or "?" for m in self.stack.members
                                                  if m is not self) if self.stack is not None else ""))

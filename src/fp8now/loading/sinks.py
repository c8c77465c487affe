"""What the load pipeline does with each routed tensor. An FP8 layer waits for its weight (and bias), then is
quantized at once on its device; experts wait for every expert, are merged by transformers' rules, then
quantized; a pre-quantized layer's bytes are adopted as they are; an FP8 embedding is quantized as it arrives;
every other tensor is stored as it is: a new parameter of a skeleton, or copied into existing storage."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from ..layers.finite import FiniteCheck, check_finite, scale_peak
from ..layers.linear import Fp8Linear
from .route import Dest
from .rows import Pending, embedding_row, layer_row, resolve
from .slots import Slot

# Source weight bytes quantized between heap trims: the freed temporaries of a load are given back as it
# goes, so they do not pile up into the process peak.
TRIM_EVERY_BYTES = 32 << 20


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them after a load's many temporaries)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def materialize(slot: Slot, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Put a non-quantized tensor on the device (floats in `dtype`, or float32 where the model keeps
    them so), replacing the meta one. Returns the stored tensor."""
    if slot.kind == "buffer":
        old = slot.owner._buffers[slot.leaf]
        slot.owner._buffers[slot.leaf] = out = t.to(dtype=old.dtype).to(device)
        return out
    want = torch.float32 if slot.keep_fp32 else dtype
    out = t.to(want) if t.is_floating_point() and t.dtype != want else t  # cast on the host
    param = nn.Parameter(out.to(device), requires_grad=out.is_floating_point())   # as from_pretrained
    for owner, leaf in [(slot.owner, slot.leaf), *slot.aliases]:
        owner._parameters[leaf] = param
    return param


class Sinks:
    """The sinks of one pipeline run over `plan` (loading.plan.Plan).

    `device` / `dtype`: where new tensors go and the dtype of plain float tensors (None: each layer's own device,
    the tensors' own dtype). `plain`: "store" (new parameters on a skeleton), "copy" (into existing storage, in
    place) or "keep" (already in place: `quantize_`). `whole`: the tensors are whole under tensor parallelism and
    are sliced here (in memory; a file reader reads slices). `checked`: NaN/Inf of every tensor were checked
    before the first write; otherwise plain tensors are checked as they arrive (`deferred`: all at the end)."""

    def __init__(self, plan, device: torch.device | None, dtype: torch.dtype | None, measure: bool, *,
                 plain: str = "store", whole: bool = False, checked: bool = False, deferred: bool = True,
                 quantizers=None) -> None:
        self.plan, self.device, self.dtype, self.measure = plan, device, dtype, measure
        self.quantizers = quantizers   # dtype -> (compiled CPU weight quantizer or None, note): cpu_quantizer
        self.chosen: dict[torch.dtype, tuple] = {}   # weight dtype -> (the CPU quantizer or None, note)
        self.plain, self.whole, self.checked, self.deferred = plain, whole, checked, deferred
        if plan.experts is not None:
            plan.experts.checked = checked
        self.finite = FiniteCheck()
        self.rows: list = []                       # report rows of the layers quantized or adopted
        self.skipped: list[tuple[str, str]] = []   # (key, why) read but not used
        self.updated: list[str] = []               # FP8 layers and experts written, in order
        self.copied: list[str] = []                # plain tensors written
        self.absurd: list[str] = []                # warnings: finite values beyond layers.finite.ABSURD
        self.pending: dict[str, dict[str, tuple[torch.Tensor, str, str]]] = {}   # FP8 layer -> leaf -> parts
        self.figures: list[Pending] = []           # rows whose error figures wait for their sums (one sync)
        self._since_trim = 0
        self._experts_target: dict[str, tuple[torch.device, torch.dtype]] = {}   # loaded experts: (device, dtype)

    def add(self, d: Dest, key: str, t: torch.Tensor | None, where: str) -> None:
        """Take one tensor routed to `d` (`where`: its file, or the call, for messages)."""
        if d.kind == "skip":
            self.skipped.append((key, d.why))
        elif d.kind == "fp8":
            self._dense(self.plan.slots[d.name], key, t, where)
        elif d.kind == "experts":
            self._experts(d, key, t, where)
        elif d.kind == "embedding":
            self._embedding(self.plan.slots[d.name].owner, key, t, where)
        elif d.kind in ("adopt", "adopt_experts"):
            row, why = self.plan.adopted.add(d, key, t, where, self.device, self.dtype)
            if row is not None:
                self.rows.append(row)
                self.updated.append(row.name)
            if why is not None:
                self.skipped.append((key, why))
        else:
            self._plain(self.plan.slots[d.name], d.name, key, t, where)

    @property
    def _flush_rows(self) -> bool:
        """Report rows measure each FP8 layer's flushed weights, whose warning already flags an outlier."""
        return self.measure and self.plain != "copy"

    def _check(self, t: torch.Tensor, what: str) -> None:
        """NaN/Inf of a tensor stored as it is: at the end of the run, now, or not again (`checked`)."""
        if self.checked:
            return
        if self.deferred:
            self.finite.add(t, what)
        else:
            self.absurd += check_finite([(t, what)])

    def _dense(self, slot: Slot, key: str, t: torch.Tensor, where: str) -> None:
        layer = slot.owner
        assert isinstance(layer, Fp8Linear)
        parts = self.pending.setdefault(layer.name, {})
        parts[slot.leaf] = (t, where, key)
        if slot.leaf == "bias" and not self.checked and not self.deferred:   # a stream: refused as it arrives
            self.absurd += check_finite([(t, f"{where}: tensor {key!r}")])
        if "weight" not in parts or (layer.bias is not None and "bias" not in parts):
            return
        parts = self.pending.pop(layer.name)
        w, wwhere, wkey = parts.pop("weight")
        if self.device is not None:
            w = w.to(self.device)
        # On a GPU a load checks NaN/Inf of every weight with one host sync at its end, not one per layer.
        later = not self.checked and self.deferred and w.device.type == "cuda"
        b = None
        if "bias" in parts:
            b, bwhere, bkey = parts.pop("bias")
            b = b.to(device=self.device or w.device)
            if later:
                self.finite.add(b, f"{bwhere}: tensor {bkey!r}")
            elif not self.checked and self.deferred:   # now, naming its file and key, before load_ writes
                self.absurd += check_finite([(b, f"{bwhere}: tensor {bkey!r}")])
        if later:
            self.finite.add(w, f"{wwhere}: tensor {wkey!r}", warn=not self._flush_rows)
        tp = self.plan.tp
        try:
            stats = None
            if tp is None:
                stats = layer.load_(w, b, checked=self.checked or later, quantizer=self._quantizer(w))
            elif self.whole:
                tp.reload_layer(layer, w, b)   # slice, then the SPEC §6 scales
            else:
                tp.load_layer(layer, w, b)
        except ValueError as e:
            raise ValueError(f"{wwhere}: tensor {wkey!r}: {e}") from None
        if not later and not self._flush_rows and not self.checked:   # magnitude from its scales (`later` or
            # `checked`: from the whole weight)
            self.finite.add_peak(scale_peak(layer.weight_scale), f"{wwhere}: tensor {wkey!r}")
        self.updated.append(layer.name)
        if self.plain != "copy":
            self.rows.append(layer_row(layer, w if self.measure else None, self.figures, stats))
        nbytes, device = w.numel() * w.element_size(), w.device
        del w
        self._freed(nbytes, device)

    def quantizer_note(self) -> str | None:
        """What quantized the CPU weights, per weight dtype (the load report's `cpu_weight_quantizer`)."""
        if not self.chosen:
            return None
        return "; ".join(f"{str(dtype).removeprefix('torch.')}: {note}" for dtype, (_, note) in self.chosen.items())

    def _quantizer(self, w: torch.Tensor):
        """The compiled CPU weight quantizer for `w` (None: none, or not a CPU weight): asked once per dtype."""
        if self.quantizers is None or w.device.type != "cpu":
            return None
        if w.dtype not in self.chosen:
            self.chosen[w.dtype] = self.quantizers(w.dtype)
        return self.chosen[w.dtype][0]

    def _freed(self, nbytes: int, device: torch.device) -> None:
        """A layer's float weights were dropped: give the host heap back every TRIM_EVERY_BYTES of them (a GPU
        load reads through reused pinned buffers: nothing to give back)."""
        if device.type != "cpu":
            return
        self._since_trim += nbytes
        if self._since_trim >= TRIM_EVERY_BYTES and self.plain == "store":
            trim_heap()
            self._since_trim = 0

    def _experts(self, d: Dest, key: str, t: torch.Tensor | None, where: str) -> None:
        experts, layer = self.plan.experts, self.plan.slots[d.name].owner
        if self.whole and self.plan.tp is not None:   # this rank's part (None: another rank's expert)
            t = self.plan.tp.moe.local(d.name, key, experts.pattern_of.get(key), t)
        target = self._experts_target.get(d.name)   # (device, dtype) of a loaded layer: the same for every key
        if target is None:
            device = self.device or (t.device if layer.w13.is_meta and t is not None else layer.w13.device)
            dtype = self.dtype or (layer.w13_bias.dtype if layer.w13_bias is not None else layer.w13.dtype)
            target = (device, dtype)
            if not layer.w13.is_meta:
                self._experts_target[d.name] = target
        device, dtype = target
        if experts.add(d.name, key, t, where, device, dtype,   # (the merge and quantization run under no_grad)
                       self.figures if self.measure and self.plain != "copy" else None, self._quantizer):
            self.updated.append(layer.name)
            self._freed(2 * (layer.w13.numel() + layer.w2.numel()), layer.w13.device)
            if not self.checked:   # (`checked`: every expert tensor's magnitude was measured before)
                self.finite.add_peak(scale_peak(layer.w13_scale, layer.w2_scale), f"{where}: experts {layer.name}")

    def _embedding(self, layer, key: str, t: torch.Tensor, where: str) -> None:
        """An Fp8Embedding's table: quantized per row as it arrives (NaN/Inf raise before anything is written)."""
        w = t.to(self.device) if self.device is not None else t
        try:
            with torch.no_grad():
                layer.load_(w)
        except ValueError as e:
            raise ValueError(f"{where}: tensor {key!r}: {e}") from None
        if not self._flush_rows and not self.checked:
            self.finite.add_peak(scale_peak(layer.weight_scale), f"{where}: tensor {key!r}")
        self.updated.append(layer.name)
        if self.plain != "copy":
            self.rows.append(embedding_row(layer, w if self.measure else None, self.figures))

    def _plain(self, slot: Slot, name: str, key: str, t: torch.Tensor, where: str) -> None:
        if self.plain == "keep":
            return
        if self.plain == "store":
            self._check(materialize(slot, t, self.device, self.dtype), f"{where}: tensor {key!r}")
            return
        self._check(t, f"{where}: tensor {key!r}")
        tp = self.plan.tp
        store = slot.owner._parameters if slot.kind == "param" else slot.owner._buffers
        with torch.no_grad():
            store[slot.leaf].copy_(t if tp is None else tp.local(name, t))
        self.copied.append(name)

    def unfinished(self) -> list[str]:
        """FP8 layers and experts still waiting for tensors."""
        plan = self.plan
        return [*self.pending, *(plan.experts.unfinished() if plan.experts is not None else []),
                *(plan.adopted.unfinished() if plan.adopted is not None else [])]

    def close(self) -> None:
        """The end of a whole load: nothing may wait for tensors; the deferred NaN/Inf checks."""
        left = self.unfinished()
        if left:   # cannot happen after route_files; a guard against silent partial loads
            raise RuntimeError(f"layers left incomplete after reading every file: {', '.join(left)}")
        self.absurd += self.finite.raise_if_bad()
        resolve(self.figures)
        if self.plain == "store":
            trim_heap()

"""NaN/Inf checks for the float tensors a load or reload stores as they are (norms, biases, embeddings,
lm_head), and a warning for finite values no trained weight comes near (1e30 in a norm weight): one pass per
tensor (`aminmax`, which propagates NaN), one host sync per batch of tensors instead of one per tensor."""

from __future__ import annotations

import torch

from ..kernels import triton_peaks
from ..kernels.cpu_wquant import tensor_amax
from ..numerics import E4M3FN

_CHUNK = 1 << 24  # elements per float32 chunk of an FP8 tensor
# Beyond this magnitude a finite weight, norm or bias is taken as corrupt: fp16's largest value, which every
# fp16 checkpoint respects and no trained bf16 weight comes near. Only warned: the values are used as they are.
ABSURD = 65504.0


def peak_abs(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 scalar on t's device, NaN when t holds NaN and inf when it holds an infinity: one
    `aminmax` pass (`cpu_wquant.tensor_amax`, no temporary); FP8 in float32 chunks, so the copies stay small."""
    flat = t.reshape(-1)
    if flat.element_size() > 1:   # one aminmax pass: no temporary, whatever the size
        return tensor_amax(flat)
    peak = None
    for i in range(0, flat.numel(), _CHUNK):
        part = flat[i:i + _CHUNK]
        lo, hi = torch.aminmax(part.float())   # FP8 has no aminmax: float32 a chunk at a time
        p = torch.maximum(hi.float(), -lo.float())
        peak = p if peak is None else torch.maximum(peak, p)
    return peak


def scale_peak(*scales: torch.Tensor) -> torch.Tensor:
    """The largest |w| an FP8 layer's scales stand for (the largest scale x 448), as a float32 scalar: the
    magnitude check of a quantized weight, from its scales alone (no pass over the weight)."""
    if len(scales) == 1:
        return scales[0].detach().amax().float() * E4M3FN.fmax
    return torch.stack([s.detach().amax().float() for s in scales]).amax() * E4M3FN.fmax


def absurd_warning(name: str, peak: float) -> str:
    """The warning for a finite tensor whose magnitude reaches `peak` > ABSURD."""
    return (f"{name} holds a value of magnitude {peak:.3g}, beyond {ABSURD:g} (fp16's range): finite, but no "
            "trained weight comes near it; the checkpoint is probably corrupt (the value is used as it is)")


class FiniteCheck:
    """Collects one on-device max |x| per float tensor; `raise_if_bad` syncs once for all of them."""

    def __init__(self) -> None:
        self._peaks: list[torch.Tensor] = []
        self._names: list[str] = []
        self._labels: list[str] = []   # each name's template: its message text is label.format(name)
        self._warn: list[bool] = []

    def add(self, t: torch.Tensor, name: str, warn: bool = True) -> None:
        """Queue `t` (any dtype; only floats are checked); `name` says which tensor in which file. `warn`:
        also warn beyond ABSURD (False: NaN/Inf only, e.g. a weight whose FP8 scales are checked instead)."""
        if t.is_floating_point() and t.numel():
            self.add_peak(peak_abs(t), name, warn)

    def add_many(self, items: list[tuple[torch.Tensor, str, bool]], label: str = "{}") -> None:
        """`add` for each (tensor, name, warn): on a GPU the contiguous ones in one launch per dtype
        (`kernels.triton_peaks`), not about three per tensor. The tensors need not outlive this call. `label`:
        the template a name goes into in a message (e.g. "tensor {!r}"), filled only for an error or warning
        (a reload of 3,147 tensors formatted every name for nothing: ~3 ms)."""
        floats = [(t, name, warn) for t, name, warn in items if t.is_floating_point() and t.numel()]
        batch = [item for item in floats if item[0].device.type == "cuda" and triton_peaks.usable(item[0])]
        if len(batch) < 2 or len({t.device for t, _, _ in batch}) > 1 or triton_peaks.available(batch[0][0].device):
            batch = []
        if batch:
            self._peaks.append(triton_peaks.peaks([t for t, _, _ in batch]))
            self._names += [name for _, name, _ in batch]
            self._labels += [label] * len(batch)
            self._warn += [warn for _, _, warn in batch]
        chosen = {id(t) for t, _, _ in batch}
        for t, name, warn in floats:
            if id(t) not in chosen:
                self.add_peak(peak_abs(t), name, warn, label)

    def add_peak(self, peak: torch.Tensor, name: str, warn: bool = True, label: str = "{}") -> None:
        """Queue a max |x| computed by the caller (e.g. from an FP8 layer's scales: 448 x the largest)."""
        self._peaks.append(peak)
        self._names.append(name)
        self._labels.append(label)
        self._warn.append(warn)

    def raise_if_bad(self) -> list[str]:
        """Raise a ValueError naming the first tensor holding NaN or Inf; else -> one warning per tensor
        beyond ABSURD (absurd_warning). Then start empty."""
        peaks, names, labels, warn = self._peaks, self._names, self._labels, self._warn
        self._peaks, self._names, self._labels, self._warn = [], [], [], []
        if not peaks:
            return []
        values = torch.cat([p.to(peaks[0].device).reshape(-1) for p in peaks]).tolist()
        bad = [labels[i].format(names[i]) for i, v in enumerate(values) if v != v or v == float("inf")]
        if bad:
            more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" \
                if len(bad) > 1 else ""
            raise ValueError(f"{bad[0]} contains NaN or Inf{more}; fix or re-export the checkpoint "
                             "(a non-finite value makes every output NaN)")
        return [absurd_warning(label.format(name), v) for name, label, v, w in zip(names, labels, values, warn)
                if w and v > ABSURD]


def check_finite(tensors: list[tuple[torch.Tensor, str]]) -> list[str]:
    """Raise (naming the tensor) if any float tensor in `tensors` holds NaN or Inf; one sync in all. -> the
    warnings for finite values beyond ABSURD."""
    check = FiniteCheck()
    for t, name in tensors:
        check.add(t, name)
    return check.raise_if_bad()


def nonfinite_slices(tensors: dict[str, torch.Tensor], parts: dict[str, int]
                     ) -> list[tuple[str, int, int]]:
    """(name, i, part) for each `t[i]` of a stacked tensor (e.g. one expert) holding NaN or Inf; each `t[i]`
    is cut along its first dim into `parts[name]` (default 1) parts checked apart (gate and up rows); one sync.

    No temporary the size of the stack: a CPU stack is first checked whole in chunked passes (its pieces only when
    it is bad), a GPU's pieces in one `triton_peaks` launch per dtype; elsewhere one piece at a time."""
    pieces: list[torch.Tensor] = []
    where: list[tuple[str, int, int]] = []
    for name, t in tensors.items():
        if t.device.type == "cpu" and bool(torch.isfinite(peak_abs(t))):   # chunked passes; pieces of a bad one
            continue
        n = parts.get(name, 1)
        for i in range(t.shape[0]):
            for p, piece in enumerate(t[i].chunk(n) if n > 1 else (t[i],)):
                pieces.append(piece)
                where.append((name, i, p))
    if not pieces:
        return []
    device = pieces[0].device
    if (device.type == "cuda" and all(x.device == device and triton_peaks.usable(x) for x in pieces)
            and triton_peaks.available(device) is None):   # one launch per dtype, not two per piece
        ok = torch.isfinite(triton_peaks.peaks(pieces)).tolist()
    else:
        ok = torch.stack([torch.isfinite(x).all().to(device) for x in pieces]).tolist()
    return [w for w, good in zip(where, ok) if not good]


class NonFiniteExperts(ValueError):
    """NaN or Inf in the float weights or biases given to `Fp8Experts.load_` (nothing was written).

    `where`: (leaf, expert, part) per bad piece; part 0 / 1 = gate / up rows of w13 leaves, else 0."""

    def __init__(self, message: str, where: list[tuple[str, int, int]]) -> None:
        super().__init__(message)
        self.where = where


# What each experts leaf holds, for error messages; w13 leaves are checked as two parts: gate rows, up rows.
LEAF_TEXT = {"w13": "gate_up weight", "w2": "down weight", "w13_bias": "gate_up bias", "w2_bias": "down bias"}


def check_experts_finite(name: str, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                         b2: torch.Tensor | None) -> None:
    """Raise NonFiniteExperts naming the first expert of layer `name` (and its gate or up rows) that holds NaN
    or Inf in the stacked experts tensors given."""
    given = {"w13": w13, "w2": w2, "w13_bias": b13, "w2_bias": b2}
    bad = nonfinite_slices({k: t for k, t in given.items() if t is not None}, {"w13": 2, "w13_bias": 2})
    if bad:
        text = [f"expert {x}'s {LEAF_TEXT[leaf]}" + (f" ({('gate', 'up')[p]} half)" if leaf.startswith("w13")
                                                      else "") for leaf, x, p in bad]
        more = f" (and {len(bad) - 1} more: {', '.join(text[1:4])})" if len(bad) > 1 else ""
        raise NonFiniteExperts(f"{name}: {text[0]} contains NaN or Inf{more}; nothing was written (fix or "
                               "re-export the weights)", bad)

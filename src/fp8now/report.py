"""What a load, quantize_ or reload did: per-layer rows, what was left alone and why, bytes, memory, time."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .config import WEIGHT_GROUP, Scheme
from .host_memory import peak_rss_bytes
from .numerics import dequantize

_STATS_CHUNK_BYTES = 4 << 20  # float32 bytes per chunk when measuring the weight error


@dataclass
class LayerRow:
    """One quantized layer: `sqnr_db` / `rel_diff` compare the dequantized FP8 weight with the float one."""

    name: str
    scheme: str
    backend: str
    n: int
    k: int
    bias: bool
    sqnr_db: float | None
    rel_diff: float | None


@dataclass
class LoadReport:
    """Filled by `load` and `quantize_`.

    layers: one row per quantized layer. ignored: (module, reason) for every linear left alone.
    skipped_tensors: (checkpoint tensor, reason) read but not used (e.g. a tied duplicate).
    bf16_bytes: the quantized layers' weights at 2 bytes/element; fp8_bytes: their FP8 weights + scales.
    model_bytes: every parameter and buffer of the final model (embeddings, norms and lm_head included).
    peak_device_bytes: torch.cuda.max_memory_allocated during the load (reset at its start); None off CUDA.
    device_bytes_at_start: torch.cuda.memory_allocated when the load began (already counted in the peak).
    peak_host_rss_bytes: the process's peak resident set size (getrusage maxrss: process-wide, since start).
    """

    source: str
    device: str
    dtype: str
    scheme: str
    layers: list[LayerRow] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    skipped_tensors: list[tuple[str, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bf16_bytes: int = 0
    fp8_bytes: int = 0
    model_bytes: int = 0
    load_s: float = 0.0
    peak_device_bytes: int | None = None
    device_bytes_at_start: int | None = None
    peak_host_rss_bytes: int = 0

    @property
    def quantized(self) -> list[str]:
        return [row.name for row in self.layers]

    def format_table(self) -> str:
        """An aligned text table of the layers, then what was left alone, then summary lines."""
        head = ("layer", "scheme", "backend", "N", "K", "bias", "SQNR dB", "rel_diff")
        rows = [(r.name, r.scheme, r.backend, str(r.n), str(r.k), "yes" if r.bias else "no",
                 _num(r.sqnr_db, "{:.1f}"), _num(r.rel_diff, "{:.2e}")) for r in self.layers]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        right = {3, 4, 6, 7}
        lines = ["  ".join(x.rjust(w) if i in right else x.ljust(w)
                           for i, (x, w) in enumerate(zip(line, widths))).rstrip()
                 for line in (head, *rows)]
        lines.insert(1, "-" * len(lines[0]))
        lines += [f"left alone: {name} ({why})" for name, why in self.ignored]
        lines += [f"skipped checkpoint tensor: {name} ({why})" for name, why in self.skipped_tensors]
        return "\n".join(lines + self.summary_lines())

    def summary_lines(self) -> list[str]:
        """Two lines: bf16 vs FP8 bytes and the whole model; load time and peak memory."""
        ratio = self.bf16_bytes / self.fp8_bytes if self.fp8_bytes else float("nan")
        peak = "n/a (not CUDA)" if self.peak_device_bytes is None else _mib(self.peak_device_bytes)
        if self.device_bytes_at_start:
            peak += f" (incl. {_mib(self.device_bytes_at_start)} held before the load)"
        return [f"quantized {len(self.layers)} layers ({self.scheme}): {_mib(self.bf16_bytes)} bf16 -> "
                f"{_mib(self.fp8_bytes)} fp8 incl. scales ({ratio:.2f}x smaller); whole model "
                f"{_mib(self.model_bytes)} on {self.device}",
                f"time {self.load_s:.2f} s; peak device memory {peak}; peak host RSS "
                f"{_mib(self.peak_host_rss_bytes)} (process-wide maximum since start)"]

    def to_dict(self) -> dict:
        """JSON-able; infinite SQNR (an exact weight) becomes None."""
        out = asdict(self)
        for row in out["layers"]:
            for key in ("sqnr_db", "rel_diff"):
                if row[key] is not None and not math.isfinite(row[key]):
                    row[key] = None
        out["ignored"] = [list(x) for x in self.ignored]
        out["skipped_tensors"] = [list(x) for x in self.skipped_tensors]
        return out


@dataclass
class ReloadReport:
    """Filled by `reload_weights`: FP8 layers re-quantized, other tensors copied, layers left partial."""

    updated_layers: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    partial: list[tuple[str, list[str]]] = field(default_factory=list)  # (layer, names that did not arrive)
    skipped: list[str] = field(default_factory=list)  # non-persistent buffers: the model computes them
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.partial

    def __str__(self) -> str:
        text = (f"reload: {len(self.updated_layers)} FP8 layers re-quantized, {len(self.copied)} tensors "
                f"copied in {self.seconds:.2f} s")
        for layer, missing in self.partial:
            text += f"\n  NOT updated (partial): {layer}: missing {', '.join(missing)}"
        return text


def _num(x: float | None, fmt: str) -> str:
    if x is None:
        return "-"
    return fmt.format(x) if math.isfinite(x) else str(x)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def weight_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: Scheme
                 ) -> tuple[float, float]:
    """(SQNR dB, rel_diff) of `dequantize(q, scale)` against `w` `[N, K]`, in row chunks of ~4 MiB
    float32 so the temporaries stay small whatever the layer size."""
    rows, cols = w.shape
    group = WEIGHT_GROUP[scheme]
    align = 128 if scheme is Scheme.BLOCK else 1
    step = max(_STATS_CHUNK_BYTES // (4 * max(cols, 1)) // align * align, align)
    acc = torch.zeros(4, dtype=torch.float64, device=w.device)  # |a|², |b|², <a,b>, |a-b|²
    for r in range(0, rows, step):
        a = w[r:r + step].float()
        match scheme:
            case Scheme.TENSOR:
                s = scale.reshape(1, 1)
                b = q[r:r + step].float() * s
            case Scheme.CHANNEL:
                b = q[r:r + step].float() * scale.reshape(-1, 1)[r:r + step]
            case Scheme.BLOCK:
                b = dequantize(q[r:r + step], scale[r // 128:(r + step + 127) // 128], group)
        acc[0] += (a * a).sum(dtype=torch.float64)
        acc[1] += (b * b).sum(dtype=torch.float64)
        acc[2] += (a * b).sum(dtype=torch.float64)
        b.sub_(a)
        acc[3] += (b * b).sum(dtype=torch.float64)
        del a, b
    aa, bb, ab, noise = acc.tolist()
    rel = 0.0 if aa + bb == 0 else 1.0 - 2.0 * ab / (aa + bb)
    if noise == 0.0:
        return math.inf, rel
    return (10.0 * math.log10(aa / noise) if aa > 0 else -math.inf), rel


def peak_host_rss_bytes() -> int:
    """Peak resident set size of this process so far (0 where the platform cannot say)."""
    return peak_rss_bytes() or 0


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (shared/tied tensors count once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total

"""What a load, quantize_ or reload did: per-layer rows, what was left alone and why, bytes, memory, time."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .config import Scheme
from .host_memory import peak_rss_bytes

# A layer is flagged when more of its nonzero weights quantize to zero than this (normal weights: far
# fewer), or when one scale group (its tensor, row or 128x128 tile) loses more than GROUP_FLUSHED_WARN:
# an outlier weight sets its group's scale so high that the rest of the group flushes to zero.
ZERO_FLUSHED_WARN = 1e-3
GROUP_FLUSHED_WARN = 0.5
PLAN_TOKENS = (1, 16, 4096)   # tokens per call at which the report names each layer's kernel path
_GROUP_NAME = {Scheme.TENSOR: "tensor", Scheme.CHANNEL: "row", Scheme.BLOCK: "128x128 tile"}


@dataclass
class LayerRow:
    """One quantized layer: `sqnr_db` / `rel_diff` compare the dequantized FP8 weight with the float one;
    `plan` maps tokens per call ("1", "16", "4096") to the kernel path a call of that size runs."""

    name: str
    scheme: str
    backend: str
    n: int
    k: int
    bias: bool
    sqnr_db: float | None
    rel_diff: float | None
    plan: dict[str, str] = field(default_factory=dict)
    zero_flushed: float | None = None         # fraction of the nonzero weights that quantized to 0
    worst_group_flushed: float | None = None  # the same fraction in the layer's worst scale group


@dataclass
class ExpertsRow:
    """One quantized MoE experts module: E experts of hidden H and intermediate I; per-expert weight
    SQNR (each expert's worse matrix), the minimum and the median over the experts."""

    name: str
    num_experts: int
    hidden: int
    intermediate: int
    scheme: str
    backend: str
    bias: bool
    min_sqnr_db: float | None
    median_sqnr_db: float | None
    act: str = ""   # the experts' activation scales: token or group (never one over the batch)
    plan: dict[str, str] = field(default_factory=dict)   # routed slots (tokens x top-8) per call: path


@dataclass
class LoadReport:
    """Filled by `load` and `quantize_`.

    layers: one row per quantized layer (FP8 embedding: backend "lookup", no plan; "lookup (tied)" reads the
    head's bytes, counted with the head). ignored: (module, reason) for every linear left alone.
    skipped_tensors: (checkpoint tensor, reason) read but not used (a tied duplicate, a legacy inv_freq).
    warnings(): layers whose outliers flushed many weights to zero, and the `notices` (also in to_dict() and the
    summary).
    bf16_bytes: the quantized layers' weights at 2 bytes/element; fp8_bytes: their FP8 weights + scales.
    model_bytes: every parameter and buffer of the final model (embeddings, norms and lm_head included).
    work_bytes: what backends keep beside the FP8 bytes (the cpu backend's bf16 working copies).
    peak_device_bytes: torch.cuda.max_memory_allocated during the load (reset at its start); None off CUDA.
    device_bytes_at_start: torch.cuda.memory_allocated when the load began (already counted in the peak).
    peak_host_rss_bytes: the process's peak resident set size (getrusage maxrss: process-wide, since start);
    None where Python has no `resource` module (Windows).
    cpu_quantizer: the activation quantizer of the cpu backend's layers per kind (`cpu_quantizer.install`);
    None without such layers.
    cpu_weight_quantizer: which weight quantizer quantized the CPU weights, per weight dtype: compiled (its
    error figures from the same pass) or torch ops, and why (`cpu_quantizer.weight_quantizer`); None: none.
    weight_numerics: Fp8Config.weight_numerics ("spec", or llm-compressor's rules), named in the summary.
    keep_bf16: under Fp8Config(keep_bf16=...), what it kept and its budget (sensitivity.keep.summary); else None.
    """

    source: str
    device: str
    dtype: str
    scheme: str
    layers: list[LayerRow] = field(default_factory=list)
    experts: list[ExpertsRow] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    skipped_tensors: list[tuple[str, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bf16_bytes: int = 0
    fp8_bytes: int = 0
    model_bytes: int = 0
    work_bytes: int = 0
    load_s: float = 0.0
    peak_device_bytes: int | None = None
    device_bytes_at_start: int | None = None
    peak_host_rss_bytes: int | None = 0
    cpu_quantizer: str | None = None
    cpu_weight_quantizer: str | None = None
    weight_numerics: str = "spec"
    keep_bf16: dict | None = None
    notices: list[str] = field(default_factory=list)   # other warnings: odd values, index or config (load.py)

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
        lines += self.experts_lines()
        lines += [f"left alone: {name} ({why})" for name, why in self.ignored]
        lines += [f"skipped checkpoint tensor: {name} ({why})" for name, why in self.skipped_tensors]
        return "\n".join(lines + self.summary_lines())

    def experts_lines(self) -> list[str]:
        """One line per quantized MoE experts module."""
        return [f"experts: {r.name} E={r.num_experts} H={r.hidden} I={r.intermediate} {r.scheme} "
                + (f"act={r.act} " if r.act else "") + f"{r.backend} bias={'yes' if r.bias else 'no'} SQNR dB min {_num(r.min_sqnr_db, '{:.1f}')} median "
                f"{_num(r.median_sqnr_db, '{:.1f}')}" for r in self.experts]

    def summary_lines(self) -> list[str]:
        """bf16 vs FP8 bytes and the whole model; load time and peak memory; the cpu quantizer if any."""
        ratio = self.bf16_bytes / self.fp8_bytes if self.fp8_bytes else float("nan")
        peak = "n/a (not CUDA)" if self.peak_device_bytes is None else _mib(self.peak_device_bytes)
        if self.device_bytes_at_start:
            peak += f" (incl. {_mib(self.device_bytes_at_start)} held before the load)"
        experts = "" if not self.experts else (
            f" and {len(self.experts)} experts modules ({sum(r.num_experts for r in self.experts)} experts, "
            f"{'/'.join(sorted({r.scheme for r in self.experts}))})")
        numerics = "" if self.weight_numerics == "spec" else f", {self.weight_numerics} numerics"
        lines = [f"quantized {len(self.layers)} layers ({self.scheme}{numerics}){experts}: {_mib(self.bf16_bytes)} bf16 -> "
                f"{_mib(self.fp8_bytes)} fp8 incl. scales ({ratio:.2f}x smaller); whole model "
                f"{_mib(self.model_bytes)} on {self.device}"
                + (f" + {_mib(self.work_bytes)} of backend working copies" if self.work_bytes else ""),
                f"time {self.load_s:.2f} s; peak device memory {peak}; peak host RSS "
                + ("n/a (no resource module)" if self.peak_host_rss_bytes is None
                   else f"{_mib(self.peak_host_rss_bytes)} (process-wide maximum since start)")]
        if self.cpu_quantizer:
            lines.append(f"cpu activation quantizer: {self.cpu_quantizer}")
        if self.cpu_weight_quantizer:
            lines.append(f"cpu weight quantizer: {self.cpu_weight_quantizer}")
        if k := self.keep_bf16:
            lines.append(f"keep_bf16={k['keep_bf16']!r}: {len(k['layers'])} layers kept in bf16, {_mib(k['kept_bytes'])} "
                         f"of {_mib(k['total_bytes'])} quantizable; sensitivity scores {k['scores']}")
        return lines + [f"WARNING: {w}" for w in self.warnings()]

    def plan_lines(self) -> list[str]:
        """The kernel path at 1, 16 and 4096 tokens per call, once per distinct set of paths."""
        groups: dict[tuple, list[str]] = {}
        for r in self.layers:
            if r.plan:   # an FP8 embedding runs no GEMM: it has no plan
                groups.setdefault(tuple(r.plan.items()), []).append(r.name)
        lines = ["kernel plans (tokens per call: path)"]
        for plan, names in groups.items():
            lines.append(f"  {len(names)} layers ({names[0]}{', ...' if len(names) > 1 else ''}):")
            lines += [f"    {tokens}: {path}" for tokens, path in plan]
        experts: dict[tuple, list[str]] = {}
        for row in self.experts:
            if row.plan:   # the cpu and reference backends have no per-call plan
                experts.setdefault(tuple(row.plan.items()), []).append(row.name)
        for plan, names in experts.items():
            lines.append(f"  {len(names)} experts modules ({names[0]}{', ...' if len(names) > 1 else ''}), "
                         "routed slots (tokens x top-8) per call:")
            lines += [f"    {slots}: {path}" for slots, path in plan]
        return lines

    def to_dict(self) -> dict:
        """JSON-able; infinite SQNR (an exact weight) becomes None."""
        out = asdict(self)
        for row in out["layers"]:
            for key in ("sqnr_db", "rel_diff"):
                if row[key] is not None and not math.isfinite(row[key]):
                    row[key] = None
        for row in out["experts"]:
            for key in ("min_sqnr_db", "median_sqnr_db"):
                if row[key] is not None and not math.isfinite(row[key]):
                    row[key] = None
        out["ignored"] = [list(x) for x in self.ignored]
        out["skipped_tensors"] = [list(x) for x in self.skipped_tensors]
        out["warnings"] = self.warnings()
        return out

    def warnings(self) -> list[str]:
        """One line per layer that lost too many weights to zero (thresholds: ZERO_FLUSHED_WARN and
        GROUP_FLUSHED_WARN), then the notices (finite values beyond fp16's range, an index that omits tensors,
        custom code under auto_map that was not run)."""
        return [text for row in self.layers if (text := flush_warning(row))] + list(self.notices)


@dataclass
class ReloadReport:
    """Filled by `reload_weights`: FP8 layers re-quantized, other tensors copied, layers left partial."""

    updated_layers: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    partial: list[tuple[str, list[str]]] = field(default_factory=list)  # (layer, names that did not arrive)
    skipped: list[str] = field(default_factory=list)  # the model computes them (buffers, legacy inv_freq)
    warnings: list[str] = field(default_factory=list)  # finite values beyond fp16's range (layers.finite)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.partial

    def __str__(self) -> str:
        text = (f"reload: {len(self.updated_layers)} FP8 layers re-quantized, {len(self.copied)} tensors "
                f"copied in {self.seconds:.2f} s")
        for layer, missing in self.partial:
            text += f"\n  NOT updated (partial): {layer}: missing {', '.join(missing)}"
        return text + "".join(f"\n  WARNING: {w}" for w in self.warnings)


def _num(x: float | None, fmt: str) -> str:
    if x is None:
        return "-"
    return fmt.format(x) if math.isfinite(x) else str(x)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def flush_warning(row: LayerRow) -> str:
    """The warning for a layer that flushed too many weights to zero, or "" for a healthy one."""
    frac, worst = row.zero_flushed, row.worst_group_flushed
    if frac is None or (frac <= ZERO_FLUSHED_WARN and (worst or 0.0) <= GROUP_FLUSHED_WARN):
        return ""
    group = _GROUP_NAME.get(Scheme(row.scheme), "scale group")
    return (f"layer {row.name}: {frac:.2%} of its nonzero weights quantized to zero ({worst:.0%} in its "
            f"worst {group}; thresholds {ZERO_FLUSHED_WARN:.1%} per layer, {GROUP_FLUSHED_WARN:.0%} per "
            f"{group}): an outlier weight sets the scale; check the checkpoint's values or ignore this layer")


def plan_names(layer) -> dict[str, str]:
    """An Fp8Linear's kernel path name at each of PLAN_TOKENS tokens per call."""
    return {str(m): layer.path(m).name for m in PLAN_TOKENS}


def peak_host_rss_bytes() -> int | None:
    """Peak resident set size of this process so far (None where the platform cannot say)."""
    return peak_rss_bytes()


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

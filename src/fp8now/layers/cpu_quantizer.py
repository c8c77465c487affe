"""Which quantizers a CPU load runs: the compiled ones (`kernels.cpu_aot` for the cpu backend's activations,
`kernels.cpu_aot_weight` for the weights a load quantizes on the CPU) or torch ops.

Activations, chosen once per model at load by `FP8NOW_CPU_QUANTIZER`:
- `auto` (default): the compiled quantizer for the model's dtype and each activation kind in use, built
  on first use into `<cache>/cpu-kernels` (once per machine and torch version; tens of seconds, with a
  line on stderr), checked bit for bit against torch ops, then loaded in a millisecond by later runs.
  When it cannot be built (no C++ compiler, a failed build) or fails its check, torch ops run instead,
  with a warning and the reason in the load report; a failed build leaves a `.failed` file beside it
  so later runs do not retry (delete it to retry).
- `compiled`: the same, but any failure is an error.
- `torch`: torch ops only; nothing is built.
Both give the same bf16 activation bits; the compiled one is several times faster on large batches.

Weights (`weight_quantizer`, per load): `compiled` builds and uses the compiled weight quantizer (per scheme
and weight dtype); `auto` uses it where its library is already in the cache, and builds it only for a load
that quantizes at least `WEIGHT_BUILD_BYTES` on the CPU (about 10 s of build against about 4 s saved per
GB), so a small model's first run does not wait for a build; `torch` never. Same bytes, scales and working
copies either way; the compiled one also returns the report's error sums from the same pass.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable

import torch
from torch import nn

from ..config import Scheme
from ..kernels import cpu_aot, cpu_aot_weight
from .linear import Fp8Linear
from .weight_error import error_stats
from .moe import Fp8Experts
from ..cache import cache_lock, cache_root

ENV = "FP8NOW_CPU_QUANTIZER"
MODES = ("auto", "compiled", "torch")
SUBDIR = "cpu-kernels"
WEIGHT_BUILD_BYTES = 3 << 30   # auto: a load quantizing this much on the CPU builds the weight quantizer


@dataclass(frozen=True)
class Family:
    """A kind of compiled library: what it is called in messages, its file name, build, opening and check,
    each of (key, dtype[, path / library])."""

    what: str
    file_name: Callable
    build: Callable
    open: Callable
    check: Callable


FAMILIES = MappingProxyType({
    "activation": Family("CPU activation quantizer", cpu_aot.file_name, cpu_aot.build,
                         lambda path, key, dtype: cpu_aot.Widened(path, dtype), cpu_aot.check),
    "weight": Family("CPU weight quantizer", cpu_aot_weight.file_name, cpu_aot_weight.build,
                     lambda path, key, dtype: cpu_aot_weight.Quantizer(path, key, dtype),
                     lambda quantizer, key, dtype: cpu_aot_weight.check(quantizer, key, dtype, error_stats)),
})


def mode() -> str:
    """`FP8NOW_CPU_QUANTIZER`, checked ("auto" when unset)."""
    value = os.environ.get(ENV, "").strip() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not a CPU quantizer mode; valid: {', '.join(MODES)}")
    return value


def install(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Give every cpu-backend `Fp8Linear` and `Fp8Experts` of `model` the compiled quantizer of its
    activation kind for inputs of `dtype` (by `mode()`); returns what was chosen, for the load report
    (None: no such layer)."""
    layers = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts)) and m.backend == "cpu"]
    if not layers:
        return None
    how = mode()
    if how == "torch":
        for layer in layers:
            layer.act_quantizer = None
        return f"torch ops ({ENV}=torch)"
    notes = []
    for kind in sorted({layer.act_kind for layer in layers}):
        widened, note = compiled(kind, dtype, str(cache_root() / SUBDIR))
        if widened is None:
            if how == "compiled":
                raise RuntimeError(f"{ENV}=compiled, but {note}; set {ENV}=torch (or auto) to run on torch ops")
            warnings.warn(f"fp8now: {note}; the cpu backend quantizes activations with torch ops (slower). "
                          f"Set {ENV}=torch to skip the compiled quantizer.", stacklevel=2)
        for layer in layers:
            if layer.act_kind == kind:
                layer.act_quantizer = widened
        notes.append(f"{kind}: {'compiled' if widened is not None else 'torch ops'} ({note})")
    return "; ".join(notes)


def compiled(kind: str, dtype: torch.dtype, folder: str) -> tuple[cpu_aot.Widened | None, str]:
    """The compiled activation quantizer from `folder` (built there first if missing), or None and why not."""
    return library("activation", kind, dtype, folder)


def weight_quantizer(scheme: Scheme, weight_bytes: int, build: bool | None = None
                     ) -> Callable[[torch.dtype], tuple[cpu_aot_weight.Quantizer | None, str]]:
    """For a load quantizing `weight_bytes` on the CPU with `scheme`: a function giving, for a weight dtype,
    the compiled weight quantizer (None: torch ops run) and what happened, for the report. `build`: whether
    a missing library is built (default: by `FP8NOW_CPU_QUANTIZER` and `WEIGHT_BUILD_BYTES`)."""
    how = mode()
    if build is None:
        build = how == "compiled" or weight_bytes >= WEIGHT_BUILD_BYTES
    folder = str(cache_root() / SUBDIR)

    def get(dtype: torch.dtype) -> tuple[cpu_aot_weight.Quantizer | None, str]:
        if how == "torch":
            return None, f"torch ops ({ENV}=torch)"
        if dtype not in cpu_aot.DTYPES:
            return None, f"torch ops (no compiled quantizer for {dtype} weights)"
        path = Path(folder) / cpu_aot_weight.file_name(scheme, dtype)
        if not build and not path.exists():
            return None, (f"torch ops (not built: a load of {weight_bytes / 2**30:.2f} GiB is below "
                          f"{WEIGHT_BUILD_BYTES / 2**30:.0f} GiB; {ENV}=compiled builds it)")
        quantizer, note = library("weight", Scheme(scheme), dtype, folder)
        if quantizer is None and how == "compiled":
            raise RuntimeError(f"{ENV}=compiled, but {note}; set {ENV}=torch (or auto) to run on torch ops")
        return quantizer, f"{'compiled' if quantizer is not None else 'torch ops'} ({note})"
    return get


@functools.cache
def library(family: str, key, dtype: torch.dtype, folder: str):
    """A compiled library of `FAMILIES[family]` for (key, dtype) from `folder` (built there first if missing),
    or None, and what happened or why not. Once per process and (family, key, dtype, folder)."""
    fam = FAMILIES[family]
    if dtype not in cpu_aot.DTYPES:
        return None, f"no compiled quantizer for {dtype} inputs"
    path = Path(folder) / fam.file_name(key, dtype)
    failed = path.with_name(path.name + ".failed")
    why = _unbuildable(path, failed)
    if why is not None:
        return None, why
    start = time.perf_counter()
    built = False
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with cache_lock(path.parent / ".cpu-kernels.lock"):
                if not path.exists():   # another process may have built it meanwhile
                    print(f"fp8now: compiling the {fam.what} ({getattr(key, 'value', key)}, "
                          f"{cpu_aot.DTYPES[dtype]}) for this machine, once (about ten seconds) into {path.parent}",
                          file=sys.stderr, flush=True)
                    fam.build(key, dtype, path)
                    built = True
        except Exception as e:  # any failure of export or of the C++ build: recorded, then reported
            first = (str(e).strip().splitlines() or [""])[0][:300]
            reason = f"building {path} failed ({type(e).__name__}: {first})"
            try:
                failed.write_text(reason + "\n")
            except OSError:
                pass
            return None, reason
    try:
        opened = fam.open(path, key, dtype)
    except Exception as e:
        return None, f"loading {path} failed ({type(e).__name__}: {e}); delete it to rebuild"
    wrong = fam.check(opened, key, dtype)
    if wrong is not None:
        return None, f"{path} does not match the torch-ops quantizer ({wrong}); delete it to rebuild"
    return opened, f"{'built in' if built else 'loaded in'} {time.perf_counter() - start:.1f} s from {path}"


def _unbuildable(path: Path, failed: Path) -> str | None:
    """Why the library can be neither loaded nor built here, or None."""
    if not hasattr(torch._C, "_aoti") or not hasattr(torch._C._aoti, "AOTIModelContainerRunnerCpu"):
        return f"torch {torch.__version__} has no AOTInductor CPU runner"
    if path.exists():
        return None
    if failed.exists():
        return f"an earlier build failed ({failed.read_text().strip()}); delete {failed} to retry"
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH to build it (install g++ or set CXX)"
    return None

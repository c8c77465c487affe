"""Which activation quantizer the cpu backend's layers run: the compiled one (`kernels.cpu_aot`) or torch ops.

Chosen once per model at load by `FP8NOW_CPU_QUANTIZER`:
- `auto` (default): the compiled quantizer for the model's dtype and each activation kind in use, built
  on first use into `<cache>/cpu-kernels` (once per machine and torch version; tens of seconds, with a
  line on stderr), checked bit for bit against torch ops, then loaded in a millisecond by later runs.
  When it cannot be built (no C++ compiler, a failed build) or fails its check, torch ops run instead,
  with a warning and the reason in the load report; a failed build leaves a `.failed` file beside it
  so later runs do not retry (delete it to retry).
- `compiled`: the same, but any failure is an error.
- `torch`: torch ops only; nothing is built.
Both give the same bf16 activation bits; the compiled one is several times faster on large batches.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ..kernels import cpu_aot
from .linear import Fp8Linear
from .moe import Fp8Experts
from ..cache import cache_lock, cache_root

ENV = "FP8NOW_CPU_QUANTIZER"
MODES = ("auto", "compiled", "torch")
SUBDIR = "cpu-kernels"


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


@functools.cache
def compiled(kind: str, dtype: torch.dtype, folder: str) -> tuple[cpu_aot.Widened | None, str]:
    """The compiled quantizer from `folder` (built there first if missing), or None and why not.
    Once per process and (kind, dtype, folder)."""
    if dtype not in cpu_aot.DTYPES:
        return None, f"no compiled quantizer for {dtype} inputs"
    path = Path(folder) / cpu_aot.file_name(kind, dtype)
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
                    print(f"fp8now: compiling the CPU activation quantizer ({kind}, {cpu_aot.DTYPES[dtype]}) for "
                          f"this machine, once (tens of seconds) into {path.parent}", file=sys.stderr, flush=True)
                    cpu_aot.build(kind, dtype, path)
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
        widened = cpu_aot.Widened(path, dtype)
    except Exception as e:
        return None, f"loading {path} failed ({type(e).__name__}: {e}); delete it to rebuild"
    wrong = cpu_aot.check(widened, kind, dtype)
    if wrong is not None:
        return None, f"{path} does not match the torch-ops quantizer ({wrong}); delete it to rebuild"
    return widened, f"{'built in' if built else 'loaded in'} {time.perf_counter() - start:.1f} s from {path}"


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

"""The cpu backend's activation quantizer as one compiled C++ kernel: the same bf16 `q_x * s_x` as
`cpu.widened_activation`, in two passes over x instead of about ten torch ops.

The quantizer is written below as torch ops (`Widen`), exported with dynamic shapes and compiled ahead
of time by AOTInductor into a shared library for this machine (`build`; it needs a C++ compiler and
takes tens of seconds). `Widened` opens such a library with torch's AOTInductor runner: no dynamo, no
inductor at run time, a few microseconds per call. `check` compares a loaded quantizer bit for bit with
the torch-ops one on every bf16 value up to 448 and on random rows; only a quantizer that passes is used.

Rounding to e4m3 here is Veltkamp's split (`round_e4m3_split`): float operations only, which the
compiler vectorizes, where `cpu.round_e4m3_` uses integer operations on the bits. Inductor compiles
with floating-point contraction off (`-ffp-contract=off`), which the split needs; `check` would catch
a build where it is not.
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from ..numerics import ACT_RULE, scale_from_amax
from . import cpu

KINDS = ("token", "tensor", "group")
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SPLIT = float((1 << 20) + 1)   # Veltkamp's constant: 24 - 20 = 4 significant bits kept
_SUBNORMAL_MAGIC = 1.5 * 2 ** 14  # adding it leaves a float32 whose last bit is worth 2^-9
_MIN_NORMAL = 2.0 ** -6           # e4m3's smallest normal


def round_e4m3_split(y: torch.Tensor) -> torch.Tensor:
    """Float32 `y` rounded to the nearest e4m3 values (ties to even), for |y| <= 464 (cpu.round_e4m3_'s values).

    At or above 2^-6: `c = y * (2^20 + 1)` and `c - (c - y)` keep y's 4 leading significant bits,
    rounded to nearest even (Veltkamp's split of a 24-bit float). Below: e4m3's subnormal grid, a fixed
    spacing of 2^-9, by adding and subtracting 1.5 * 2^14.
    """
    c = y * _SPLIT
    normal = c - (c - y)
    subnormal = (y + _SUBNORMAL_MAGIC) - _SUBNORMAL_MAGIC
    return torch.where(y.abs() < _MIN_NORMAL, subnormal, normal)


class Widen(nn.Module):
    """bf16 `q_x * s_x` of x quantized by one activation kind: x [M, K] ("token", "tensor") or its
    zero-padded 1x128 groups [M, G, 128] ("group"); the output has x's shape."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rule = ACT_RULE[kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.abs()
        amax = a.amax() if self.rule == "tensor" else a.amax(dim=-1, keepdim=True)
        s = scale_from_amax(amax, self.rule)
        y = x.float()
        y = y * (torch.ones_like(s) / s) if self.rule == "tensor" else y / s  # as numerics does per rule
        return (round_e4m3_split(y) * s).to(cpu.WORK_DTYPE)


def _example(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """An input of the traced shape and its dynamic dimensions (rows, and columns or groups)."""
    rows, cols = torch.export.Dim("rows", min=1), torch.export.Dim("cols", min=1)
    if kind == "group":
        return torch.randn(8, 3, 128).to(dtype), {0: rows, 1: cols}
    return torch.randn(8, 384).to(dtype), {0: rows, 1: cols}


def file_name(kind: str, dtype: torch.dtype) -> str:
    """The library's name: its kind and dtype, and a digest of what it was built from and for (this
    file, torch, and the CPU: inductor compiles for the host's instruction set)."""
    if kind not in KINDS or dtype not in DTYPES:
        raise ValueError(f"no compiled quantizer for kind {kind!r} and dtype {dtype}")
    return f"widen-{kind}-{DTYPES[dtype]}-{digest(Path(__file__))}.so"


def digest(*sources: Path) -> str:
    """16 hex digits of the sources a library is built from, torch's version and this CPU."""
    h = hashlib.sha256()
    for source in sources:
        h.update(source.read_bytes())
    h.update(f"{torch.__version__}|{platform.machine()}|{_cpu_identity()}".encode())
    return h.hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (a library built for one CPU may not run on another)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.processor()}|{torch.backends.cpu.get_cpu_capability()}"
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(keep[:2])


def build(kind: str, dtype: torch.dtype, target: Path) -> None:
    """Compile `Widen(kind)` for inputs of `dtype` into the shared library `target` (written beside it,
    then renamed into place). Raises whatever the export or the C++ build raises."""
    x, dims = _example(kind, dtype)
    build_library(Widen(kind), (x,), (dims,), target)


def build_library(module: nn.Module, args: tuple, dynamic_shapes: tuple, target: Path) -> None:
    """Export `module` on `args` with `dynamic_shapes` and compile it by AOTInductor into the shared library
    `target` (written beside it, then renamed into place)."""
    import torch._inductor  # heavy; only here

    with warnings.catch_warnings(), tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        warnings.simplefilter("ignore")   # torch's deprecation notices about its own internals
        program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
        package = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tmp, "w.pt2"))
        with zipfile.ZipFile(package) as z:
            libs = [n for n in z.namelist() if n.endswith(".so")]
            if len(libs) != 1:
                raise RuntimeError(f"AOTInductor package {package} holds {len(libs)} shared libraries, expected 1")
            lib = z.extract(libs[0], tmp)              # created with the ordinary mode (umask)
        os.replace(lib, target)


class Widened:
    """A compiled quantizer for inputs of `dtype`: called on x in its kind's input shape."""

    __slots__ = ("dtype", "_runner")

    def __init__(self, path: Path, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._runner.run([x.contiguous()])[0]


def check(widened, kind: str, dtype: torch.dtype) -> str | None:
    """None if `widened` gives exactly `cpu.widened_activation`'s result on every value of `dtype` up to
    448 in magnitude (at scale 1, so each is rounded to e4m3 as it is) and on random rows of varied
    magnitude (zero rows, huge values); otherwise what differed."""
    for name, x in (("every value up to 448", _all_values(kind, dtype)), ("random rows", _random_rows(dtype))):
        want = cpu.widened_activation(x, kind)
        xg = cpu._grouped(x, kind)
        got = cpu._flat(widened(xg), x.shape[0], x.shape[1])
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{name}: got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
        same = (got == want) | (got.isnan() & want.isnan())
        if not bool(same.all()):
            i = int((~same).flatten().nonzero()[0])
            return (f"{name}: {int((~same).sum())} of {same.numel()} values differ, e.g. input "
                    f"{x.flatten()[i].item()!r} gave {got.flatten()[i].item()!r}, expected {want.flatten()[i].item()!r}")
    return None


def _all_values(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Values up to 448 in magnitude, in rows of 127 plus one 448 each (so every row's and 1x128 group's
    amax is 448 and its scale 1): every finite one of a 16-bit dtype; for float32, those within 3 ulps
    of each e4m3 value and of each midpoint between neighbours (the rounding boundaries)."""
    if dtype == torch.float32:
        e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        points = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2]).view(torch.int32)
        v = (points[:, None] + torch.arange(-3, 4, dtype=torch.int32)).clamp_min(0).flatten().view(torch.float32)
    else:
        top = int(torch.tensor(448.0, dtype=dtype).view(torch.int16))
        v = torch.arange(0, top + 1, dtype=torch.int32).to(torch.int16).view(dtype)
    v = torch.cat([v, -v])
    v = torch.cat([v, v.new_zeros(-v.numel() % 127)]).view(-1, 127)
    return torch.cat([v, v.new_full((v.shape[0], 1), 448.0)], dim=1)


def _random_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 300 (two and a half 1x128 groups) whose magnitudes span many binades."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * torch.exp2(torch.randint(-20, 12, (64, 300), generator=g).float())
    x[1] = 0
    x[2, 7] = 6e4
    return x.to(dtype)

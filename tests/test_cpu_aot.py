"""The cpu backend's compiled activation quantizer (kernels.cpu_aot, built by AOTInductor with this
machine's C++ compiler): its float-only rounding against torch's FP8 cast, its bits against the
torch-ops quantizer and numerics' bytes, whole models that give identical logits either way, the
check that refuses a wrong library, and what `FP8NOW_CPU_QUANTIZER` does when nothing can be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fp8now import Fp8Config, load
from fp8now.layers import cpu_quantizer
from fp8now.kernels import cpu, cpu_aot
from fp8now.cache import cache_root
from fp8now.numerics import quantize_activation
from fp8_oracle import round_fp8, varied
from test_cpu_backend import _near_every_boundary
from hang import HANG_S
from tiny import write_tiny_checkpoint

KINDS = ["token", "tensor", "group"]


def compiled(kind: str, dtype: torch.dtype = torch.bfloat16) -> cpu_aot.Widened:
    """The quantizer from the real cache folder (built there on first use, then shared by the tests)."""
    widened, note = cpu_quantizer.compiled(kind, dtype, str(cache_root() / cpu_quantizer.SUBDIR))
    assert widened is not None, note
    return widened


def test_split_rounding_is_the_cast_near_every_boundary():
    """Veltkamp's split (float operations only) against torch's FP8 cast and the table-driven oracle
    over every float32 near each e4m3 rounding boundary, subnormals and the clamp range included."""
    y = _near_every_boundary()
    got = cpu_aot.round_e4m3_split(y)
    assert torch.equal(got, y.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(got.double(), round_fp8(y.clamp(-448, 448).double()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k", [(1, 576), (7, 1), (7, 130), (300, 1536), (2048, 576)])
def test_compiled_is_numerics_bytes_times_scale(kind, m, k):
    """One rounding of numerics' `q * s` to bf16, as the torch ops give, on fresh varied rows (zero
    rows, a huge value; K off multiples of 128; more rows than one chunk of the torch ops)."""
    x = varied((m, k), torch.bfloat16, seed=m * k + len(kind), spread=8)
    x[m // 2] = 0
    x[0, k - 1] = 3e4
    q, s = quantize_activation(x, kind)
    if kind == "group":
        s = s.repeat_interleave(128, dim=1)[:, :k]
    want = (q.double() * s.double()).to(torch.bfloat16)
    got = cpu.widened_activation(x, kind, compiled(kind))
    assert got.shape == (m, k) and torch.equal(got, want)
    assert torch.equal(got, cpu.widened_activation(x, kind))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_input_dtypes(dtype):
    """fp16 and float32 models get their own library; every fp16 value up to 448 and float32 values
    around every rounding boundary pass the check, and random rows match the torch ops."""
    widened = compiled("token", dtype)
    assert widened.dtype == dtype and cpu_aot.check(widened, "token", dtype) is None
    x = varied((33, 200), dtype, seed=5, spread=6)
    assert torch.equal(cpu.widened_activation(x, "token", widened), cpu.widened_activation(x, "token"))
    # a bf16 input to the fp16 library is not passed to it: the torch ops run
    xb = x.to(torch.bfloat16)
    assert torch.equal(cpu.widened_activation(xb, "token", widened), cpu.widened_activation(xb, "token"))


def test_check_refuses_a_quantizer_that_differs():
    """A library that, say, skipped the rounding would be reported with an example value."""
    def unrounded(xg):                     # bf16 of x itself: no FP8 rounding at all
        return xg.to(torch.bfloat16)
    why = cpu_aot.check(unrounded, "token", torch.bfloat16)
    assert why is not None and "every value up to 448" in why and "differ" in why

    def scale_off_by_an_ulp(xg):           # right rounding, scale one float32 ulp too large
        a = xg.abs().amax(dim=-1, keepdim=True).float()
        s = torch.nextafter(torch.clamp_min(a / 448, 1e-12), torch.tensor(1.0))
        return (cpu.round_e4m3_(xg.float() / s) * s).to(torch.bfloat16)
    assert cpu_aot.check(scale_off_by_an_ulp, "token", torch.bfloat16) is not None


@pytest.mark.parametrize("scheme", ["channel", "block", "tensor-tensor"])
def test_whole_model_logits_identical(tmp_path, monkeypatch, scheme):
    """A real tiny Llama loaded with the compiled quantizer and with torch ops: identical logits
    (prefill of 40 tokens and a decode step), and the report says which quantizer runs."""
    folder = write_tiny_checkpoint(tmp_path / "llama", "llama")
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    for how in ("compiled", "torch"):
        monkeypatch.setenv(cpu_quantizer.ENV, how)
        model, report = load(folder, Fp8Config(scheme=scheme), device="cpu", measure_error=False)
        kind = {"channel": "token", "block": "group", "tensor-tensor": "tensor"}[scheme]
        assert report.cpu_quantizer.startswith(f"{kind}: compiled" if how == "compiled" else "torch ops")
        with torch.inference_mode():
            out[how] = [model(input_ids=ids).logits, model(input_ids=ids[:, :1]).logits]
    assert all(torch.equal(a, b) for a, b in zip(out["compiled"], out["torch"]))


def test_nothing_to_build_with(tmp_path, monkeypatch):
    """No compiler: `auto` warns and runs torch ops (said in the report), `compiled` refuses with the
    reason; a remembered failed build is not retried; an unknown mode is named."""
    folder = write_tiny_checkpoint(tmp_path / "llama", "llama")
    monkeypatch.setenv("FP8NOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(cpu_quantizer.ENV, "auto")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        model, report = load(folder, Fp8Config(), device="cpu", measure_error=False)
    assert "token: torch ops (no C++ compiler" in report.cpu_quantizer
    assert all(m.act_quantizer is None for m in model.modules() if hasattr(m, "act_quantizer"))
    monkeypatch.setenv(cpu_quantizer.ENV, "compiled")
    with pytest.raises(RuntimeError, match="FP8NOW_CPU_QUANTIZER=compiled, but no C\\+\\+ compiler"):
        load(folder, Fp8Config(), device="cpu", measure_error=False)
    monkeypatch.delenv("CXX")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / (cpu_aot.file_name("token", torch.bfloat16) + ".failed")).write_text("g++: internal error\n")
    widened, why = cpu_quantizer.compiled("token", torch.bfloat16, str(other))
    assert widened is None and "an earlier build failed (g++: internal error)" in why and ".failed" in why
    monkeypatch.setenv(cpu_quantizer.ENV, "fast")
    with pytest.raises(ValueError, match="FP8NOW_CPU_QUANTIZER='fast'.*auto, compiled, torch"):
        load(folder, Fp8Config(), device="cpu", measure_error=False)


def test_cli_run_says_which_quantizer_and_generates_the_same(tmp_path, monkeypatch, capsys):
    """`fp8now run --json` with the compiled quantizer as a subprocess (a fresh process finds and checks the
    library), with torch ops through main() in this process (cli_here): the same greedy text."""
    from cli_here import fp8now_here
    from test_evaluate import save_byte_tokenizer
    folder = write_tiny_checkpoint(tmp_path / "llama", "llama")
    save_byte_tokenizer(folder)
    args = ("run", str(folder), "--max-new-tokens", "6", "--json")
    compiled = subprocess.run([sys.executable, "-m", "fp8now", *args], capture_output=True, text=True,
                              timeout=HANG_S, env={**os.environ, cpu_quantizer.ENV: "compiled"})
    monkeypatch.setenv(cpu_quantizer.ENV, "torch")
    texts = {}
    for how, proc in (("compiled", compiled), ("torch", fp8now_here(capsys, *args))):
        assert proc.returncode == 0, proc.stderr
        entry = json.loads(proc.stdout)["schemes"]["channel"]
        assert entry["report"]["cpu_quantizer"].startswith("token: compiled" if how == "compiled" else "torch ops")
        texts[how] = [(g["text"], g["new_tokens"]) for g in entry["results"]["generations"]]
    assert texts["compiled"] == texts["torch"] and all(n >= 1 for _, n in texts["torch"])

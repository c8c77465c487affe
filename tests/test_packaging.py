"""Packaging: Triton only where it runs, the license field, and a CPU install that never imports Triton."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from hang import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_triton_only_in_the_gpu_and_test_extras():
    project = _project()["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    with_triton = {name for name, deps in extras.items() if any(d.startswith("triton") for d in deps)}
    assert with_triton == {"gpu", "test"}


def test_license_is_a_pep_639_expression_with_a_new_enough_setuptools():
    data = _project()
    assert data["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in data["build-system"]["requires"])


def test_a_cpu_load_and_forward_never_import_triton(tmp_path):
    """With `triton` unimportable (as on a CPU install), fp8now loads a checkpoint and runs it on CPU."""
    from tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "tiny", "llama")
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, fp8now\n"
            f"model, report = fp8now.load({str(path)!r}, fp8now.Fp8Config(scheme='block'), device='cpu')\n"
            "logits = model(torch.arange(8)[None]).logits\n"
            "assert torch.isfinite(logits).all() and logits.shape == (1, 8, 512)\n"
            "print(sorted({row.backend for row in report.layers}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['cpu']"

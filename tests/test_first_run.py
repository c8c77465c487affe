"""What a new user meets first: the README snippet, run's figures and eval's quiet progress through the real CLI
as a subprocess; run's other modes, errors for a folder without tokenizer and for a file given as MODEL, and
help texts with defaults through main() in this process (cli_here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_here import fp8now_here
from tiny import write_tiny_checkpoint

from test_cli import one_error_line
from test_evaluate import save_byte_tokenizer
from test_models import embedded_model_dir, needs_gguf
from hang import HANG_S

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m fp8now ARGS` on a tiny model (no embedded-model cache needed)."""
    return subprocess.run([sys.executable, "-m", "fp8now", *args], capture_output=True, text=True,
                          timeout=HANG_S)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("first") / "llama", "llama")
    save_byte_tokenizer(path)
    return path


def test_run_modes_and_honest_figures(tiny_dir, capsys):
    """The default (greedy) run as a real subprocess: its load and RSS figures are its own process's; the
    other modes through main() here."""
    greedy = cli("run", str(tiny_dir), "--max-new-tokens", "3", "--device", "cpu")   # default: greedy
    assert greedy.returncode == 0, greedy.stderr
    out = greedy.stdout
    assert "--- greedy: " in out and "--- sampled" not in out and "after a 3-token warm-up" in out
    load = re.search(r"load: ([\d.]+) s; peak RSS by its end ([\d.]+) MiB, RSS after it ([\d.]+) MiB", out)
    peak = re.search(r"process peak RSS: ([\d.]+) MiB", out)
    assert load and peak, out
    assert float(load[1]) > 0 and float(load[3]) <= float(load[2]) <= float(peak[1])
    assert "backends: cpu x14" in out
    both = fp8now_here(capsys, "run", str(tiny_dir), "--max-new-tokens", "2", "--mode", "both", "--seed", "3")
    assert both.returncode == 0, both.stderr
    assert "--- greedy: " in both.stdout and "--- sampled (temperature 0.7, seed 3)" in both.stdout
    sampled = fp8now_here(capsys, "run", str(tiny_dir), "--max-new-tokens", "2", "--mode", "sampled")
    assert "--- greedy" not in sampled.stdout and "--- sampled" in sampled.stdout, sampled.stderr


def test_missing_tokenizer_fails_before_any_weight_is_read(tmp_path, capsys):
    folder = write_tiny_checkpoint(tmp_path / "no-tokenizer", "llama")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")   # reading it would fail
    line = one_error_line(fp8now_here(capsys, "run", str(folder)))
    assert str(folder) in line and "no tokenizer files" in line and "tokenizer.json" in line
    assert "safetensors" not in line.split("(none of")[0]


def test_a_file_as_model_gets_its_own_message(tiny_dir, capsys):
    line = one_error_line(fp8now_here(capsys, "inspect", str(tiny_dir / "config.json")))
    assert "is a file" in line and str(tiny_dir) in line and "does not exist" not in line


def test_every_flag_shows_its_default(capsys):
    for command in ("run", "eval", "inspect"):
        proc = fp8now_here(capsys, command, "--help")
        assert proc.returncode == 0
        # option entries start at two spaces; their help may wrap over several lines
        entries = re.split(r"\n  (?=[-A-Z])", proc.stdout.split("options:")[0].split("positional arguments:")[1]
                           + proc.stdout.split("options:")[1])
        entries = [e for e in entries if e.strip() and not e.lstrip().startswith("-h, --help")]
        assert len(entries) >= 4, proc.stdout
        for entry in entries:
            assert "default" in " ".join(entry.split()), (command, entry)


def test_eval_is_quick_by_default_and_quiet_without_a_terminal(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("A quiet evaluation of a small text. " * 200)          # 7200 bytes = tokens
    proc = cli("eval", str(tiny_dir), "--text", str(text), "--seq-len", "512", "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"tokens": 4096' in proc.stdout and '"tokens_in_text": 7200' in proc.stdout
    assert "first 4096 tokens" in proc.stderr and "--max-tokens 0" in proc.stderr
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr and "tok/s" not in proc.stderr


def test_import_works_without_the_resource_module():
    code = ("import sys; sys.modules['resource'] = None\n"
            "import fp8now\nfrom fp8now.host_memory import peak_rss_bytes\n"
            "print(peak_rss_bytes() > 2**20)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr


@pytest.mark.slow
@needs_gguf
def test_the_readme_snippet_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert snippets, "README has no python snippet"
    path, _ = embedded_model_dir()
    env = {**os.environ, "FP8NOW_CACHE": str(path.parent)}
    proc = subprocess.run([sys.executable, "-c", snippets[0]], capture_output=True, text=True, env=env,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert "model.layers.29.mlp.down_proj" in proc.stdout


def test_device_auto_and_cuda_without_a_gpu(tiny_dir):
    import torch

    from fp8now.loading.load import load, resolve_device

    if torch.cuda.is_available():
        assert resolve_device("auto").type == resolve_device(None).type == "cuda"
        return
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"'cuda' was asked for.*sees no CUDA GPU.*device='cpu'"):
        load(tiny_dir, device="cuda")


@needs_gguf
def test_the_readme_first_command_runs_as_written():
    """README's first set-up command's `fp8now run` as a real subprocess on the embedded model (the words
    after `&&`, with a few new tokens): greedy text, the load report's lines, 210 FP8 layers on the cpu
    backend, and the CPU weight quantizer named."""
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n", readme)[1]
    args = first.split("&& python3 -m fp8now ", 1)[1]
    prompt = re.search(r'--prompt "([^"]+)"', args)[1]
    scheme = re.search(r"--scheme (\S+)", args)[1]
    path, _ = embedded_model_dir()
    env = {**os.environ, "FP8NOW_CACHE": str(path.parent)}
    proc = subprocess.run([sys.executable, "-m", "fp8now", "run", "--scheme", scheme, "--prompt", prompt,
                           "--max-new-tokens", "4"], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"scheme: {scheme}" in out and "--- greedy: " in out
    assert "quantized 210 layers (channel)" in out and "backends: cpu x210" in out
    assert "cpu weight quantizer: bfloat16: " in out

"""A checkpoint folder's own Python code never runs (issue 30 item 6), even with "y" typed at a prompt: the real
CLI as a subprocess (run), and main() in this process with "y" lines as its stdin (eval, inspect), on folders whose
config / tokenizer name custom code under `auto_map`."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_here import fp8now_here
from fp8now.loading.load import load
from tiny import write_tiny_checkpoint

from test_evaluate import save_byte_tokenizer
from hang import HANG_S

MARKER = "CUSTOM_CODE_RAN"


def _module(folder: Path, name: str, body: str) -> None:
    """A Python file in the folder that leaves a marker file as soon as it is imported."""
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path(__file__).with_name({MARKER!r}).write_text({name!r})\n{body}\n")


def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))


@pytest.fixture
def custom_tokenizer(tmp_path) -> Path:
    """A llama checkpoint whose tokenizer exists only as the folder's code; its config also names code."""
    folder = write_tiny_checkpoint(tmp_path / "custom", "llama")
    save_byte_tokenizer(folder)
    _edit_json(folder / "tokenizer_config.json", tokenizer_class="CustomTokenizer",
               auto_map={"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]})
    _module(folder, "custom_tok", "from transformers import PreTrainedTokenizerFast\n"
                                  "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass")
    _edit_json(folder / "config.json", auto_map={"AutoConfig": "custom_cfg.CustomConfig",
                                                 "AutoModelForCausalLM": "custom_cfg.CustomModel"})
    _module(folder, "custom_cfg", "from transformers import LlamaConfig, LlamaForCausalLM\n"
                                  "class CustomConfig(LlamaConfig):\n    pass\n"
                                  "class CustomModel(LlamaForCausalLM):\n    pass")
    return folder


def cli(*args: str) -> subprocess.CompletedProcess:
    """The real `fp8now` command, with "y" answered to any question it might ask."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "fp8now", *args], input="y\n" * 5, capture_output=True,
                          text=True, env=env, timeout=HANG_S)


@pytest.fixture
def here(monkeypatch, capsys):
    """`fp8now ARGS` in this process (cli_here), with "y" answered to any question it might ask."""
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 5))
    return lambda *args: fp8now_here(capsys, *args)


def _one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("fp8now eval: ")]  # eval's note
    assert len(lines) == 1 and lines[0].startswith("fp8now: error: "), proc.stderr[-2000:]
    assert "custom Python code" in lines[0] and "never runs code" in lines[0]
    assert "[y/N]" not in proc.stdout + proc.stderr
    return lines[0]


@pytest.mark.slow
def test_run_refuses_a_custom_tokenizer_and_runs_nothing(custom_tokenizer):
    line = _one_line_refusal(cli("run", str(custom_tokenizer), "--device", "cpu", "--max-new-tokens", "2"))
    assert "tokenizer" in line and "tokenizer_config.json" in line
    assert not (custom_tokenizer / MARKER).exists()


@pytest.mark.slow
def test_eval_refuses_a_custom_tokenizer_and_runs_nothing(custom_tokenizer, tmp_path, here):
    text = tmp_path / "t.txt"
    text.write_text("some words to evaluate on. " * 10)
    _one_line_refusal(here("eval", str(custom_tokenizer), "--device", "cpu", "--text", str(text),
                          "--seq-len", "32"))
    assert not (custom_tokenizer / MARKER).exists()


@pytest.mark.slow
def test_inspect_refuses_a_custom_architecture_and_runs_nothing(custom_tokenizer, here):
    _edit_json(custom_tokenizer / "config.json", model_type="custom-llama")
    proc = here("inspect", str(custom_tokenizer), "--device", "cpu")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "auto_map" in proc.stderr and "not known" in proc.stderr
    assert not (custom_tokenizer / MARKER).exists()


def test_a_built_in_model_type_loads_without_its_auto_map_code(custom_tokenizer):
    model, _ = load(custom_tokenizer, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM" and type(model.config).__name__ == "LlamaConfig"
    assert not (custom_tokenizer / MARKER).exists()

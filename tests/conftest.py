import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # the tests' own helpers (fp8_oracle, tiny)
# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

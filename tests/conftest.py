import os
import shutil
import sys
import tempfile

# Parallel workers (pytest-xdist, `-n auto`) share the machine's cores: each runs torch on one thread, and so do
# the processes it starts (OMP_NUM_THREADS is inherited). Intra-op threads that wait on a core another worker
# holds run many times slower than one thread. Set before torch is imported, for its OpenMP pool.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))  # the tests' own helpers (fp8_oracle, tiny)
# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The cpu backend's compiled activation quantizer is built once per machine (tens of seconds) into the
# fp8now cache, which many tests move to a temporary folder: tests run its torch-ops twin, which gives
# the same bits, unless they ask otherwise (test_cpu_aot.py compares the two).
os.environ.setdefault("FP8NOW_CPU_QUANTIZER", "torch")
SHARED = "FP8NOW_TEST_SHARED"   # a folder all workers of one run share (the embedded model's converted cache)


def pytest_configure(config):
    """The run's shared folder, made by the controlling process before its workers start (they inherit it)."""
    if not hasattr(config, "workerinput") and SHARED not in os.environ:
        os.environ[SHARED] = tempfile.mkdtemp(prefix="fp8now-test-shared-")
        config._fp8now_shared = os.environ[SHARED]


def pytest_unconfigure(config):
    shared = getattr(config, "_fp8now_shared", None)
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)

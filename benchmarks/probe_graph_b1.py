"""Probe (issue 38): `tests/test_gpu_producers.py::test_stacked_gemvs_give_the_same_decode_steps[graph-*]` (the tests'
tiny Llama: 2 layers, hidden 1024, 2 KV heads, a 17-slot StaticCache; a batch-1 decode step captured in one CUDA
graph, replayed four times, for a model without and then one with the stacked GEMVs) ends in a device-side assert
inside `graph.replay()` on the H100 (the StaticCache's `index_copy_` past its end, or the embedding's lookup past
the vocabulary: a small index tensor read wrong).

What is known (H100, 687390d): the test fails alone in a fresh pytest process, also with per-layer decode graphs
off, with the producers' kernels off, with a device sync after every replay, and with torch's cuDNN attention off.
The same sequence run as a plain script passes every time: the former variants of this probe (bf16 and fp8now,
one or two models, cloned or not, stacking on or off, cuDNN on or off, batch 2 and 4, context 512, PDL off,
quantized inside the GEMMs) all replayed four times with the ids, positions, mask and cache positions intact.
Eager batch-1 steps under compute-sanitizer's memcheck (caching allocator off) show fp8now's kernels clean and
one out-of-bounds read in torch's cuDNN SDPA kernel (4 bytes at offset 32 of the 34-byte mask), with cuDNN off none.

So what differs is the pytest process (allocation history, garbage-collection timing, ...), not the step. Each
variant below runs the failing test in a process of its own (a device-side assert poisons its process), `-l` to
show which model (`stacked`) failed: as the suite runs it, with the garbage collector off, with expandable
segments (another allocation layout), and under compute-sanitizer's memcheck (whole-step graph; the caching
allocator on, so it sees accesses outside torch's segments only). Usage:
PYTHONPATH=src:tests python benchmarks/probe_graph_b1.py [--out FILE]."""
import argparse
import json
import os
import shutil
import subprocess
import sys

NODE = "tests/test_gpu_producers.py::test_stacked_gemvs_give_the_same_decode_steps[graph-channel]"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-l", "-p", "no:cacheprovider", "-m", "gpu", NODE]
GC_OFF = [sys.executable, "-c", "import gc, sys, pytest; gc.disable(); sys.exit(pytest.main(sys.argv[1:]))",
          *PYTEST[3:]]
SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
# label -> (command, extra environment)
VARIANTS = {
    "as the suite runs it": (PYTEST, {}),
    "garbage collector off": (GC_OFF, {}),
    "expandable segments": (PYTEST, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "memcheck": ([SANITIZER, "--tool", "memcheck", "--print-limit", "8", *PYTEST], {}),
}


def summary(text: str) -> dict:
    """Pass/fail, which model failed (pytest -l shows the loop's `stacked`), and the sanitizer's findings."""
    lines = text.splitlines()
    result = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln), lines[-1] if lines else "")
    stacked = [ln.strip() for ln in lines if ln.strip().startswith("stacked ") and "=" in ln]
    found = sorted({ln.strip() for ln in lines if ln.startswith("=========") and (
        "Invalid" in ln or " at " in ln or "out of bounds" in ln or "nearest allocation" in ln)})
    return {"result": result.strip(), "failed model": stacked[:1], "sanitizer": found[:12]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for label, (cmd, env) in VARIANTS.items():
        if cmd[0] == SANITIZER and not os.path.exists(SANITIZER):
            rows.append({"label": label, "result": f"no compute-sanitizer at {SANITIZER}"})
            continue
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, **env))
            row = {"label": label, **summary(r.stdout + r.stderr)}
        except subprocess.TimeoutExpired:
            row = {"label": label, "result": "timed out (240 s)"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Probe (issue 37): reload_weights of every bench preset in /tmp/fp8now-bench on the GPU, with this tree's src and
with the base commit's (.base/src, FP8NOW_SRC): median seconds, the host profile's top, the GPU kernels' top."""
import cProfile
import glob
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.environ.get("FP8NOW_SRC", "src"))
import torch  # noqa: E402

import fp8now  # noqa: E402
from safetensors import safe_open  # noqa: E402

print("fp8now from", fp8now.__file__)
rows = []
for folder in sorted(glob.glob("/tmp/fp8now-bench/*-seed*")):
    cfg = fp8now.Fp8Config(scheme="channel")
    model, _ = fp8now.load(folder, cfg, device="cuda")   # warm
    del model
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    pr = cProfile.Profile()
    pr.enable()
    model, _ = fp8now.load(folder, cfg, device="cuda")
    torch.cuda.synchronize()
    pr.disable()
    load_s = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"== load {folder} {load_s:.3f} s (profiled)")
    print(s.getvalue()[-4500:])
    tensors = {}
    for path in sorted(glob.glob(f"{folder}/*.safetensors")):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).to("cuda")
    fp8now.reload_weights(model, tensors)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fp8now.reload_weights(model, tensors)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    pr = cProfile.Profile()
    pr.enable()
    fp8now.reload_weights(model, tensors)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-4000:])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fp8now.reload_weights(model, tensors)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10)[-2500:])
    times.sort()
    row = {"model": os.path.basename(folder), "src": os.environ.get("FP8NOW_SRC", "src"), "median_s": times[2],
           "min_s": times[0], "tensors": len(tensors),
           "load_profiled_s": load_s}
    print(json.dumps(row))
    rows.append(row)
    del model, tensors
    torch.cuda.empty_cache()

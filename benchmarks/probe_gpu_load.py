"""Probe (issue 37, one GPU call): what a GPU load holds on the device beyond the FP8 model, and what reload
costs against a device copy. Prints a table; writes $OUT/probe_gpu_load.json. Leaves the tree once answered.

A. a 1.2B Llama-shaped checkpoint (tests/test_gpu_memory.py's), loaded with each reader setting (bytes in flight,
   chunk) and error-measurement setting: excess = device peak - model bytes, and seconds;
B. error_stats of one 14336 x 4096 weight with each GPU chunk size;
C. reload_weights of the 1.2B model's tensors (on the GPU) against a device copy, and a profile of one reload.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_gpu_memory import write_llama_checkpoint  # noqa: E402

import fp8now  # noqa: E402
from fp8now import Fp8Config  # noqa: E402
from fp8now.config import Scheme  # noqa: E402
from fp8now.kernels import quantize_weight  # noqa: E402
from fp8now.layers import weight_error  # noqa: E402
from fp8now.loading import reader  # noqa: E402

MIB = 1 << 20
rows = []


def timed(fn, reps=5):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


folder = write_llama_checkpoint(Path(tempfile.mkdtemp()) / "ckpt")
fp8now.load(folder, Fp8Config(scheme="channel"), device="cuda")   # compile everything once
for scheme in ("channel", "block"):
    for in_flight, chunk in ((512, 32), (64, 8), (32, 4)):
        for measure in (False, True):
            reader.IN_FLIGHT["cuda"], reader.CHUNK["cuda"] = in_flight * MIB, chunk * MIB
            torch.cuda.empty_cache()
            model, rep = fp8now.load(folder, Fp8Config(scheme=scheme), device="cuda", measure_error=measure)
            largest = max(2 * r.n * r.k for r in rep.layers)
            excess = rep.peak_device_bytes - rep.device_bytes_at_start - rep.model_bytes
            rows.append({"probe": "load-1b", "scheme": scheme, "in_flight_mib": in_flight, "chunk_mib": chunk,
                         "measure_error": measure, "seconds": rep.load_s,
                         "excess_mib": excess / MIB, "largest_layer_mib": largest / MIB,
                         "bound_excess_mib": (1.25 * largest + 64 * MIB) / MIB})
            del model
reader.IN_FLIGHT["cuda"], reader.CHUNK["cuda"] = 64 * MIB, 8 * MIB

w = 0.02 * torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
for scheme in ("channel", "block"):
    q, s = quantize_weight(w, Scheme.parse(scheme))
    for err_chunk in (None, 256, 32):   # None: the one Triton pass; else torch ops in chunks of that many MiB
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sec = timed(lambda: weight_error.error_stats(w, q, s, Scheme.parse(scheme),
                                                     err_chunk and err_chunk * MIB))
        rows.append({"probe": "error_stats-14336x4096", "scheme": scheme, "error_chunk_mib": err_chunk,
                     "ms": 1e3 * sec, "temp_mib": (torch.cuda.max_memory_allocated() - base) / MIB})
    rows.append({"probe": "quantize-14336x4096", "scheme": scheme,
                 "ms": 1e3 * timed(lambda: quantize_weight(w, Scheme.parse(scheme)))})

from safetensors.torch import load_file  # noqa: E402

model, _ = fp8now.load(folder, Fp8Config(scheme="channel"), device="cuda")
tensors = {}
for p in sorted(folder.glob("*.safetensors")):
    tensors.update({k: v.cuda() for k, v in load_file(str(p)).items()})
nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
dst = {k: torch.empty_like(v) for k, v in tensors.items()}
copy_s = timed(lambda: [dst[k].copy_(v) for k, v in tensors.items()])
reload_s = timed(lambda: fp8now.reload_weights(model, tensors))
stream_s = timed(lambda: fp8now.reload_weights(model, iter(tensors.items())))
rows.append({"probe": "reload-1b", "gb": nbytes / 1e9, "reload_s": reload_s, "stream_s": stream_s,
             "copy_s": copy_s, "ratio": reload_s / copy_s, "stream_ratio": stream_s / copy_s,
             "tensors": len(tensors)})
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    fp8now.reload_weights(model, tensors)
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
print(table)
print(cpu_table)

out = Path(os.environ.get("OUT", "/tmp/out"))
out.mkdir(parents=True, exist_ok=True)
(out / "probe_gpu_load.json").write_text(json.dumps({"meta": {"gpu": torch.cuda.get_device_name(),
                                                              "torch": torch.__version__}, "rows": rows}, indent=1))
(out / "probe_reload_profile.txt").write_text(table + "\n" + cpu_table)
for r in rows:
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})

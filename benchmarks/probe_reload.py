"""Probe (issue 37): why the Qwen3-30B-A3B preset's reload_weights went from 3.4x to 4.6-4.8x a device copy between
02ebf25 and HEAD. Runs each source tree given (PYTHONPATH per child) on the same GPU and checkpoint: median reload
wall time, the GPU time its kernels take (torch.profiler), launch count and the host's top Python functions.
Usage: python benchmarks/probe_reload.py OUT.json SRC_DIR [SRC_DIR ...]"""
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import cProfile, io, json, pstats, sys, time, torch
from pathlib import Path
from safetensors import safe_open
import fp8now
folder = Path(sys.argv[1]); dev = torch.device(sys.argv[2])
model, _ = fp8now.load(str(folder), fp8now.Fp8Config(scheme="channel"), device=dev)
tensors = {}
for p in sorted(folder.glob("*.safetensors")):
    with safe_open(str(p), framework="pt", device="cpu") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k).to(dev)
sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
copies = {k: torch.empty_like(t) for k, t in tensors.items()}
def timed(fn, reps):
    out = []
    for _ in range(reps):
        sync(); t0 = time.perf_counter(); fn(); sync()
        out.append(time.perf_counter() - t0)
    return sorted(out)
rl = lambda: fp8now.reload_weights(model, tensors)
timed(rl, 2)
walls = timed(rl, 7)
copy = timed(lambda: [copies[k].copy_(t) for k, t in tensors.items()], 5)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]) as prof:
    rl(); sync()
kern = {}
for e in prof.key_averages():
    if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
        t = getattr(e, "self_device_time_total", 0)
        if t > 0:
            kern[e.key] = (e.count, t)
pr = cProfile.Profile(); pr.enable(); rl(); sync(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
print(s.getvalue()[-6000:], file=sys.stderr)
top = sorted(kern.items(), key=lambda kv: -kv[1][1])[:12]
print(json.dumps({"wall_ms": [w * 1e3 for w in walls], "copy_ms": copy[len(copy) // 2] * 1e3,
                  "gpu_ms": sum(t for _, t in kern.values()) / 1e3, "launches": sum(c for c, _ in kern.values()),
                  "top_kernels": [[k, c, t / 1e3] for k, (c, t) in top]}))
'''


def main() -> None:
    out, srcs = sys.argv[1], sys.argv[2:]
    from fp8now.cli.bench_presets import bench_model_dir
    dev = os.environ.get("PROBE_DEVICE", "cuda")   # cpu: a smoke test of this script on the tiny preset
    name, folder = bench_model_dir("qwen3-30b-a3b" if dev == "cuda" else "tiny", Path("/tmp/fp8now-bench"), None, dev,
                                   log=print)
    rows = []
    for src in srcs:
        env = dict(os.environ, PYTHONPATH=f"{src}:{os.environ.get('PYTHONPATH', '')}")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), dev], env=env, capture_output=True, text=True)
        print(f"== {src}\n" + proc.stderr[-5000:])
        line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        rows.append({"src": src, **(json.loads(line[-1]) if line else {"error": proc.stderr[-800:]})})
    json.dump({"rows": rows}, open(out, "w"), indent=1)
    for r in rows:
        if "error" in r:
            print(r["src"], "error")
            continue
        w = r["wall_ms"]
        print(f"{r['src']:>28}: reload median {w[len(w)//2]:.1f} ms (min {w[0]:.1f}), copy {r['copy_ms']:.1f} ms, "
              f"ratio {w[len(w)//2] / r['copy_ms']:.2f}x; GPU kernels {r['gpu_ms']:.1f} ms in {r['launches']} launches")
        for k, c, t in r["top_kernels"][:8]:
            print(f"    {t:8.2f} ms {c:6d}x {k[:90]}")


if __name__ == "__main__":
    main()

"""The load (and reload) rows of a whole-model benchmark, each implementation alone in a fresh process: nothing
of an earlier model is resident, and the process's host peak is its own.

load:   wall seconds from the folder to a ready model, GB/s of checkpoint bytes, the device's peak, the process's
        host peak and its resident set before the load; `cold`: the files evicted from the page cache first.
reload: (fp8now) `reload_weights` of every checkpoint tensor, already on the device in its own dtype, against a
        device copy of the same bytes (the floor: reading and writing them once); GB/s of that input.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..host_memory import current_rss_bytes, peak_rss_bytes
from .bench_load import Loader, read_through, resident_bytes

GB = 1e9


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def evict(folder: Path) -> None:
    """Drop the checkpoint's files from the page cache (a cold load reads the disk)."""
    for path in Path(folder).glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _touch(model) -> None:
    """Read every parameter and buffer once."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.numel():
                t.reshape(-1).view(torch.uint8).max()


def _median(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _copier(tensors: dict[str, torch.Tensor]):
    """A call that copies every tensor into a buffer of its own (the floor of a reload: its bytes moved once)."""
    copies = {k: torch.empty_like(t) for k, t in tensors.items()}
    return lambda: [copies[k].copy_(t) for k, t in tensors.items()]


def reload_row(model, folder: Path, device: torch.device, reps: int = 3) -> dict:
    """reload_weights of the checkpoint's own tensors on `device` against a device copy of their bytes."""
    from safetensors import safe_open

    import fp8now

    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).to(device)
    nbytes = sum(t.nbytes for t in tensors.values())
    floor = _median(_copier(tensors), device, reps)
    seconds = _median(lambda: fp8now.reload_weights(model, tensors), device, reps)
    return {"phase": "reload", "seconds": seconds, "gb_per_s": nbytes / seconds / GB, "copy_s": floor,
            "peak_gb": torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None,
            "copy_gb_per_s": nbytes / floor / GB, "ratio_to_copy": seconds / floor, "input_gb": nbytes / GB}


def run_alone(loader: Loader, folder: Path, device: torch.device, cold: bool, reload: bool) -> list[dict]:
    """In this (fresh) process: the load row of `loader`, and its reload row when asked."""
    if device.type == "cuda":   # the CUDA context, untimed for every implementation
        torch.zeros(1, device=device).sum().item()
    if hasattr(loader, "warm"):
        loader.warm(folder, device)
    if cold:
        evict(folder)
    else:
        read_through(folder)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = current_rss_bytes() or 0
    t0 = time.perf_counter()
    model, _ = loader(folder, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:   # a CPU load may leave weights mapped from the files: one pass reads every byte, as a first forward would
        _touch(model)
    seconds = time.perf_counter() - t0
    nbytes = checkpoint_bytes(folder)
    rows = [{"phase": "load", "cold": cold, "seconds": seconds, "gb_per_s": nbytes / seconds / GB,
             "checkpoint_gb": nbytes / GB, "resident_gb": resident_bytes(model) / GB,
             "peak_gb": torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None,
             "host_peak_gb": (peak_rss_bytes() or 0) / GB,   # VmHWM: this process image's own
             "host_before_gb": base / GB}]
    if reload:
        rows.append(reload_row(model, folder, device))
    return rows


def measure_alone(argv: list[str], impl: str, folder: Path, device: torch.device, cold: bool, reload: bool,
                  timeout: float = 1800) -> list[dict]:
    """Run `argv + ["--alone", impl, ...]` (a script whose `--alone` mode calls `alone_main`) and return its rows;
    a failure is one row with `error`."""
    cmd = [*argv, "--alone", impl, "--alone-folder", str(folder), "--device", str(device)]
    cmd += ["--cold"] * cold + ["--alone-reload"] * reload
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return [{"phase": "load", "cold": cold, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]}]
    return [json.loads(line) for line in lines]


def alone_main(loader: Loader, folder: str, device: str, cold: bool, reload: bool) -> None:
    """The child's side: print each row as one JSON line."""
    for row in run_alone(loader, Path(folder), torch.device(device), cold, reload):
        print(json.dumps(row), flush=True)
    sys.stdout.flush()


def loader_of(name: str) -> Loader:
    """The loader of a package implementation name: bf16, fp8now-<scheme>, fp8now-<scheme>-fast (fast_accum),
    fp8now-<scheme>-full (head and embedding in FP8 too)."""
    from .bench_load import bf16_loader, fp8now_loader

    if name == "bf16":
        return bf16_loader
    parts = name.split("-")
    if parts[0] != "fp8now" or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("fast", "full")):
        raise SystemExit(f"unknown implementation {name!r}: bf16, fp8now-<scheme>[-fast|-full]")
    extra = parts[2] if len(parts) == 3 else ""
    return fp8now_loader(parts[1], fast_accum=extra == "fast", head=extra == "full", embedding=extra == "full")


if __name__ == "__main__":   # python -m fp8now.cli.bench_alone --alone IMPL --alone-folder DIR --device D [...]
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--alone", required=True)
    ap.add_argument("--alone-folder", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--alone-reload", action="store_true")
    a = ap.parse_args()
    alone_main(loader_of(a.alone), a.alone_folder, a.device, a.cold, a.alone_reload)

"""Probe (issue 38): `Table(stacked_gemv=True)`'s eager GPU tests (tests/test_gpu_producers.py) passed on an H100 but
left a device-side assert in their process: the next model's `index_copy_` (the StaticCache write) or embedding
lookup found an index out of range, so a small index tensor had been overwritten. This runs the tests' eager
one-token steps (tiny Llama, channel then block, unstacked then stacked), and after every module's forward
synchronizes and compares the step's index tensors (input ids, position, mask, the values the step resets the
cache positions to) with their first values and checks the cache positions themselves: it names the first module
after which one changed; then, as the tests did next, loads a fresh model and captures its step in one CUDA graph
(where the tests' fault showed). Run it with CUDA_LAUNCH_BLOCKING=1 (a faulting launch then raises at its own
call). Usage: PYTHONPATH=src:tests python benchmarks/probe_stacked.py (DEV=cpu: a smoke run)."""
import gc
import os
import tempfile
import traceback
from pathlib import Path

import torch

import fp8now
from fp8now import Fp8Config, Fp8Linear
from fp8now.cli.bench_decode import captured, decode_step
from fp8now.kernels.plan import WIDE, Table
from tiny import write_tiny_checkpoint

SIZES = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             num_hidden_layers=2, vocab_size=512)   # tests/test_gpu_producers.py's model
DEV = os.environ.get("DEV", "cuda")
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def run(folder, scheme, stacked):
    """Four eager one-token steps, the index tensors checked after every module; -> the logits."""
    model, _ = fp8now.load(folder, Fp8Config(scheme=scheme), device=DEV)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_table(Table(stacked_gemv=stacked, gemv=(("channel", 1, 0, WIDE), ("block", 1, 0, WIDE))))
    step = decode_step(model, 1, 16, 512, seed=7, device=torch.device(DEV))
    cells = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
    guards = {k: cells[k] for k in ("ids", "step_pos", "mask")}
    guards.update({f"cache start {i}": t for i, t in enumerate(cells["starts"])})   # the per-step reset's values
    want = {k: v.clone() for k, v in guards.items()}
    counters = cells["counters"]   # each layer's cache position: 16 after the reset, 17 after its write
    found = []

    def check(name):
        SYNC()
        bad = [k for k, v in guards.items() if not torch.equal(v, want[k])]
        bad += [f"cache position {i}" for i, c in enumerate(counters) if not 16 <= int(c.max()) <= 17]
        if bad and not found:
            found.append(name)
            print(f"  CHANGED after {name}: {bad} -> {[guards[k].tolist() for k in bad if k in guards]}", flush=True)
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: check(n)) for n, m in model.named_modules()]
    outs = []
    for i in range(4):
        outs.append(step().clone())
        SYNC()
        print(f"  {scheme} stacked={stacked} step {i}: logits sum {outs[-1].float().sum().item():.4f}", flush=True)
    for h in hooks:
        h.remove()
    del model, step, cells, guards
    gc.collect()
    SYNC()
    print(f"  {scheme} stacked={stacked}: freed, synchronized", flush=True)
    return outs


def after(folder):
    """What the tests ran next, where their fault showed: a fresh model, its step captured in one CUDA graph."""
    model, _ = fp8now.load(folder, Fp8Config(scheme="channel"), device=DEV)
    print("  next model loaded", flush=True)
    step = decode_step(model, 1, 16, 512, seed=7, device=torch.device(DEV))
    print("  next model's prefill done", flush=True)
    if DEV == "cuda":
        step = captured(step, "graph", torch.device(DEV))
    print(f"  next model's steps: logits sum {sum(step().float().sum().item() for _ in range(2)):.4f}", flush=True)


def main():
    folder = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "llama", "llama", seed=5, **SIZES)
    try:
        for scheme in ("channel", "block"):
            a, b = run(folder, scheme, False), run(folder, scheme, True)
            print(scheme, "stacked steps equal the unstacked ones:", all(torch.equal(x, y) for x, y in zip(a, b)),
                  flush=True)
        after(folder)
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()

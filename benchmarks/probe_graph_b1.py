"""Probe (issue 38): one decode step of the tests' tiny Llama (tests/test_gpu_producers.py) captured in one CUDA graph
at batch 1 fails its second replay on the H100 with a device-side assert (`index_copy_`: the StaticCache write past
its end; in another run the embedding's lookup past the vocabulary). The first replay passes, eager steps pass,
batch 4 passes, Llama-3.1-8B's batch-1 graph in bench_model passes; stacking the one-token GEMVs, the GEMV table
and the per-layer decode graphs each made no difference (701c750, all six combinations failed at replay 1). A
suspect outside fp8now: torch's cuDNN attention, which the H100's profiles show at decode, has open reports of
corrupting memory and outputs (pytorch/pytorch#193893: fewer than 8 KV heads, as here with 2; #169849), so the
variants include it switched off.

Each variant below runs in a process of its own (a device-side assert poisons its process) with
CUDA_LAUNCH_BLOCKING=1: the model in bf16 (is it fp8now at all?), fp8now with one thing changed at a time. After the
first replay it compares the step's index tensors (ids, position, mask, the values the step resets the cache
positions to) with their values before, and every layer's cache position with 17, and names what changed; then it
replays three more times. Usage: PYTHONPATH=src:tests python benchmarks/probe_graph_b1.py [--out FILE]."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             num_hidden_layers=2, vocab_size=512)
# label -> (implementation, batch, context, Table fields, Fp8Config fields, cuDNN attention allowed)
VARIANTS = {
    "bf16": ("bf16", 1, 16, {}, {}),
    "bf16, cuDNN attention off": ("bf16", 1, 16, {}, {}, False),
    "fp8now": ("fp8now", 1, 16, {}, {}),
    "fp8now, cuDNN attention off": ("fp8now", 1, 16, {}, {}, False),
    "fp8now batch 2": ("fp8now", 2, 16, {}, {}),
    "fp8now batch 4": ("fp8now", 4, 16, {}, {}),   # the tests' passing batch-4 graph had quant-inside too
    "fp8now context 512": ("fp8now", 1, 512, {}, {}),
    "fp8now, producers off": ("fp8now", 1, 16, {"producer_kernels": []}, {}),
    "fp8now, PDL off": ("fp8now", 1, 16, {"pdl_max_m": 0}, {}),
    "fp8now, quantized inside the GEMMs": ("fp8now", 1, 16, {"quant_inside": "QUANT_INSIDE"}, {}),
    "fp8now, no per-layer graphs": ("fp8now", 1, 16, {}, {"decode_graphs": False}),
}


def child(folder: str, impl: str, batch: int, context: int, table: dict, config: dict, cudnn: bool = True) -> dict:
    import torch
    import fp8now
    from fp8now import Fp8Config, Fp8Linear
    from fp8now.cli.bench_decode import captured, decode_step
    from fp8now.kernels import plan

    torch.backends.cuda.enable_cudnn_sdp(cudnn)   # pytorch/pytorch#193893: cuDNN SDPA, fewer than 8 KV heads

    if impl == "bf16":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    else:
        model, _ = fp8now.load(folder, Fp8Config(scheme="channel", **config), device="cuda")
        fields = {k: (getattr(plan, v) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v)
                  for k, v in table.items()}
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.use_table(plan.Table(**fields))
    raw = decode_step(model, batch, context, 512, seed=7, device=torch.device("cuda"))
    cells = dict(zip(raw.__code__.co_freevars, (c.cell_contents for c in raw.__closure__)))
    guards = {k: cells[k] for k in ("ids", "step_pos", "mask")}
    guards.update({f"cache reset value {i}": t for i, t in enumerate(cells["starts"])})
    before = {k: v.clone() for k, v in guards.items()}
    step = captured(raw, "graph", torch.device("cuda"))
    out = {"replays": 0}
    try:
        for i in range(4):
            step()
            torch.cuda.synchronize()
            out["replays"] = i + 1
            if i == 0:
                out["changed after replay 0"] = [k for k, v in guards.items() if not torch.equal(v, before[k])] + [
                    f"cache position {j} = {int(c.max())}" for j, c in enumerate(cells["counters"])
                    if int(c.max()) != context + 1]
    except Exception as e:   # the assert: which replay, and what the exception says
        out["error"] = str(e).strip().splitlines()[0]
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(*json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tiny import write_tiny_checkpoint
    folder = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "llama", "llama", seed=5, **SIZES))
    rows = []
    for label, spec in VARIANTS.items():
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps([folder, *spec])], capture_output=True,
                           text=True, timeout=150, env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
        found = [line[7:] for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        row = dict(label=label, **(json.loads(found[0]) if found else {"error": (r.stderr or r.stdout)[-400:]}))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

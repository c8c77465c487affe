"""Host memory of a CPU load of a MoE checkpoint (issue 25), measured in a fresh process: the peak RSS the
load adds stays within the final FP8 model + one MoE layer's experts in bf16 + temporaries, because a
layer is quantized as soon as its experts arrived; a loader that kept every layer's experts exceeds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from moe_tiny import save_moe
from hang import HANG_S

MIB = 1 << 20
LAYERS, E, H, I = 8, 16, 512, 512     # Qwen3-MoE with per-expert tensors on disk; experts ~25 MiB/layer
LAYER_BF16 = 2 * E * 3 * H * I
# What one layer's load holds at once besides its per-expert tensors: transformers' merge stacks the
# gate and the up experts, then concatenates them (nothing to pad at these sizes: no padded copy).
TEMPORARY_LAYERS = 2
SLACK = 64 * MIB                      # the allocator and the interpreter

PROBE = textwrap.dedent("""
    import json, sys
    from fp8now import Fp8Config
    from fp8now.loading.load import load
    from fp8now.loading.experts import ExpertsLoad

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    folder, warm, keep = sys.argv[1], sys.argv[2], sys.argv[3] == "keep"
    load(warm, Fp8Config(), device="cpu")               # imports and first use are not the load
    if keep:   # the defect the bound must catch: every per-expert tensor stays alive until the end
        kept, add = [], ExpertsLoad.add
        ExpertsLoad.add = lambda self, fused, key, t, *a: kept.append(t) or add(self, fused, key, t, *a)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                    # restart the peak (VmHWM) here
    before = status("VmRSS")
    model, report = load(folder, Fp8Config(scheme="channel"), device="cpu")
    print(json.dumps({"before": before, "peak": status("VmHWM"), "model_bytes": report.model_bytes,
                      "work_bytes": report.work_bytes, "experts": len(report.experts)}))
""")


def _probe(folder: Path, warm: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(warm), mode], env=env,
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_moe_load_peak_is_one_layer_of_experts_not_all(tmp_path):
    folder = save_moe("qwen3_moe", tmp_path / "big", spread=1, num_hidden_layers=LAYERS, num_experts=E,
                      hidden_size=H, moe_intermediate_size=I, head_dim=128)
    warm = save_moe("qwen3_moe", tmp_path / "warm")
    assert (folder / "model.safetensors").stat().st_size > LAYERS * LAYER_BF16
    results = {mode: _probe(folder, warm, mode) for mode in ("stream", "keep")}
    for mode, got in results.items():
        assert got["experts"] == LAYERS, mode
        added = got["peak"] - got["before"]
        bound = got["model_bytes"] + got["work_bytes"] + (1 + TEMPORARY_LAYERS) * LAYER_BF16 + SLACK
        print(f"{mode}: load peak RSS +{added / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB (model "
              f"{got['model_bytes'] / MIB:.0f} MiB, one layer of experts {LAYER_BF16 / MIB:.0f} MiB)")
        if mode == "stream":
            assert added <= bound, f"load peak RSS +{added / MIB:.0f} MiB > bound {bound / MIB:.0f} MiB"
        else:   # the bound is tight enough to see a loader that keeps every layer in bf16
            assert added > bound, f"keeping every layer stays within the bound: {added / MIB:.0f} MiB"

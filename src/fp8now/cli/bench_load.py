"""How each implementation of a whole-model benchmark gets from a checkpoint folder to a ready model, and
what it then holds on the device."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..config import Fp8Config
from ..report import tensor_bytes

# A loader: (folder, device) -> (model in eval mode, fp8now's LoadReport or None).
Loader = Callable[[Path, torch.device], tuple[nn.Module, object]]


def bf16_loader(folder: Path, device: torch.device) -> tuple[nn.Module, None]:
    """Plain transformers: `from_pretrained` in bf16, straight onto the device (evaluate.load_bf16)."""
    from .evaluate import load_bf16

    return load_bf16(folder, device), None


def _bf16_warm(folder: Path, device: torch.device) -> None:
    """Import the model's transformers class (built on the meta device), untimed, as fp8now's warm does."""
    from ..hf.skeleton import build_skeleton

    build_skeleton(folder, torch.bfloat16)


bf16_loader.warm = _bf16_warm


def fp8now_loader(scheme: str, fast_accum: bool = False, head: bool = False, embedding: bool = False,
                  weight_numerics: str = "spec", keep_bf16: str | None = None) -> Loader:
    """fp8now.load of the folder with `scheme` and those Fp8Config fields, with load's defaults (the report's
    per-layer error figures included); its `warm` compiles the weight quantizer for the model's weight shapes
    first, untimed (on a GPU Triton's kernels; on the CPU the compiled weight quantizer's library, which
    `fp8now.load` itself builds only for loads of `cpu_quantizer.WEIGHT_BUILD_BYTES` or more)."""
    config = Fp8Config(scheme=scheme, fast_accum=fast_accum, head=head, embedding=embedding,
                       weight_numerics=weight_numerics, keep_bf16=keep_bf16)

    def load(folder: Path, device: torch.device):
        from ..sensitivity.keep import load as fp8_load

        return fp8_load(folder, config, device=device)

    def warm(folder: Path, device: torch.device) -> None:
        """Quantize one random weight of each shape the load quantizes (linears, one expert's matrices):
        the timed load is then the load's own work, not Triton's one-time compilation in a process."""
        from ..hf.modules import target_linears
        from ..hf.skeleton import build_skeleton
        from ..kernels import quantize_weight

        if device.type == "cpu":   # the compiled CPU weight quantizer, built (once per machine) and opened
            from ..layers.cpu_quantizer import weight_quantizer

            weight_quantizer(config.scheme, 0, build=True)(torch.bfloat16)
        skeleton = build_skeleton(folder, torch.bfloat16)
        shapes = {tuple(m.weight.shape) for m in target_linears(skeleton, config)[0].values()}
        shapes |= {tuple(p.shape[1:]) for p in skeleton.parameters() if p.dim() == 3}   # fused experts
        for shape in sorted(shapes):
            quantize_weight(0.02 * torch.randn(shape, device=device, dtype=torch.bfloat16), config.scheme, None,
                            config.weight_numerics)
        if config.keep_bf16 is not None:   # the sensitivity pass: scored (and cached) here, read by the timed load
            from ..sensitivity.keep import chosen_layers

            chosen_layers(folder, config, device)
        if config.embedding:   # the embedding's per-row quantization (numerics' channel rule)
            emb = skeleton.get_input_embeddings().weight
            quantize_weight(0.02 * torch.randn(emb.shape, device=device, dtype=torch.bfloat16), "channel")
    load.warm = warm
    return load


def read_through(folder: Path, chunk: int = 64 << 20) -> int:
    """Read every safetensors file of `folder` once (bytes read): the loads that follow all find them in
    the page cache, so none of them pays the disk for the others."""
    buf, total = bytearray(chunk), 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model holds: parameters, buffers and tensors kept as plain module attributes (the cpu
    backend's bf16 working copy of an FP8 weight); tensor subclasses (torchao's float8 weights) count
    the tensors they hold; shared storage counts once."""
    def leaves(t: torch.Tensor):
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                yield from leaves(getattr(t, name))
        else:
            yield t
    tensors = [*model.parameters(), *model.buffers(),
               *(v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))]
    return tensor_bytes(leaf for t in tensors for leaf in leaves(t))

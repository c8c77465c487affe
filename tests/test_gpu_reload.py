"""reload_weights on a CUDA device, where it takes its own paths: every tensor checked by the batched peaks kernel
before the first write, dense weights quantized straight into their storage, stacked experts in one launch per
leaf. The reference is the CPU load of the same new tensors (the SPEC's bytes on every backend): after the
reload every FP8 byte and scale on the GPU equals it, no parameter moved, and a NaN anywhere writes nothing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import fp8now
from fp8now import Fp8Config
from moe_tiny import save_moe
from tiny import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the reload's GPU paths"),
]
SCHEMES = ["tensor", "channel", "block"]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) if t.element_size() == 1 else t).detach().cpu()


def _folders(root, kind: str):
    if kind == "dense":
        return [write_tiny_checkpoint(root / f"d{seed}", "qwen2", seed=seed, tie=False) for seed in (0, 1)]
    # 256 rows per expert matrix: block tiles and channel programs stack across experts
    return [save_moe("qwen3_moe", root / f"m{seed}", seed=seed, moe_intermediate_size=128, hidden_size=256)
            for seed in (0, 1)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_gpu_reload_writes_the_cpu_loads_bytes_in_place(tmp_path, kind, scheme):
    first, second = _folders(tmp_path, kind)
    config = Fp8Config(scheme=scheme)
    model, _ = fp8now.load(first, config, device="cuda")
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    new = {k: t.cuda() for k, t in load_file(second / "model.safetensors").items()}
    report = fp8now.reload_weights(model, new)
    assert report.partial == [] and report.warnings == []
    want, _ = fp8now.load(second, config, device="cpu")
    wanted = dict(want.named_parameters())
    for name, p in model.named_parameters():
        assert p.data_ptr() == before[name], name
        assert torch.equal(_raw(p), _raw(wanted[name])), name


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_nan_anywhere_writes_nothing_on_the_gpu(tmp_path, kind):
    first, second = _folders(tmp_path, kind)
    model, _ = fp8now.load(first, Fp8Config(scheme="channel"), device="cuda")
    before = {n: _raw(p).clone() for n, p in model.named_parameters()}
    new = {k: t.cuda() for k, t in load_file(second / "model.safetensors").items()}
    last = sorted(k for k in new if k.endswith("proj.weight") and (kind == "dense" or ".experts." in k))[-1]
    new[last] = new[last].clone()
    new[last].view(-1)[new[last].numel() // 3] = float("nan")
    with pytest.raises(ValueError, match=rf"'{last}' contains NaN or Inf.*nothing of this call was applied"):
        fp8now.reload_weights(model, new)
    assert all(torch.equal(_raw(p), before[n]) for n, p in model.named_parameters())

"""Model-level batch invariance for MoE (SPEC §8): with Fp8Config(batch_invariant=True), the logits of a
sequence are the same bits whether it runs alone or among 2 or 63 other sequences, through routers,
attention, dense FP8 linears and the FP8 experts of a checkpoint loaded from disk."""

import pytest
import torch
from moe_tiny import save_moe

import fp8now
from fp8now import Fp8Config, Fp8Experts

# (family, scheme, config overrides): every scheme; a wider model; a float32 router with dense first
# layers (DeepSeek-V3); biases and sliding attention (GPT-OSS); router-scaled dense input (Llama4).
CASES = [("qwen3_moe", "block", {}), ("qwen3_moe", "channel", dict(hidden_size=512, head_dim=128)),
         ("mixtral", "tensor", {}), ("deepseek_v3", "channel", {}), ("gpt_oss", "block", {}),
         ("llama4_text", "tensor", {})]
PICKED = [0, 1, 2, 37]   # the sequences run alone; 0-2 are also the batch of 3, all four in the batch of 64


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("family,scheme,overrides", CASES)
def test_a_sequence_gives_the_same_logits_alone_and_in_batches_of_3_and_64(tmp_path, family, scheme, overrides):
    path = save_moe(family, tmp_path, seed=5, **overrides)
    model, report = fp8now.load(path, Fp8Config(scheme=scheme, batch_invariant=True), device="cpu")
    assert report.experts and all(isinstance(model.get_submodule(r.name), Fp8Experts) for r in report.experts)
    ids = torch.randint(3, 256, (64, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        alone = [model(ids[i:i + 1]).logits[0] for i in PICKED]
        three = model(ids[:3]).logits
        all64 = model(ids).logits
    assert all(torch.isfinite(a.float()).all() for a in alone)
    assert not torch.equal(alone[0], alone[1])   # different sequences really give different logits
    for row, (i, one) in enumerate(zip(PICKED, alone)):
        assert torch.equal(_bits(one), _bits(all64[i])), (family, i, "batch of 64")
        if i < 3:
            assert torch.equal(_bits(one), _bits(three[row])), (family, i, "batch of 3")

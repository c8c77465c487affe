"""Qwen3's per-head q/k RMSNorms as one Triton kernel each (fp8now.layers.head_norm, issue 38), in tiny real
transformers models loaded from safetensors with the triton backend, run by Triton's interpreter on CPU.

The kernel's norm is checked against a float64 evaluation of the formula and against transformers' own
module (equal but for one rounding step in rare elements: the kernel's own sum of squares); the whole model's
logits stay within FP8 noise of the model running transformers' norms (`Table(producer_kernels=())`), which runs
transformers' forward bit for bit; the state dict keeps its names; an ignored q_proj keeps transformers' norm.
"""

import pytest
import torch

pytest.importorskip("triton")

import fp8now  # noqa: E402
from fp8now import Fp8Config, Fp8Linear  # noqa: E402
from fp8now.kernels import triton_jit, triton_norm  # noqa: E402
from fp8now.kernels.plan import Table  # noqa: E402
from fp8now.layers import head_norm  # noqa: E402
from fp8now.layers.head_norm import HeadRMSNorm  # noqa: E402
from tiny import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(triton_jit.available("cpu") is not None, reason="needs Triton's interpreter")]
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             num_hidden_layers=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("head_norm") / "qwen3", "qwen3", seed=9, **SIZES)


def load(folder, table=None, **cfg):
    model, _ = fp8now.load(folder, Fp8Config(scheme="channel", backend="triton", **cfg), device="cpu")
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_table(table)
    return model


def counted(monkeypatch):
    calls = []
    real = triton_norm.rms_norm

    def count(x, weight, eps, act=None):
        calls.append((tuple(x.shape), act))
        return real(x, weight, eps, act)
    monkeypatch.setattr(triton_norm, "rms_norm", count)
    return calls


def test_the_kernel_is_transformers_norm_up_to_a_rounding_step(folder, monkeypatch):
    """Fresh random q-shaped inputs [B, T, heads, D], a contiguous one and a strided slice of a wider row (as the
    stacked q/k/v output hands it over): within one bf16 step of float64's formula, equal to transformers'
    module but for one step in at most 1% of the elements, one kernel launch per call."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = load(folder)
    norm, ref = model.model.layers[1].self_attn.k_norm, hf.model.layers[1].self_attn.k_norm
    assert isinstance(norm, HeadRMSNorm) and torch.equal(norm.weight, ref.weight)
    calls = counted(monkeypatch)
    g = torch.Generator().manual_seed(11)
    wide = (torch.randn(3, 5, 4 * 64, generator=g) * torch.logspace(-2, 2, 5)[None, :, None]).bfloat16()
    inputs = [(torch.randn(2, 3, 2, 64, generator=g) * 4).bfloat16(), wide[..., 64:192].view(3, 5, 2, 64)]
    with torch.inference_mode():
        for x in inputs:
            y = norm(x)
            assert y.shape == x.shape and y.dtype == torch.bfloat16
            x64 = x.double()
            exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + ref.variance_epsilon) * ref.weight.double()
            # two roundings to bf16 (h, then weight * h), half a step (2^-8 relative) each
            step = exact.abs().clamp_min(1e-30) * 2.0 ** -7 * 1.01
            assert ((y.double() - exact).abs() <= step).all()
            theirs = ref(x)
            assert (y != theirs).float().mean().item() <= 0.01
    assert calls == [((12, 64), None), ((30, 64), None)]


def test_the_model_with_head_norms_stays_within_fp8_noise_and_keeps_its_names(folder, monkeypatch):
    """Every q_norm / k_norm of the triton-backend model is a HeadRMSNorm (installing again changes nothing); a
    prefill and a decode step launch one norm kernel per head norm; the logits stay within FP8 noise of the same
    model with transformers' norms (`Table(producer_kernels=())`, which, as `Table(head_norm_kernel=False)`,
    runs their forward as transformers does, bit for bit); the state dict has the checkpoint's names."""
    from transformers import AutoModelForCausalLM, DynamicCache
    model, plain = load(folder), load(folder, Table(producer_kernels=()))
    heads = [m for m in model.modules() if isinstance(m, HeadRMSNorm)]
    assert len(heads) == 2 * SIZES["num_hidden_layers"] and head_norm.install(model) == 0
    assert "model.layers.0.self_attn.q_norm.weight" in model.state_dict()
    assert set(model.state_dict()) == set(plain.state_dict())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    x = torch.randn(1, 4, 2, 64, generator=torch.Generator().manual_seed(12)).bfloat16()
    off = load(folder, Table(head_norm_kernel=False))   # the head norms alone off
    with torch.inference_mode():
        assert torch.equal(plain.model.layers[0].self_attn.q_norm(x), hf.model.layers[0].self_attn.q_norm(x))
        assert torch.equal(off.model.layers[0].self_attn.q_norm(x), hf.model.layers[0].self_attn.q_norm(x))
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(13))
    outs = []
    for m in (model, plain):
        calls = counted(monkeypatch)
        with torch.inference_mode():
            cache = DynamicCache(config=m.config)
            outs.append((m(ids[:, :-1], cache=cache, use_cache=True).logits,
                         m(ids[:, -1:], cache=cache, use_cache=True).logits))
        heads_run = [c for c in calls if c[0][-1] == SIZES["head_dim"]]
        assert len(heads_run) == (2 * 2 * SIZES["num_hidden_layers"] if m is model else 0)
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and fp8now.rel_diff(a.float(), b.float()) < 1e-3


def test_an_ignored_q_proj_keeps_transformers_norm_and_compile_steps_aside(folder, monkeypatch):
    """q_proj in `ignore` (an nn.Linear): its q_norm stays Qwen3RMSNorm, k_norm becomes one kernel. While
    torch.compile traces (the flag it sets), the head norm runs transformers' forward: no kernel launch."""
    model = load(folder, ignore=["*.q_proj"])
    attn = model.model.layers[0].self_attn
    assert type(attn.q_norm).__name__ == "Qwen3RMSNorm" and isinstance(attn.k_norm, HeadRMSNorm)
    calls = counted(monkeypatch)
    x = torch.randn(2, 1, 1, 64, generator=torch.Generator().manual_seed(14)).bfloat16()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.inference_mode():
        y = attn.k_norm(x)
        assert torch.equal(y, attn.k_norm.original_forward(attn.k_norm, x))
    assert calls == []

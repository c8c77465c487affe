"""One activation quantization for q/k/v and for gate/up on the cpu backend: the same logits as
quantizing per layer, fewer quantizations, and no reuse of a stale input."""

from __future__ import annotations

import pytest
import torch

from fp8now import Fp8Config, Fp8Linear
from fp8now.kernels import cpu
from fp8now.loading.load import load
from fp8now.layers.shared_input import InputMemo, share_inputs
from fp8_oracle import varied
from tiny import write_tiny_checkpoint


def _counting(monkeypatch) -> list[int]:
    """Count the cpu backend's activation quantizations (the real function still runs)."""
    calls, real = [], cpu.widened_activation
    monkeypatch.setattr(cpu, "widened_activation",
                        lambda x, kind, compiled=None: calls.append(x.shape[0]) or real(x, kind, compiled))
    return calls


@pytest.mark.parametrize("family,scheme", [("llama", "channel"), ("qwen2", "block"), ("phi3", "tensor")])
def test_shared_quantization_gives_the_same_logits(tmp_path, monkeypatch, family, scheme):
    model, _ = load(write_tiny_checkpoint(tmp_path / "m", family), Fp8Config(scheme=scheme), device="cpu")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    sharing = [m for m in layers if m.input_memo is not None]
    assert sharing and share_inputs(model) == 0          # loaded shared already; a second call adds none
    ids = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(1))
    calls = _counting(monkeypatch)
    with torch.inference_mode():
        shared = model(ids).logits
    n_shared = len(calls)
    for m in sharing:
        m.input_memo = None
    calls.clear()
    with torch.inference_mode():
        alone = model(ids).logits
    assert len(calls) == len(layers)
    assert n_shared == 2 * 4     # 2 decoder layers, 4 distinct inputs each (phi3 fuses q/k/v and gate/up itself)
    assert torch.equal(shared, alone)


def test_the_memo_is_used_only_inside_the_parent_and_for_the_same_unchanged_input(monkeypatch):
    """Called directly (no parent forward), or after an in-place change, each layer quantizes afresh."""
    parent = torch.nn.Module()
    for name in ("a", "b"):
        lin = torch.nn.Linear(200, 64, bias=False).to(torch.bfloat16).requires_grad_(False)
        setattr(parent, name, Fp8Linear.from_linear(lin, Fp8Config(scheme="channel")))
    parent.forward = lambda x, change=False: (parent.a(x), x.mul_(2) if change else x, parent.b(x))
    assert share_inputs(parent) == 2 and isinstance(parent.a.input_memo, InputMemo)
    x = varied((5, 200), torch.bfloat16, seed=3)
    calls = _counting(monkeypatch)
    with torch.no_grad():
        parent(x.clone())
        assert len(calls) == 1                           # b reused a's quantization
        parent.a(x), parent.b(x)
        assert len(calls) == 3                           # outside the parent's forward: no memo
        y = x.clone()
        _, _, got = parent(y, change=True)               # x changed in place between a and b
        assert len(calls) == 5
        assert torch.equal(got, parent.b(y))             # b saw the doubled input
    assert not parent.a.input_memo.open and parent.a.input_memo.key is None

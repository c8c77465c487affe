"""Loads in several threads at once change nothing for the rest of the process (issue 30 item 1)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from fp8now import Fp8Config
from fp8now.loading.load import load
from tiny import write_tiny_checkpoint

LOADERS = 4
ROUNDS = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("threads") / "llama", "llama", seed=3)


def _bytes(model: nn.Module) -> dict[str, bytes]:
    """Every parameter and buffer as raw bytes (FP8 viewed as uint8), with its dtype and device."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out[name] = (str(t.dtype), t.device.type, bytes(raw.numpy()))
    return out


def _plain_linear(seed: int) -> nn.Linear:
    """A default-constructed nn.Linear, then overwritten from a private generator (reproducible)."""
    layer = nn.Linear(48, 32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return layer


def test_concurrent_loads_leave_other_threads_modules_alone(folder):
    config = Fp8Config(scheme="channel")
    solo = _bytes(load(folder, config, device="cpu")[0])
    for round_ in range(ROUNDS):
        results: list = [None] * LOADERS
        errors: list[BaseException] = []
        stop = threading.Event()
        built: list[nn.Linear] = []

        def loader(i: int) -> None:
            try:
                results[i] = _bytes(load(folder, config, device="cpu")[0])
            except BaseException as e:  # reported below, with every other failure
                errors.append(e)

        def builder() -> None:
            seed = 0
            while not stop.is_set() or seed < 50:
                built.append(_plain_linear(seed))
                seed += 1

        threads = [threading.Thread(target=loader, args=(i,)) for i in range(LOADERS)]
        side = threading.Thread(target=builder)
        side.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        side.join()
        assert not errors, f"round {round_}: a concurrent load failed: {errors[0]!r}"
        for i, got in enumerate(results):
            assert got == solo, f"round {round_}: load {i} differs from a solo load"
        on_meta = [i for i, m in enumerate(built) if any(p.is_meta for p in m.parameters())]
        assert not on_meta, f"round {round_}: {len(on_meta)} of {len(built)} plain nn.Linear built on meta"
        odd = {p.dtype for m in built for p in m.parameters()} - {torch.float32}
        assert not odd, f"round {round_}: plain nn.Linear built in {odd} instead of float32"
        for seed in (0, len(built) - 1):
            want = _plain_linear(seed)
            assert torch.equal(built[seed].weight, want.weight) and torch.equal(built[seed].bias, want.bias)
    after = nn.Linear(4, 4)
    assert not after.weight.is_meta and after.weight.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_a_failed_load_leaves_nothing_switched_on(tmp_path, folder):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())  # no safetensors files
    with pytest.raises(FileNotFoundError):
        load(bad, device="cpu")
    layer = nn.Linear(4, 4)
    assert not layer.weight.is_meta and torch.get_default_dtype() == torch.float32
    model, _ = load(folder, device="cpu")
    assert not any(t.is_meta for t in model.parameters())

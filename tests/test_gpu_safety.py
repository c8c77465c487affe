"""Issue 42's guarantees on a CUDA device, where their code differs from the CPU's: a load checks NaN/Inf and
magnitude of every weight with one sync at its end (the deferred path), and reload_weights synchronizes the
device around its in-place writes while forwards run in other threads (and on another stream)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

import fp8now
from fp8now import Fp8Config
from tiny import save_checkpoint, write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the deferred checks and syncs"),
]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_safety")
    x = torch.randint(3, 500, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    out = {"x": x}
    for name, seed in (("a", 0), ("b", 1)):
        folder = write_tiny_checkpoint(root / name, "qwen2", seed=seed, tie=False)
        model, _ = fp8now.load(folder, Fp8Config(scheme="channel"), device="cuda")
        with torch.no_grad():
            out[name] = {"folder": folder, "tensors": load_file(folder / "model.safetensors"),
                         "logits": model(x).logits}
    return out


def test_a_cuda_load_refuses_nan_and_warns_about_absurd_values(tmp_path, sets):
    tensors = dict(sets["a"]["tensors"])
    config = json.loads((sets["a"]["folder"] / "config.json").read_text())
    big = tensors["model.norm.weight"].clone()
    big[5] = 1e30
    weight = tensors["model.layers.1.mlp.up_proj.weight"].clone()
    weight[3, 4] = -2e30
    folder = save_checkpoint({**tensors, "model.norm.weight": big, "model.layers.1.mlp.up_proj.weight": weight},
                             config, tmp_path / "big")
    _, report = fp8now.load(folder, device="cuda", measure_error=False)
    said = report.warnings()
    assert len(said) == 2 and any("'model.norm.weight'" in w for w in said)
    assert any("'model.layers.1.mlp.up_proj.weight'" in w for w in said)
    bias = tensors["model.layers.0.self_attn.v_proj.bias"].clone()
    bias[1] = float("nan")
    folder = save_checkpoint({**tensors, "model.layers.0.self_attn.v_proj.bias": bias}, config, tmp_path / "nan")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.v_proj\.bias' contains NaN or Inf"):
        fp8now.load(folder, device="cuda")


def _which(sets, y: torch.Tensor) -> str:
    """The set whose fresh load gives `y` (to rel_diff 1e-5, for GPU kernels that may sum in another order),
    or 'mixed' (a forward over layers of both sets is far from either)."""
    near = {k: fp8now.rel_diff(y, sets[k]["logits"]) for k in ("a", "b")}
    best = min(near, key=near.get)
    return best if near[best] < 1e-5 else "mixed"


def test_forwards_on_another_stream_never_see_a_half_written_reload(sets):
    assert fp8now.rel_diff(sets["a"]["logits"], sets["b"]["logits"]) > 1e-2   # the two sets are far apart
    model, _ = fp8now.load(sets["a"]["folder"], Fp8Config(scheme="channel"), device="cuda")
    stop = threading.Event()
    errors: list[BaseException] = []

    def reloader():
        try:
            i = 0
            while not stop.is_set() or i < 2:
                fp8now.reload_weights(model, sets[("b", "a")[i % 2]]["tensors"])
                i += 1
        except BaseException as e:   # reported below
            errors.append(e)
    t = threading.Thread(target=reloader, daemon=True)
    t.start()
    stream, seen = torch.cuda.Stream(), []
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(40):
            y = model(sets["x"]).logits
            seen.append(_which(sets, y))
    stop.set()
    t.join(600)
    assert not errors and not t.is_alive()
    assert "mixed" not in seen, f"{seen.count('mixed')} of {len(seen)} forwards mixed the two weight sets"

"""Stacked siblings (fp8now.layers.stacked, issue 38): q/k/v and gate/up of tiny real transformers models loaded
from safetensors with the triton backend, run by Triton's interpreter on CPU.

A one-token forward with `Table(stacked_gemv=True)` (the default) runs one GEMV per stack where the layers alone
(`stacked_gemv=False`) run one each:
the logits are equal bit for bit to the layers' own launches (and to a model whose tensors were never stacked),
every launch is recorded at the backend's one FP8 entry (`triton_fp8.linear_fp8`), reloads write the stack in
place, a member moved out of the stack runs alone, and an export writes every tensor on its own.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("triton")

import fp8now  # noqa: E402
from fp8now import Fp8Config, Fp8Linear  # noqa: E402
from fp8now.config import Scheme  # noqa: E402
from fp8now.numerics import quantize_weight  # noqa: E402
from fp8now.kernels import triton_fp8, triton_jit  # noqa: E402
from fp8now.kernels.plan import WIDE, Table  # noqa: E402
from fp8now.layers.stacked import Stack, unstackable  # noqa: E402
from tiny import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(triton_jit.available("cpu") is not None, reason="needs Triton's interpreter")]
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             num_hidden_layers=1)
# block scales run the GEMV from N = 4096 in the default table; these tiny layers take it at any N
BLOCK_GEMV = (("tensor", 1, 0, 6144), ("channel", 1, 0, WIDE), ("block", 1, 0, WIDE))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stacked")
    out = {family: write_tiny_checkpoint(root / family, family, seed=5, **SIZES) for family in ("llama", "qwen2")}
    out["llama-new"] = write_tiny_checkpoint(root / "llama-new", "llama", seed=9, **SIZES)
    return out


def load(folder, scheme="channel"):
    model, _ = fp8now.load(folder, Fp8Config(scheme=scheme, backend="triton"), device="cpu")
    return model


def use(model, **table):
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_table(Table(**table))


def launches(monkeypatch):
    """The weight rows of every GEMM launched through `triton_fp8.linear_fp8`, in order."""
    seen = []
    original = triton_fp8.linear_fp8

    def recorded(x_q, x_s, out_dtype, weights, path):
        seen.append(weights[0].shape[0])
        return original(x_q, x_s, out_dtype, weights, path)
    monkeypatch.setattr(triton_fp8, "linear_fp8", recorded)
    return seen


def one_token(model, seed):
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family,scheme", [("llama", "channel"), ("qwen2", "channel"), ("llama", "block")])
def test_one_token_runs_one_gemv_per_stack_with_the_same_logits(folders, monkeypatch, family, scheme):
    model = load(folders[family], scheme)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    gemv = {} if scheme == "channel" else {"gemv": BLOCK_GEMV}
    seen = launches(monkeypatch)
    use(model, stacked_gemv=False, **gemv)
    alone = one_token(model, seed=1)
    n_alone = list(seen)
    seen.clear()
    use(model, stacked_gemv=True, **gemv)
    stacked = one_token(model, seed=1)
    assert torch.equal(stacked, alone) and torch.isfinite(stacked).all()
    # gate/up stack under both schemes; q/k/v under channel only (block: k and v have N = 64, not whole tiles)
    sizes = lambda *ms: sum(m.out_features for m in ms)  # noqa: E731
    want_stacks = [sizes(mlp.gate_proj, mlp.up_proj)]
    if scheme == "channel":
        want_stacks.insert(0, sizes(attn.q_proj, attn.k_proj, attn.v_proj))
        assert attn.q_proj.stack is attn.k_proj.stack is attn.v_proj.stack is not None
    else:
        assert attn.q_proj.stack is None and "multiple of 128" in unstackable([attn.q_proj, attn.k_proj])
    assert mlp.gate_proj.stack is mlp.up_proj.stack is not None
    assert "stacked with gate_proj" in repr(mlp.up_proj)
    assert [n for n in seen if n in want_stacks] == want_stacks
    assert len(n_alone) - len(seen) == (3 if scheme == "channel" else 1)
    # the stacked storage holds each layer's own quantization of its checkpoint tensor (numerics, independently)
    tensors = {}
    for path in sorted(folders[family].glob("*.safetensors")):
        tensors.update(load_file(path))
    for name in ("self_attn.k_proj", "mlp.up_proj"):
        member = layer.get_submodule(name)
        q_ref, s_ref = quantize_weight(tensors[f"model.layers.0.{name}.weight"], Scheme(scheme))
        assert torch.equal(member.weight.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(member.weight_scale.reshape(s_ref.shape), s_ref)
    if family == "qwen2":   # q/k/v biases are slices too
        stack = attn.q_proj.stack
        v = attn.v_proj
        assert stack.bias is not None and v.bias.data_ptr() == stack.bias[-v.out_features:].data_ptr()


def test_the_stack_is_the_members_storage_and_a_reload_writes_it_in_place(folders, monkeypatch):
    model = load(folders["llama"])
    attn = model.model.layers[0].self_attn
    stack = attn.q_proj.stack
    # the members' tensors are consecutive row slices of one buffer per tensor
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert q.weight.untyped_storage().data_ptr() == k.weight.untyped_storage().data_ptr() == stack.weight.data_ptr()
    assert k.weight.data_ptr() == q.weight.data_ptr() + q.weight.numel()
    assert torch.equal(stack.weight[q.out_features:q.out_features + k.out_features].view(torch.uint8),
                       k.weight.view(torch.uint8))
    ptrs = [t.data_ptr() for m in (q, k, v) for t in (m.weight, m.weight_scale)]
    new = {}
    for path in sorted(folders["llama-new"].glob("*.safetensors")):
        new.update(load_file(path))
    fp8now.reload_weights(model, new)
    assert [t.data_ptr() for m in (q, k, v) for t in (m.weight, m.weight_scale)] == ptrs and stack.intact()
    use(model, stacked_gemv=True)
    fresh = load(folders["llama-new"])
    assert torch.equal(one_token(model, seed=2), one_token(fresh, seed=2))
    assert torch.equal(attn.k_proj.weight.view(torch.uint8),
                       fresh.model.layers[0].self_attn.k_proj.weight.view(torch.uint8))


def test_a_member_moved_out_of_the_stack_runs_alone(folders, monkeypatch):
    model = load(folders["llama"])
    attn = model.model.layers[0].self_attn
    use(model, stacked_gemv=False)
    alone = one_token(model, seed=3)
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone(), requires_grad=False)
    assert not attn.q_proj.stack.intact()
    use(model, stacked_gemv=True)
    seen = launches(monkeypatch)
    assert torch.equal(one_token(model, seed=3), alone)
    stacked_rows = sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert stacked_rows not in seen and attn.k_proj.out_features in seen   # q/k/v alone; gate/up still stacked


def test_kept_outputs_belong_to_one_input(folders):
    """A member called with another input than the one its kept output was made of computes afresh."""
    model = load(folders["llama"])
    use(model, stacked_gemv=True)
    attn = model.model.layers[0].self_attn
    stack = attn.q_proj.stack
    g = torch.Generator().manual_seed(4)
    xs = [(torch.randn(1, 128, generator=g) * 3).to(torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.rand(1, 1, generator=g) + 0.01 for _ in range(2)]
    y_q = stack.output(attn.q_proj, xs[0], scales[0], torch.bfloat16)
    y_k_other = stack.output(attn.k_proj, xs[1], scales[1], torch.bfloat16)   # another input: not the kept one
    y_k_own = attn.k_proj.forward_fp8(xs[1], scales[1], torch.bfloat16)
    assert torch.equal(y_k_other, y_k_own)
    assert torch.equal(y_q, attn.q_proj.forward_fp8(xs[0], scales[0], torch.bfloat16))
    stack.clear()
    assert stack.kept == {}


def test_unstackable_groups_say_why(folders):
    model = load(folders["llama"], "tensor")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.stack is None and "one scale per layer" in unstackable([attn.q_proj, attn.k_proj])
    with pytest.raises(ValueError, match="cannot stack .*one scale per layer"):
        Stack([attn.q_proj, attn.k_proj])
    cpu_model, _ = fp8now.load(folders["llama"], Fp8Config(scheme="channel", backend="cpu"), device="cpu")
    cpu_attn = cpu_model.model.layers[0].self_attn
    assert cpu_attn.q_proj.stack is None and "triton" in unstackable([cpu_attn.q_proj, cpu_attn.k_proj])


def test_export_of_a_stacked_model_writes_each_tensor_on_its_own(folders, tmp_path):
    model = load(folders["llama"])
    attn = model.model.layers[0].self_attn
    fp8now.save(model, tmp_path / "out")
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    tensors = {}
    for path in files:
        tensors.update(load_file(path))
    key = next(k for k in tensors if k.endswith("self_attn.k_proj.weight"))
    assert torch.equal(tensors[key].view(torch.uint8), attn.k_proj.weight.view(torch.uint8))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]


def test_a_dissolved_stack_lets_go_and_its_layers_run_alone(folders, monkeypatch):
    """`Stack.dissolve` (what moving a member to another device calls, tests/test_gpu_producers.py): the members
    forget the stack, the stack its buffers, and the one-token logits stay the same with one launch per layer."""
    model = load(folders["llama"])
    use(model, stacked_gemv=True)
    attn = model.model.layers[0].self_attn
    before = one_token(model, seed=6)
    stack = attn.q_proj.stack
    stack.dissolve()
    assert attn.q_proj.stack is attn.k_proj.stack is attn.v_proj.stack is None
    assert stack.weight is None and stack.scale is None and stack.kept == {}
    assert "stacked" not in repr(attn.q_proj)
    seen = launches(monkeypatch)
    assert torch.equal(one_token(model, seed=6), before)
    assert attn.k_proj.out_features in seen and attn.v_proj.out_features in seen

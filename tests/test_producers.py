"""The producers (fp8now.layers.producers, issue 38) in tiny real transformers models loaded from safetensors with
the triton backend, run by Triton's interpreter on CPU: RMSNorm writing the FP8 input of q/k/v and
gate/up, SiLU(gate) * up writing down_proj's.

With the producers' quantization on (the default table) and off (`Table(producer_quant=())`: the same
kernels write only their bf16 output, each linear quantizes it), the logits are equal bit for bit and
every GEMM reads the same FP8 bytes and scales, recorded at the backend's one FP8 entry
(`triton_fp8.linear_fp8`, wrapped here to record its arguments and then run). A linear in `ignore` reads
the norm's bf16 output; an output changed in place is quantized again; the CPU backend is left alone.
"""

import copy

import pytest
import torch

pytest.importorskip("triton")

import fp8now  # noqa: E402
from fp8now import Fp8Config, Fp8Linear  # noqa: E402
from fp8now.kernels import triton_fp8, triton_jit  # noqa: E402
from fp8now.kernels.plan import PRODUCERS, QUANT_INSIDE, Table  # noqa: E402
from fp8now.layers.head_norm import HeadRMSNorm  # noqa: E402
from fp8now.layers.producers import FusedGatedMLP, FusedRMSNorm, install  # noqa: E402
from tiny import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(triton_jit.available("cpu") is not None, reason="needs Triton's interpreter")]
# hidden 128 (1x128 groups and 128x128 tiles whole: one each, the fewest the interpreter runs), 2 heads of 64,
# 1 key/value head, 2 layers
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
H = SIZES["hidden_size"]
# the default table has the producers on and the GEMMs quantizing inside off (slower on the H100)
ON = Table(producer_kernels=PRODUCERS, quant_inside=QUANT_INSIDE)
OFF = Table(producer_kernels=PRODUCERS, producer_quant=(), quant_inside=QUANT_INSIDE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two-layer models of each family (a layer's producers next to another layer's), and a one-layer Llama
    for the plan test, whose checks are each layer's own (intermediate 128: it runs per-token scales, which
    have no 1x128 groups for a wider down_proj input to span)."""
    root = tmp_path_factory.mktemp("producers")
    folders = {family: write_tiny_checkpoint(root / family, family, seed=3, **SIZES) for family in ("llama", "qwen3")}
    one = write_tiny_checkpoint(root / "llama-1", "llama", seed=3, **dict(SIZES, num_hidden_layers=1,
                                                                          intermediate_size=128))
    return {**folders, "llama-1": one}


def load(folder, scheme="channel", table=ON, **cfg):
    model, report = fp8now.load(folder, Fp8Config(scheme=scheme, backend="triton", **cfg), device="cpu")
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_table(table)
    return model, report


class Recorder:
    """Wraps `triton_fp8.linear_fp8`: every GEMM's FP8 activation (bytes, scales) and who quantized it."""

    def __init__(self, monkeypatch):
        self.calls, real = [], triton_fp8.linear_fp8

        def record(x_q, x_s, out_dtype, weights, path):
            self.calls.append((x_q.view(torch.uint8).clone(), x_s.clone(), path.quant))
            return real(x_q, x_s, out_dtype, weights, path)
        monkeypatch.setattr(triton_fp8, "linear_fp8", record)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def run(model, ids, step=1):
    """Logits of a prefill of ids[:, :-step] (M = T - step: the decode kernels) and of a decode step of `step`
    tokens (M = 1: the GEMV for token scales)."""
    from transformers import DynamicCache
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        first = model(ids[:, :-step], cache=cache, use_cache=True).logits
        return first, model(ids[:, -step:], cache=cache, use_cache=True).logits


# The family decides which modules the producers replace (its RMSNorm and MLP classes), the scheme which
# activation scales the kernels write (per token or per 1x128 group): each family and each kind once. At M = 1
# the token GEMV takes ~10x the interpreter's time of the decode kernels: Qwen3 runs block, and channel's second
# call takes 2 tokens (the producers' bytes at M = 1 into the GEMV: the plan test below, against the GEMV's own
# quantization).
@pytest.mark.parametrize("family,scheme,step", [("llama", "channel", 2), ("llama", "block", 1), ("qwen3", "block", 1)])
def test_producers_on_and_off_give_the_same_logits_and_gemm_bytes(checkpoints, monkeypatch, family, scheme, step):
    """Every GEMM materializes its FP8 input here (no GEMM quantizing inside: Table.quant_inside empty, no
    block decode kernel quantizing at M = 1), so both runs record it, in a prefill and in a second call that
    reads the first's cache."""
    apart = Table(quant_inside=(), fused_block_max_n=0, producer_kernels=PRODUCERS)
    on, _ = load(checkpoints[family], scheme, apart)
    off, _ = load(checkpoints[family], scheme, Table(quant_inside=(), fused_block_max_n=0, producer_kernels=PRODUCERS,
                                                     producer_quant=()))
    layer = on.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.mlp, FusedGatedMLP)
    act = "group" if scheme == "block" else "token"
    named = dict(on.named_modules())
    assert named["model.layers.1.self_attn.k_proj"].path(1).name.startswith(f"rmsnorm-{act} + ")
    assert named["model.layers.1.mlp.down_proj"].path(16).name.startswith(f"silu-mul-{act} + ")
    assert named["model.layers.1.self_attn.o_proj"].path(1).name.startswith(f"triton-{act} + ")
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(1))
    rec = Recorder(monkeypatch)
    logits_on, got_on = run(on, ids, step), rec.take()
    logits_off, got_off = run(off, ids, step), rec.take()
    assert all(torch.equal(a, b) for a, b in zip(logits_on, logits_off)) and torch.isfinite(logits_on[1]).all()
    assert len(got_on) == len(got_off) == 2 * 2 * 7      # 2 calls x 2 layers x 7 linears
    for (q_on, s_on, how_on), (q_off, s_off, how_off) in zip(got_on, got_off):
        assert torch.equal(q_on, q_off) and torch.equal(s_on, s_off)
        assert how_off == "triton"
    assert [how for _, _, how in got_on].count("rmsnorm") == 2 * 2 * 5
    assert [how for _, _, how in got_on].count("silu-mul") == 2 * 2
    assert all(norm.handoff.y is None for norm in on.modules() if isinstance(norm, FusedRMSNorm))


def test_the_producer_plans_quantize_nowhere_but_in_kernels(checkpoints, monkeypatch):
    """The producers on: no quantizer launch at M = 1 and 5 (producers and GEMMs quantizing inside); the
    logits equal those of the producers' quantization off, and stay within FP8 noise of the model whose
    producers run transformers' own norm and product (`Table(producer_kernels=())`). The load report shows the
    default table's plan: q_proj fed by the norm's kernel. One layer: the on / off comparison above runs two,
    for what crosses from one layer to the next."""
    on, _ = load(checkpoints["llama-1"])
    off, _ = load(checkpoints["llama-1"], table=OFF)
    plain, report = load(checkpoints["llama-1"], table=Table(quant_inside=QUANT_INSIDE, producer_kernels=()))
    assert report.layers[0].plan["1"] == "rmsnorm-token + triton-gemv"   # the load's default table
    q_proj = plain.get_submodule("model.layers.0.self_attn.q_proj")
    assert q_proj.path(1).name == "fused-token + triton-gemv"             # GEMMs quantizing inside
    plans = {name: {str(m): layer.path(m).name for m in (1, 16)}
             for name, layer in on.named_modules() if isinstance(layer, Fp8Linear)}
    assert plans["model.layers.0.self_attn.q_proj"]["1"] == "rmsnorm-token + triton-gemv"
    assert plans["model.layers.0.mlp.down_proj"]["16"] == "silu-mul-token + triton-decode"
    assert plans["model.layers.0.self_attn.o_proj"]["1"] == "fused-token + triton-gemv"
    assert plans["model.layers.0.self_attn.o_proj"]["16"] == "fused-token + triton-decode"
    rec = Recorder(monkeypatch)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(2))
    logits = run(on, ids)
    assert {how for _, _, how in rec.take()} == {"rmsnorm", "silu-mul"}   # o_proj: inside its GEMM
    assert all(torch.equal(a, b) for a, b in zip(logits, run(off, ids)))
    assert {how for _, _, how in rec.take()} == set()                      # every GEMM quantized inside
    for a, b in zip(logits, run(plain, ids)):
        assert fp8now.rel_diff(a.float(), b.float()) < 1e-3


def test_an_ignored_reader_gets_the_bf16_output(checkpoints, monkeypatch):
    """q_proj and down_proj in `ignore`: q_proj (an nn.Linear) reads the norm's bf16 output while k and v
    read its FP8 bytes; the MLP stays transformers' (nothing FP8 reads its product). Layer 1's q/k/v all
    ignored: its input norm stays transformers' too."""
    ignore = ["*.q_proj", "*.down_proj", "model.layers.1.self_attn.*"]
    on, _ = load(checkpoints["llama"], ignore=ignore)
    off, _ = load(checkpoints["llama"], table=OFF, ignore=ignore)
    first, second = on.model.layers
    assert isinstance(first.input_layernorm, FusedRMSNorm) and len(first.input_layernorm.consumers) == 2
    assert type(second.input_layernorm).__name__ == "LlamaRMSNorm"
    assert type(first.mlp).__name__ == "LlamaMLP" and isinstance(first.post_attention_layernorm, FusedRMSNorm)
    rec = Recorder(monkeypatch)
    ids = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(3))
    logits = run(on, ids)
    assert [how for _, _, how in rec.take()].count("rmsnorm") == 2 * (2 + 2 + 2)
    assert all(torch.equal(a, b) for a, b in zip(logits, run(off, ids)))


def test_an_output_changed_in_place_is_quantized_again(checkpoints, monkeypatch):
    """Outside inference mode the handoff remembers the norm output's version: after an in-place change
    the linear quantizes what it is handed; unchanged, it reads the norm's bytes (the same result). A
    reader whose own plan quantizes (another table) quantizes, while its siblings read the bytes."""
    model, _ = load(checkpoints["llama"])
    attn, norm = model.model.layers[0].self_attn, model.model.layers[0].input_layernorm
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    rec = Recorder(monkeypatch)
    with torch.no_grad():
        y = norm(x)
        assert torch.equal(attn.k_proj(y), attn.k_proj(y.clone()))
        assert [how for _, _, how in rec.take()] == ["rmsnorm"]   # the clone was quantized inside its GEMM
        y.mul_(2)
        assert torch.equal(attn.k_proj(y), attn.k_proj(y.clone()))
        assert [how for _, _, how in rec.take()] == []
        attn.k_proj.use_table(OFF)   # a reader whose plan does not take the bytes the others take
        y = norm(x)
        assert torch.equal(attn.k_proj(y), attn.k_proj(y.clone())) and rec.take() == []
        assert torch.equal(attn.v_proj(y), attn.v_proj(y.clone()))
        assert [how for _, _, how in rec.take()] == ["rmsnorm"]
    norm.handoff.clear()


def test_kernels_off_run_transformers_forward_and_other_backends_are_left_alone(checkpoints):
    """`Table(producer_kernels=())`: the modules run the forward of the transformers class they replace, bit
    for bit; a CPU-backend model (the CPU default) gets no producers; installing again changes nothing."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16)
    model, _ = load(checkpoints["llama"], table=Table(producer_kernels=()))
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.inference_mode():
        assert torch.equal(model.model.layers[1].input_layernorm(x), hf.model.layers[1].input_layernorm(x))
        fused_mlp, hf_mlp = model.model.layers[1].mlp, copy.deepcopy(hf.model.layers[1].mlp)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(hf_mlp, name, getattr(fused_mlp, name))
        assert torch.equal(fused_mlp(x), hf_mlp(x))
    assert install(model) == 0
    cpu, _ = fp8now.load(checkpoints["llama"], Fp8Config(scheme="channel"), device="cpu")
    assert not any(isinstance(m, (FusedRMSNorm, FusedGatedMLP)) for m in cpu.modules())


def test_under_torch_compile_the_producers_step_aside(checkpoints, monkeypatch):
    """While torch.compile traces (`torch.compiler.is_compiling()`), the producer modules run transformers' own
    forward and hand no bytes over: inductor fuses the quantizer there (their traced kernels failed in Inductor
    2.11). Checked by the flag the tracer sets, without a compile (the interpreter's kernels cannot be traced)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16)
    model, _ = load(checkpoints["llama"], table=Table())
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    norm, mlp = model.model.layers[0].input_layernorm, model.model.layers[0].mlp
    rec = Recorder(monkeypatch)
    with torch.inference_mode():
        norm(x)
        assert norm.handoff.y is not None   # eager: the kernel ran and left its bytes
        norm.handoff.clear()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        y = norm(x)
        assert norm.handoff.y is None and torch.equal(y, hf.model.layers[0].input_layernorm(x))
        mlp(x)
    assert "silu-mul" not in {how for _, _, how in rec.take()}


def test_a_moe_layers_attention_norm_feeds_its_q_k_v(tmp_path, monkeypatch):
    """Qwen3-MoE: the input RMSNorm (`Qwen3MoeRMSNorm`) becomes the producer of q/k/v; the norm in front of the
    experts block stays transformers' (no FP8 linear reads it directly); the per-head q/k norms run as one kernel
    each (fp8now.layers.head_norm). The producer's quantization on or off
    (`producer_quant=()`): the same logits bit for bit."""
    from moe_tiny import save_moe
    folder = save_moe("qwen3_moe", tmp_path, seed=4, num_hidden_layers=1)
    # stacking off: the one-token step then launches q, k and v each (stacked, one GEMV: tests/test_stacked.py)
    on, _ = load(folder, table=Table(stacked_gemv=False))
    off, _ = load(folder, table=Table(producer_quant=(), stacked_gemv=False))
    layer = on.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and len(layer.input_layernorm.consumers) == 3
    assert type(layer.post_attention_layernorm).__name__ == "Qwen3MoeRMSNorm"
    assert all(isinstance(n, HeadRMSNorm) for n in (layer.self_attn.q_norm, layer.self_attn.k_norm))
    rec = Recorder(monkeypatch)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(6))
    logits = run(on, ids)
    assert [how for _, _, how in rec.take()].count("rmsnorm") == 2 * 3
    assert all(torch.equal(a, b) for a, b in zip(logits, run(off, ids)))

"""GPU checks of issue 38's decode fusions (fp8now.layers.producers, the GEMMs quantizing their own input) in a
small real Llama loaded from safetensors onto the GPU: with the producers' quantization on and off
(`Table(producer_quant=())`) the decode step gives the same logits bit for bit, eager (each linear
replaying its per-layer decode graphs, FP8 inputs included), replayed from one CUDA graph of the whole
step, and compiled with torch.compile; the compiled step does not break its graph where the unfused
one does not."""

import gc
import weakref

import pytest
import torch

import fp8now
from fp8now import Fp8Config, Fp8Linear
from fp8now.cli.bench_decode import captured, decode_step
from fp8now.kernels.plan import PRODUCERS, QUANT_INSIDE, WIDE, Table
from fp8now.layers.producers import FusedGatedMLP, FusedRMSNorm
from tiny import write_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (run through the device tool)")]
SIZES = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             num_hidden_layers=2, vocab_size=512)
ON = Table(producer_kernels=PRODUCERS, quant_inside=QUANT_INSIDE)   # the default table's producers, and more
OFF = Table(producer_kernels=PRODUCERS, producer_quant=(), quant_inside=QUANT_INSIDE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu_producers") / "llama", "llama", seed=5, **SIZES)


def load(folder, scheme, table=ON):
    model, _ = fp8now.load(folder, Fp8Config(scheme=scheme), device="cuda")
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(layer.mlp, FusedGatedMLP)
    assert layer.self_attn.q_proj.backend == "triton"
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_table(table)
    return model


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("batch", [1, 8])
def test_eager_steps_with_decode_graphs_on_and_off(folder, scheme, batch):
    """Four eager steps each (the linears, or at one row their stack, capture their graphs at the second
    sighting, FP8 inputs under their own key): equal logits at every step, the FP8-fed graphs captured."""
    on, off = load(folder, scheme), load(folder, scheme, OFF)
    steps = [decode_step(m, batch, 16, 512, seed=batch, device=torch.device("cuda")) for m in (on, off)]
    for _ in range(4):
        a, b = (s() for s in steps)
        assert torch.equal(a, b) and torch.isfinite(a).all()
    q_proj = on.model.layers[1].self_attn.q_proj
    # one row of the stacked q/k/v (Table.stacked_gemv; channel: the default table's GEMV at every N, which the
    # stack needs) replays the stack's graphs, else q_proj's own
    graphs = q_proj.stack.graphs if batch == 1 and scheme == "channel" else q_proj._graphs
    assert any(key[0][0][1] == torch.float8_e4m3fn for key in graphs.entries)


@pytest.mark.parametrize("scheme,mode", [("channel", "graph"), ("block", "graph"), ("channel", "compile")])
def test_whole_step_graph_and_compile_on_and_off(folder, scheme, mode):
    import torch._dynamo.utils as dynamo_utils
    breaks = []
    outs = []
    for table in (ON, OFF):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        model = load(folder, scheme, table)
        step = captured(decode_step(model, 4, 16, 512, seed=3, device=torch.device("cuda")), mode,
                        torch.device("cuda"))
        outs.append([step().clone() for _ in range(2)])
        breaks.append(sum(dynamo_utils.counters["graph_break"].values()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert breaks[0] <= breaks[1], breaks


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_stacked_gemvs_give_the_same_decode_steps(folder, scheme, mode):
    """fp8now.layers.stacked on the GPU: one-token steps with the stacked GEMVs (q/k/v, gate/up; block: the
    layers whose N is whole 128-row tiles) equal the layers' own launches bit for bit, eager (the stack's own
    per-layer graphs captured at the second sighting) and replayed from one CUDA graph of the whole step."""
    outs = []
    for stacked in (False, True):
        # the GEMV at every N for block too (the default table takes it from N = 4096), so its stacks run
        model = load(folder, scheme, Table(stacked_gemv=stacked, gemv=(("channel", 1, 0, WIDE), ("block", 1, 0, WIDE))))
        assert model.model.layers[0].mlp.gate_proj.stack is not None
        step = captured(decode_step(model, 1, 16, 512, seed=7, device=torch.device("cuda")), mode,
                        torch.device("cuda"))
        outs.append([step().clone() for _ in range(4)])
        if stacked and mode == "eager":
            assert model.model.layers[0].mlp.gate_proj.stack.graphs.entries   # captured at the second sighting
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(*outs))


def test_a_graph_replay_keeps_the_step_and_its_tensors(folder):
    """`captured(step, "graph")` without the caller keeping the step: the replay holds it (its ids, mask and
    cache), so memory allocated and written after the capture cannot be what the graph reads: the replays are
    equal and within 1e-3 of the eager step's logits (same tokens, a step of its own; token ids read from
    overwritten memory fail the embedding's bounds assert or give other logits)."""
    model = load(folder, "channel")
    eager = decode_step(model, 1, 16, 512, seed=11, device=torch.device("cuda"))()
    raw = decode_step(model, 1, 16, 512, seed=11, device=torch.device("cuda"))
    alive = weakref.ref(raw)
    step = captured(raw, "graph", torch.device("cuda"))
    del raw
    gc.collect()
    assert alive() is not None
    churn = [torch.full((n,), 1e9, device="cuda") for n in range(1, 2000, 7)]   # would overwrite freed blocks
    outs = [step().clone() for _ in range(3)]
    del churn
    assert all(torch.equal(o, outs[0]) for o in outs)
    err = ((outs[0].float() - eager.float()).norm() / eager.float().norm()).item()
    assert torch.isfinite(outs[0]).all() and err < 1e-3, err


def test_moving_a_stacked_model_off_the_gpu_frees_its_buffers(folder):
    """`model.to("cpu")` moves the stacked linears one by one; their stacks dissolve (`Stack.dissolve`), so no
    stacked buffer keeps GPU memory, and the moved model runs on the CPU backend."""
    gc.collect()
    start = torch.cuda.memory_allocated()
    model = load(folder, "channel")
    assert model.model.layers[0].self_attn.q_proj.stack is not None
    held = torch.cuda.memory_allocated() - start
    model.to("cpu")
    gc.collect()
    assert all(m.stack is None and m.backend == "cpu" for m in model.modules() if isinstance(m, Fp8Linear))
    left = torch.cuda.memory_allocated() - start
    assert held > 0 and left < held / 10, (left, held)

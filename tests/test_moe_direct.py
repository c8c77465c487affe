"""The direct MoE kernels (few routed slots, two launches: `kernels/triton_moe_direct.py`) against the sorted
path, whose alignment, quantizers, gate and combine kernels are each tested against independent references in
test_triton_moe.py, and whose layer output that file checks against the exact float64 oracle.

The direct kernels quantize x and the gated activation inside the GEMMs and combine after the w2 GEMM; with
the same tile config every operation happens in the same order on the same values, so equal bytes at the
output mean equal FP8 activation bytes and scales in both GEMMs (one differing byte moves a product).
Interpreter on CPU (conftest), compiled kernels on a GPU."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from fp8now.kernels import plan as kp  # noqa: E402
from fp8now.kernels.triton_moe import available, experts_forward  # noqa: E402
from fp8now.layers.moe_triton import expert_gate, expert_weights  # noqa: E402
from test_triton_moe import DEV, DIRECT, experts, oracle, routing_of  # noqa: E402
from fp8now import rel_diff  # noqa: E402

WHY = available(DEV, "glu", torch.nn.SiLU(), 128, 128)
pytestmark = [pytest.mark.triton, pytest.mark.skipif(WHY is not None, reason=f"Triton MoE: {WHY}")]


def inputs(t, k, e, h, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * torch.logspace(-1, 1, t)[:, None]).bfloat16().to(DEV)
    return x, routing_of(t, k, e, seed + 1), torch.rand(t, k, generator=g).to(DEV)


def run(m, x, idx, wts, path):
    return experts_forward(x, idx, wts, expert_weights(m), expert_gate(m), path, m.workspace)


# 33 tokens on 4 experts: two of them get more slots (31, 29) than a 16-row tile holds (with 8 experts one did)
SHAPES = [(33, 2, 4, 128, 128), (1, 4, 8, 192, 160), (6, 3, 5, 64, 96)]
GATES = [("glu", False), ("clamped_swiglu", True)]
# Every scheme on every shape; the gate (with its bias) alternates so that each scheme and each shape meets
# both. The gate and the biases are compile-time branches of the kernels' epilogues (GATE, HAS_BIAS), apart
# from the scheme's scale code (GROUP) and from the shape's tiling, so their full product repeats those paths.
CASES = [(scheme, *GATES[(row + col) % 2], *shape) for row, shape in enumerate(SHAPES)
         for col, scheme in enumerate(("tensor", "channel", "block"))]


@pytest.mark.parametrize("scheme,gate,bias,t,k,e,h,i", CASES)
def test_direct_kernels_give_the_sorted_paths_bytes(scheme, gate, bias, t, k, e, h, i):
    """One token (its rows quantized once and broadcast), 33 tokens (experts with more slots than a tile
    holds rows: several row chunks), H and I that the block scheme pads, biases, both gates."""
    m = experts(scheme, e, h, i, gate, bias, seed=t + i)
    x, idx, wts = inputs(t, k, e, h, seed=t)
    direct = kp.moe_plan(scheme, t, k, e, table=DIRECT)
    assert direct.kernel == "direct" and m.backend == "triton"
    y = run(m, x, idx, wts, direct)
    want = run(m, x, idx, wts, dataclasses.replace(direct, kernel="sorted", align="triton"))
    assert y.shape == (t, h) and y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert torch.equal(m.workspace, torch.zeros_like(m.workspace))   # the tickets are back to zero


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_direct_kernels_in_the_batch_invariant_config(scheme):
    """The one config of batch-invariant mode (64 x 64 tiles) on the direct kernels: the sorted path's bytes,
    and a token's row the same alone as among 24 (the direct kernels' combine has one fixed order)."""
    m = experts(scheme, 8, 128, 128, seed=3, batch_invariant=True)
    x, idx, wts = inputs(24, 2, 8, 128, seed=4)
    sorted_path = kp.moe_plan(scheme, 24, 2, 8, batch_invariant=True)
    direct = dataclasses.replace(sorted_path, kernel="direct", align="none")
    full = run(m, x, idx, wts, direct)
    assert torch.equal(full.view(torch.int16), run(m, x, idx, wts, sorted_path).view(torch.int16))
    for rows in (slice(0, 1), slice(17, 20)):
        assert torch.equal(run(m, x[rows], idx[rows], wts[rows], direct).view(torch.int16), full[rows].view(torch.int16))


def test_layer_calls_take_the_direct_path_and_repeat_exactly():
    """Through the module (its plan picks the direct kernels): the exact oracle's tolerance, and a second call
    gives the same bytes (the counters were reset: a stale ticket would skip or repeat a combine); after each
    call the counters are zero, so every later call starts as the second did."""
    m = experts("channel", 8, 128, 128, seed=5)
    x, idx, wts = inputs(1, 4, 8, 128, seed=6)   # one token: the plan's direct bound
    assert kp.moe_plan("channel", 1, 4, 8).kernel == "direct"
    first = m(x, idx, wts)
    assert rel_diff(first.cpu().float(), oracle(m, x, idx, wts).float()) < 1e-4
    assert torch.equal(m.workspace, torch.zeros_like(m.workspace))
    assert torch.equal(m(x, idx, wts), first)
    assert torch.equal(m.workspace, torch.zeros_like(m.workspace))


def test_an_id_out_of_range_leaves_the_other_tokens_and_the_counters_intact():
    """An id outside [0, E) (a broken router) is not computed: the other tokens come out as the sorted path
    has them, and the counters are zero again, so the next call is right."""
    m = experts("block", 8, 128, 128, seed=7)
    x, idx, wts = inputs(5, 2, 8, 128, seed=8)
    bad = idx.clone()
    bad[2, 1] = 8
    direct = kp.moe_plan("block", 5, 2, 8, table=DIRECT)
    y = run(m, x, bad, wts, direct)
    want = run(m, x, bad, wts, dataclasses.replace(direct, kernel="sorted", align="triton"))
    keep = [0, 1, 3, 4]
    assert torch.equal(y[keep].view(torch.int16), want[keep].view(torch.int16))
    assert torch.equal(m.workspace, torch.zeros_like(m.workspace))
    assert torch.equal(run(m, x, idx, wts, direct), run(m, x, idx, wts, dataclasses.replace(direct, kernel="sorted",
                                                                                            align="triton")))


def test_a_reload_keeps_the_counters_where_they_are():
    """load_ again (reload_weights' path): the counters keep their address, as the weights do, so a CUDA graph
    captured around the layer stays valid."""
    m = experts("tensor", 4, 128, 128, seed=11)
    before = m.workspace.data_ptr()
    m.load_(torch.randn(4, 256, 128).bfloat16().to(DEV), torch.randn(4, 128, 128).bfloat16().to(DEV))
    assert m.workspace.data_ptr() == before and not m.workspace.any()


def test_counters_that_are_too_small_are_refused():
    m = experts("channel", 4, 128, 128, seed=9)
    x, idx, wts = inputs(2, 2, 4, 128, seed=10)
    path = kp.moe_plan("channel", 2, 2, 4, table=DIRECT)
    with pytest.raises(ValueError, match=r"counters must be direct_counters\(128\)"):
        experts_forward(x, idx, wts, expert_weights(m), expert_gate(m), path,
                        torch.zeros(1, dtype=torch.int32, device=DEV))


def test_the_load_report_names_each_experts_path():
    """A real (tiny) Qwen3-MoE model's experts on the triton backend: the report's experts rows carry the path
    at 8, 512 and 16384 routed slots (1, 64 and 2048 tokens of top-8), and the kernel-plan lines show them (the
    direct kernels at one token)."""
    import fp8now
    from fp8now import Fp8Config
    from fp8now.report import LoadReport
    from moe_tiny import moe_model

    model = moe_model("qwen3_moe").to(DEV)
    rows = fp8now.quantize_(model, Fp8Config(scheme="channel", backend="triton"), measure_error=False).experts
    assert rows and all(r.backend == "triton" for r in rows)
    assert set(rows[0].plan) == {"8", "512", "16384"}
    assert "triton-moe-direct" in rows[0].plan["8"]   # 512 slots: past the one-program sort's bound (128)
    assert "align=triton-chunked" in rows[0].plan["512"] and "align=triton-chunked" in rows[0].plan["16384"]
    lines = LoadReport("tiny", str(DEV), "bfloat16", "channel", experts=rows).plan_lines()
    head = f"  {len(rows)} experts modules ({rows[0].name}, ...), routed slots (tokens x top-8) per call:"
    assert head in lines and f"    8: {rows[0].plan['8']}" in lines

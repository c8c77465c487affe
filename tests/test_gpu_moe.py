"""GPU checks of the Triton MoE path at real sizes (run on the H200): the Qwen3-30B-A3B experts shape
(E=128, top-8, H=2048, I=768) and Mixtral's (E=8, top-2, H=4096, I=14336) against the exact float64
product of the same FP8 operands (the module's `reference` backend), batch invariance, CUDA-graph
capture and replay, and no host synchronization in steady state. Skipped without CUDA; the kernels run
under the interpreter in test_triton_moe."""

import pytest
import torch

from fp8now import Fp8Config, rel_diff
from fp8now.layers.moe import Fp8Experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (run through the device tool)")]
SCHEMES = ("tensor", "channel", "block")
QWEN3 = dict(e=128, k=8, h=2048, i=768)
MIXTRAL = dict(e=8, k=2, h=4096, i=14336)


def experts(shape, scheme, gate="glu", bias=False, batch_invariant=False, seed=0):
    """Random experts of `shape` on the GPU whose magnitudes differ by 10x across experts."""
    e, h, i = shape["e"], shape["h"], shape["i"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.linspace(1.0, 10.0, e, device="cuda").reshape(e, 1, 1) * 0.02
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") * mag).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") * mag).bfloat16()
    b13 = torch.randn(e, 2 * i, generator=g, device="cuda").bfloat16() * 0.1 if bias else None
    b2 = torch.randn(e, h, generator=g, device="cuda").bfloat16() * 0.1 if bias else None
    m = Fp8Experts(e, h, i, Fp8Config(scheme=scheme, batch_invariant=batch_invariant), bias=bias, gate=gate,
                   act_fn=torch.nn.SiLU(), name="experts", device="cuda")
    m.load_(w13, w2, b13, b2)
    assert m.backend == "triton"
    return m


def routed(shape, t, seed):
    """Inputs x [T, H], distinct top-k experts per token (softmax weights), skewed toward low ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, shape["h"], generator=g, device="cuda").bfloat16()
    logits = torch.randn(t, shape["e"], generator=g, device="cuda") - torch.linspace(0, 3, shape["e"], device="cuda")
    w, idx = torch.topk(logits.softmax(-1), shape["k"], dim=-1)
    return x, idx, w


def exact(m, *args, **kwargs):
    """The same module on the reference backend: float64 products of its FP8 operands."""
    m.backend = "reference"
    try:
        return m.forward(*args, **kwargs)   # (no hooks: one calls this)
    finally:
        m.backend = "triton"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape,tokens", [(QWEN3, (1, 8, 64, 512)), (MIXTRAL, (1, 5))])
def test_layer_matches_exact_product(scheme, shape, tokens):
    m = experts(shape, scheme)
    for t in tokens:
        x, idx, w = routed(shape, t, seed=t)
        y = m(x, idx, w)
        assert torch.isfinite(y).all()
        assert rel_diff(y.float(), exact(m, x, idx, w).float()) < 1e-4, (scheme, t)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpt_oss_gate_and_biases(scheme):
    shape = dict(e=32, k=4, h=2880, i=2880)   # GPT-OSS: K = 2880 ends in a half K block (block pads it)
    m = experts(shape, scheme, gate="clamped_swiglu", bias=True)
    x, idx, w = routed(shape, 33, seed=3)
    assert rel_diff(m(x, idx, w).float(), exact(m, x, idx, w).float()) < 1e-4


@pytest.mark.parametrize("t,k,e", [(1, 8, 128), (64, 8, 128), (512, 8, 128), (2048, 2, 8), (3, 2, 8),
                                   (2048, 8, 128), (16384, 8, 128)])
def test_triton_alignment_equals_torch_alignment(t, k, e):
    """The one-program counting sort (decode sizes), the two-launch chunked one (any size) and the torch ops
    give the same routing tensors."""
    from fp8now.kernels.moe_align import align, align_chunked, align_triton
    idx = routed(dict(e=e, k=k, h=128), t, seed=t)[1]
    for bm in (16, 64, 128):
        a = align(idx, e, bm)
        for b in ([align_triton(idx, e, bm)] if t * k <= 4096 else []) + [align_chunked(idx, e, bm)]:
            assert torch.equal(a.slots, b.slots) and torch.equal(a.block_expert, b.block_expert)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape,tokens", [(QWEN3, (1, 8, 64)), (MIXTRAL, (1, 8, 64, 256))])
def test_direct_kernels_give_the_sorted_paths_bytes(scheme, shape, tokens):
    """The one-token path (two launches, kernels/triton_moe_direct.py; the plan takes it at one token) against
    the sorted path with the same tile config: the same bytes (the same FP8 activations and scales in both GEMMs, the
    same combine order), also at more slots than the plan gives it (tune_moe times it there)."""
    import dataclasses

    from fp8now.kernels.triton_moe import experts_forward
    from fp8now.layers.moe_triton import expert_gate, expert_weights, path_of
    m = experts(shape, scheme)
    for t in tokens:
        x, idx, w = routed(shape, t, seed=20 + t)
        planned = path_of(m, t, shape["k"], x.device)
        assert (planned.kernel == "direct") == (t == 1), planned.name
        direct = dataclasses.replace(planned, kernel="direct", align="none")
        run = lambda p: experts_forward(x, idx, w, expert_weights(m), expert_gate(m), p, m.workspace)  # noqa: E731
        assert torch.equal(run(direct), run(dataclasses.replace(direct, kernel="sorted", align="triton"))), (scheme, t)
        assert not m.workspace.any()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_batch_invariance(scheme):
    m = experts(QWEN3, scheme, batch_invariant=True)
    x, idx, w = routed(QWEN3, 64, seed=4)
    full = m(x, idx, w)
    for rows in (slice(0, 1), slice(7, 10), slice(0, 64)):
        assert torch.equal(m(x[rows], idx[rows], w[rows]), full[rows])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("t", [1, 64])
def test_cuda_graph_replay_equals_eager(scheme, t):
    m = experts(QWEN3, scheme)
    static = [v.clone() for v in routed(QWEN3, t, seed=5)]
    m(*static)   # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = m(*static)
    fresh = routed(QWEN3, t, seed=6)
    for s, f in zip(static, fresh):
        s.copy_(f)
    graph.replay()
    assert torch.equal(static_y, m(*fresh))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_forward_never_synchronizes_the_host(scheme):
    m = experts(QWEN3, scheme)
    calls = [routed(QWEN3, t, seed=t) for t in (1, 8, 64, 4096)]
    warm = [[m(*c) for _ in range(3)][-1] for c in calls]   # compile, capture (T <= 256), replay
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):   # the mode is armed: a real synchronization raises
            warm[0].float().sum().item()
        steady = [m(*c) for c in calls]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(steady, warm))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compiled_fullgraph_equals_eager(scheme):
    """torch.compile traces the whole path (alignment ops, Triton launches, combine) in one graph."""
    m = experts(QWEN3, scheme)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    for t in (1, 64):
        args = routed(QWEN3, t, seed=7 + t)
        assert torch.equal(compiled(*args), m(*args))


def test_fp16_activations():
    m = experts(QWEN3, "channel")
    x, idx, w = routed(QWEN3, 16, seed=8)
    y = m(x.half(), idx, w)
    assert y.dtype == torch.float16
    assert rel_diff(y.float(), exact(m, x.half(), idx, w).float()) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_calls_replay_graphs_bit_identically(dtype):
    """Eager calls of up to 256 tokens are captured at their second sighting and replayed: same bytes."""
    m = experts(QWEN3, "block")
    x, idx, w = routed(QWEN3, 8, seed=9)
    x = x.to(dtype)
    graphs, m.graphs = m.graphs, None
    plain = m(x, idx, w)
    m.graphs = graphs
    outs = [m(x, idx.int(), w) for _ in range(3)]   # plain, capture + replay, replay (int32 ids packed too)
    assert len(m.graphs) == 1
    assert all(torch.equal(o, plain) for o in outs)


def test_dense_input_layout():
    """Llama4 layout ([E*T, H], zero rows unrouted) on the same kernels equals the reference loop."""
    shape = dict(e=16, k=1, h=2048, i=1024)
    m = experts(shape, "block")
    m.dense_input = True
    x = torch.randn(16 * 4, 2048, device="cuda").bfloat16()
    x[torch.rand(16 * 4, device="cuda") < 0.6] = 0
    y = m(x)
    assert torch.equal(y[x.eq(0).all(-1)], torch.zeros_like(y[x.eq(0).all(-1)]))
    assert rel_diff(y.float(), exact(m, x, None, None).float()) < 1e-4


@pytest.mark.parametrize("family,scheme", [("qwen3_moe", "block"), ("mixtral", "channel"), ("qwen2_moe", "tensor"),
                                           ("deepseek_v3", "block"), ("gpt_oss", "channel"),
                                           ("llama4_text", "tensor"), ("olmoe", "channel")])
def test_loaded_families_run_triton_experts(tmp_path, family, scheme):
    """fp8now.load on the GPU picks the triton experts backend for every family (the report says so), and
    each experts call equals the same module's reference backend on the same inputs."""
    import fp8now
    from moe_tiny import save_moe

    model, report = fp8now.load(save_moe(family, tmp_path, seed=1, spread=4.0), Fp8Config(scheme=scheme),
                                device="cuda")
    assert report.experts and all(row.backend == "triton" for row in report.experts)
    assert all("triton-moe-direct" in row.plan["8"] for row in report.experts)
    diffs = []

    def check(module, args, kwargs, output):
        diffs.append(rel_diff(output.float(), exact(module, *args, **kwargs).float()))

    hooks = [m.register_forward_hook(check, with_kwargs=True) for m in model.modules() if isinstance(m, Fp8Experts)]
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    assert diffs and max(diffs) < 1e-4, diffs

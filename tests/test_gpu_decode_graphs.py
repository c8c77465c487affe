"""GPU checks of the eager decode graphs (fp8now.layers.decode_graphs): replays give the bytes of plain launches
on fresh inputs, earlier outputs are not overwritten, in-place reloads keep the graphs valid, and the
layer launches plainly under torch.compile, inside a caller's CUDA graph capture and for autograd."""

import pytest
import torch

from fp8now import Fp8Config, Fp8Linear, Scheme, rel_diff

from fp8now.layers import decode_graphs
from fp8now.config import ACT_GROUP, WEIGHT_GROUP
from fp8now.numerics import quantize_activation
from fp8_oracle import exact_product, varied

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU (run through the device tool)")]


def pair(n, k, scheme, seed=0, bias=True):
    """(nn.Linear, layer with decode graphs, the same layer launching every call)."""
    lin = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(varied((n, k), torch.float32, seed=seed + n + k, spread=4).cuda() * 0.02)
        if bias:
            lin.bias.copy_(torch.randn(n, device="cuda"))
    graphed = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, backend="triton"))
    plain = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, backend="triton", decode_graphs=False))
    assert graphed._graphs is not None and plain._graphs is None
    return lin, graphed, plain


def fresh(shape, seed, dtype=torch.bfloat16):
    return varied(shape, torch.float32, seed=seed, spread=3).cuda().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16, 40, 64, 256])   # the decode kernels, Triton GEMMs and cuBLAS
@pytest.mark.parametrize("scheme", list(Scheme))
def test_replays_equal_plain_launches_on_fresh_inputs(scheme, m, dtype):
    n, k = 1024, 2048
    lin, graphed, plain = pair(n, k, scheme, seed=m)
    lin, graphed, plain = lin.to(dtype), graphed.to(dtype), plain.to(dtype)
    outs, copies = [], []
    for i in range(6):
        x = fresh((m, k), seed=100 * m + i, dtype=dtype)
        y = graphed(x)
        assert torch.equal(y, plain(x)), (scheme, m, i)
        outs.append(y)
        copies.append(y.clone())
        if i == 4:   # and right, not only equal to the plain launch: the exact product of the operands
            xq, xs = quantize_activation(x, graphed.act_kind)
            ref = exact_product(xq, xs, graphed.weight, graphed.weight_scale, ACT_GROUP[graphed.act_kind],
                                WEIGHT_GROUP[graphed.scheme]) + lin.bias.double()
            assert rel_diff(y, ref) < 1e-4
    assert len(graphed._graphs) == 1          # captured at the second call, replayed since
    for y, c in zip(outs, copies):            # a replay never overwrote an earlier call's result
        assert torch.equal(y, c)
    assert len({y.data_ptr() for y in outs}) == len(outs)


def captured(layer, x):
    """Run `x` twice (the second sighting captures) and return the layer's one graph entry."""
    layer(x)
    layer(x)
    assert len(layer._graphs) == 1
    return next(iter(layer._graphs.entries.values()))


def test_in_place_reload_keeps_the_graph_and_reads_the_new_weight():
    n, k, m = 2048, 1024, 4
    lin, graphed, plain = pair(n, k, Scheme.CHANNEL)
    entry = captured(graphed, fresh((m, k), seed=1))
    w2 = varied((n, k), torch.float32, seed=77, spread=4).cuda().to(torch.bfloat16) * 0.03
    b2 = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ptr = graphed.weight.data_ptr()
    graphed.load_(w2, b2)
    plain.load_(w2, b2)
    assert graphed.weight.data_ptr() == ptr
    x2 = fresh((m, k), seed=2)
    assert torch.equal(graphed(x2), plain(x2))
    assert next(iter(graphed._graphs.entries.values())) is entry


def test_moved_tensors_drop_the_graph():
    n, k, m = 1024, 1024, 2
    _, graphed, plain = pair(n, k, Scheme.BLOCK)
    x = fresh((m, k), seed=3)
    old = captured(graphed, x)
    # a new weight tensor (not an in-place copy): the captured graph would read the old storage
    graphed.weight = torch.nn.Parameter(plain.weight.clone(), requires_grad=False)
    graphed.weight_scale = torch.nn.Parameter(plain.weight_scale.clone() * 2, requires_grad=False)
    plain.weight_scale.data.mul_(2)
    assert torch.equal(graphed(x), plain(x))
    assert next(iter(graphed._graphs.entries.values())) is not old


def test_at_most_max_graphs_per_layer_and_stream_and_other_shapes_still_right():
    n, k = 1024, 1024
    _, graphed, plain = pair(n, k, Scheme.TENSOR)
    for m in range(1, decode_graphs.MAX_GRAPHS + 4):
        for i in range(3):
            x = fresh((m, k), seed=m * 10 + i)
            assert torch.equal(graphed(x), plain(x)), m
    assert len(graphed._graphs) == decode_graphs.MAX_GRAPHS


def test_the_cap_counts_per_stream():
    """Shapes captured during a warm-up on side streams leave the default stream its own MAX_GRAPHS
    slots: with one cap per layer, two side streams' captures made later default-stream shapes launch
    plainly."""
    n, k = 1024, 1024
    _, graphed, plain = pair(n, k, Scheme.CHANNEL, seed=3)
    cap = decode_graphs.MAX_GRAPHS
    sides = [torch.cuda.Stream() for _ in range(2)]
    for i, side in enumerate(sides):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for m in range(1, cap + 1):
                for seed in (1, 2):
                    x = fresh((m, k), seed=100 * i + 10 * m + seed)
                    assert torch.equal(graphed(x), plain(x)), (i, m)
        torch.cuda.current_stream().wait_stream(side)
    assert len(graphed._graphs) == 2 * cap
    for m in range(cap + 1, 2 * cap + 2):      # the default stream still captures cap shapes, not more
        for seed in (1, 2, 3):
            x = fresh((m, k), seed=1000 + 10 * m + seed)
            assert torch.equal(graphed(x), plain(x)), m
    assert len(graphed._graphs) == 3 * cap
    default = torch.cuda.current_stream().cuda_stream
    assert sum(key[2] == default for key in graphed._graphs.entries) == cap


def test_strided_and_3d_inputs():
    n, k = 1024, 2048
    _, graphed, plain = pair(n, k, Scheme.CHANNEL)
    wide = fresh((5, 2 * k), seed=9)
    for _ in range(3):
        x = wide[:, :k]                       # row stride 2K
        assert torch.equal(graphed(x), plain(x))
    x3 = fresh((2, 3, k), seed=10)
    for _ in range(3):
        y = graphed(x3)
        assert y.shape == (2, 3, n) and torch.equal(y, plain(x3))


def test_plain_launches_under_capture_compile_and_autograd():
    n, k, m = 1024, 1024, 8
    _, graphed, plain = pair(n, k, Scheme.CHANNEL)
    x = fresh((m, k), seed=4)
    graphed(x)
    graphed(x)
    assert len(graphed._graphs) == 1
    # a caller's capture records the layer's own launches (replaying a graph inside one would not)
    static = fresh((m, k), seed=5)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_static = graphed(static)
    for seed in (6, 7):
        static.copy_(fresh((m, k), seed=seed))
        g.replay()
        assert torch.equal(y_static, plain(static))
    torch._dynamo.reset()
    compiled = torch.compile(graphed, fullgraph=True)
    for seed in (8, 9):
        x = fresh((m, k), seed=seed)
        assert torch.equal(compiled(x), plain(x))
    xg = fresh((3, k), seed=11).requires_grad_(True)
    for _ in range(3):
        assert torch.equal(graphed(xg), plain(xg.detach()))
    assert len(graphed._graphs) == 1          # neither compiled, captured nor autograd calls added one


def test_captures_after_every_graph_of_the_pool_was_freed():
    import gc
    for round_ in range(3):   # each round's layers (and graphs) die before the next captures
        _, graphed, plain = pair(1024, 1024, Scheme.CHANNEL, seed=round_)
        for seed in (30, 31, 32):
            x = fresh((2, 1024), seed=seed + round_)
            assert torch.equal(graphed(x), plain(x))
        assert len(graphed._graphs) == 1
        del graphed, plain
        gc.collect()


def test_inference_mode_then_normal_mode():
    n, k, m = 1024, 1024, 2
    _, graphed, plain = pair(n, k, Scheme.TENSOR)
    with torch.inference_mode():
        for seed in (20, 21):
            x = fresh((m, k), seed=seed)
            assert torch.equal(graphed(x), plain(x))
    assert len(graphed._graphs) == 1          # captured inside inference mode
    for seed in (22, 23):
        x = fresh((m, k), seed=seed)
        assert torch.equal(graphed(x), plain(x))


def test_graphs_share_staging_buffers_and_pool():
    """Graphs of one stream share one input and one output staging buffer and one memory pool: after
    capturing eight layers what stays allocated is one buffer pair (sized for the largest call), not
    one per graph, and every layer still returns its own result."""
    n, k, m = 4096, 4096, 64
    layers = [pair(n, k, Scheme.CHANNEL, seed=i)[1:] for i in range(8)]
    warm = pair(n, k, Scheme.CHANNEL, seed=99)[1]    # a first capture makes the buffers of this size
    x = fresh((m, k), seed=12)
    warm(x)
    warm(x)
    for graphed, _ in layers:
        graphed(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ys = [graphed(x) for graphed, _ in layers]       # the second sighting: captures
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    returned = sum(y.numel() * y.element_size() for y in ys)
    assert all(len(graphed._graphs) == 1 for graphed, _ in layers)
    per_graph = m * (k + n) * 2                      # what a private input + output buffer would cost
    assert grown <= returned + 64 * 1024, (grown, returned, per_graph)
    for (graphed, plain), y in zip(layers, ys):      # all results distinct and right, replayed again too
        assert torch.equal(y, plain(x))
        x2 = fresh((m, k), seed=13)
        assert torch.equal(graphed(x2), plain(x2))


def test_staging_buffers_grow_and_older_graphs_keep_theirs():
    k = 1024
    small_n, big_n = 1024, 8192
    _, small, small_plain = pair(small_n, k, Scheme.BLOCK, seed=1)
    _, big, big_plain = pair(big_n, k, Scheme.BLOCK, seed=2)
    for layer, plain, m in ((small, small_plain, 8), (big, big_plain, 200), (small, small_plain, 8)):
        for seed in (40, 41, 42):
            x = fresh((m, k), seed=seed + m)
            assert torch.equal(layer(x), plain(x))
    assert len(small._graphs) == 1 and len(big._graphs) == 1
    for layer, plain, m in ((small, small_plain, 8), (big, big_plain, 200)):   # interleaved replays
        x = fresh((m, k), seed=50 + m)
        assert torch.equal(layer(x), plain(x))


def test_threads_sharing_the_stream_get_their_own_results():
    """Two threads replay different layers on the same stream: each copy-replay-clone runs under the
    module lock, so neither reads the other's input from the shared staging buffer."""
    import threading
    n, k, m = 1024, 1024, 16
    pairs = [pair(n, k, Scheme.CHANNEL, seed=s)[1:] for s in (60, 61)]
    inputs = [[fresh((m, k), seed=100 * t + i) for i in range(40)] for t in range(2)]
    expected = [[plain(x) for x in xs] for (_, plain), xs in zip(pairs, inputs)]
    got: list[list[torch.Tensor]] = [[], []]

    def work(t):
        graphed = pairs[t][0]
        for x in inputs[t]:
            got[t].append(graphed(x))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    for t in range(2):
        assert len(pairs[t][0]._graphs) == 1
        assert all(torch.equal(y, e) for y, e in zip(got[t], expected[t])), t

"""The rule that picks which eager calls replay CUDA graphs (fp8now.layers.decode_graphs.max_rows), on CPU:
graphs exactly while the estimated GPU time of a call is within the host-bound budget."""

import random

from fp8now.layers import decode_graphs as dg


def estimated_s(m, n, k):
    """The same estimate, written out independently: FP8 weight read vs MMA work, whichever is longer."""
    return max(n * k / dg.WEIGHT_BYTES_PER_S, 2 * m * n * k / dg.MMA_FLOPS_PER_S)


def test_max_rows_is_the_budget_edge_on_random_shapes():
    rng = random.Random(7)
    for _ in range(300):
        n, k = 16 * rng.randint(1, 4096), 16 * rng.randint(1, 2048)
        rows = dg.max_rows(n, k)
        assert 0 <= rows <= dg.MAX_M
        if rows:
            assert estimated_s(rows, n, k) <= dg.GPU_BOUND_S
        if rows < dg.MAX_M:
            assert estimated_s(rows + 1, n, k) > dg.GPU_BOUND_S, (n, k, rows)


def test_small_layers_graph_all_of_decode_and_the_largest_measured_layer_none():
    assert dg.max_rows(4096, 4096) == dg.MAX_M
    assert dg.max_rows(57344, 8192) == 0     # GPU-bound eagerly: 1.70x bf16 launched vs 1.54x replayed
    assert all(dg.max_rows(n, 4096) >= dg.max_rows(2 * n, 4096) for n in (1024, 4096, 16384, 65536))

"""The Triton MoE path (routing alignment, grouped FP8 GEMMs, fused gated activation + quantization, combine)
against independent references on tiny shapes.

Without a CUDA device the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1). Its
fp32 -> fp8 cast is defective (SPEC §2), so there the FP8 operands of the layer oracle come from the Triton
quantizers (the same cast); on a GPU they come from `numerics`, whose bytes the Triton quantizers match.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from fp8now import Fp8Config, numerics as nu  # noqa: E402
from fp8now.config import ACT_GROUP, WEIGHT_GROUP  # noqa: E402
from fp8now.kernels import plan as kp, triton_quant as tq  # noqa: E402
from fp8now.kernels.moe_align import align, align_chunked, align_triton, max_blocks  # noqa: E402
from fp8now.kernels.triton_moe import available, experts_forward, moe_gemm  # noqa: E402
from fp8now.kernels.triton_moe_act import gated_quant  # noqa: E402
from fp8now.layers.moe import Fp8Experts  # noqa: E402
from fp8now.layers.moe_triton import expert_gate, expert_weights, pack, unpack  # noqa: E402
from fp8_oracle import exact_product  # noqa: E402
from test_triton_quant import assert_fp8_equal, precast  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEV.type == "cpu"
WHY = available(DEV, "glu", torch.nn.SiLU(), 128, 128)
pytestmark = [pytest.mark.triton, pytest.mark.skipif(WHY is not None, reason=f"Triton MoE: {WHY}")]
SCHEMES = ("tensor", "channel", "block")
# The plan takes the direct kernels at one token (from two, the sorted path is faster on the H100); they are
# correct at any number of tokens and slots, and tests run them at more through this table
DIRECT = kp.MoeTable(direct_max_tokens=512, direct_max_slots=512)
LIMIT = 0.3   # GPT-OSS's clamp, scaled to these weights so that it bites


def routing_of(t: int, k: int, e: int, seed: int) -> torch.Tensor:
    """Ragged top-k routing [T, k]: expert 0 takes most tokens, the last expert none, no repeats per token."""
    g = torch.Generator().manual_seed(seed)
    p = torch.linspace(3.0, 0.2, e - 1)
    idx = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(t)])
    return idx.to(DEV)


def experts(scheme, e, h, i, gate="glu", bias=False, seed=0, backend="triton", batch_invariant=False,
            fast_accum=False):
    """A loaded Fp8Experts whose experts differ in magnitude by 40x (a shared scale would show)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.linspace(1.0, 40.0, e).reshape(e, 1, 1) * 0.01
    w13 = (torch.randn(e, 2 * i, h, generator=g) * mag).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * mag * 4).bfloat16()
    b13, b2 = (torch.randn(e, 2 * i, generator=g).bfloat16() * 0.1, torch.randn(e, h, generator=g).bfloat16()) \
        if bias else (None, None)
    cfg = Fp8Config(scheme=scheme, backend=backend, batch_invariant=batch_invariant, fast_accum=fast_accum)
    m = Fp8Experts(e, h, i, cfg, bias=bias, gate=gate, act_fn=torch.nn.SiLU(), limit=LIMIT, name="experts",
                   device=DEV)
    m.load_(*(None if w is None else w.to(DEV) for w in (w13, w2, b13, b2)))
    return m


def quantize(x: torch.Tensor, act: str):
    """The activation quantizer whose bytes the oracle uses (see the module docstring)."""
    if INTERPRET:
        return tq.quantize_act_token(x) if act == "token" else tq.quantize_act_group(x)
    return nu.quantize_activation(x, act)


def gate_ref(h: torch.Tensor, ip: int, gate: str) -> torch.Tensor:
    """The gated activation in the activation dtype, op by op (each op rounds, as torch does)."""
    g, u = h[:, :ip], h[:, ip:]
    if gate == "glu":
        return torch.nn.functional.silu(g) * u
    g, u = g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT)
    return (u + 1) * (g * torch.sigmoid(g * 1.702))


def oracle(m: Fp8Experts, x, idx, wts) -> torch.Tensor:
    """Slot by slot: quantized input, float64 products of the stored FP8 operands, the gate, combine."""
    act, wg = m.act_kind, WEIGHT_GROUP[m.scheme]
    xp = torch.nn.functional.pad(x, (0, m.h_pad - m.hidden_size))
    out = torch.zeros(x.shape[0], m.hidden_size, dtype=torch.float64)

    def mm(v, w, s, b):
        vq, vs = quantize(v, act)
        y = exact_product(vq.cpu(), vs.cpu(), w.cpu(), s.cpu(), ACT_GROUP[act], wg).float()
        return (y if b is None else y + b.cpu().float()).to(v.dtype)

    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            b13 = None if m.w13_bias is None else m.w13_bias[e]
            b2 = None if m.w2_bias is None else m.w2_bias[e]
            h = mm(xp[t:t + 1], m.w13[e], m.w13_scale[e], b13)
            y = mm(gate_ref(h, m.i_pad, m.gate_kind).to(DEV), m.w2[e], m.w2_scale[e], b2)
            out[t] += float(wts[t, j]) * y[0, :m.hidden_size].double()
    return out


@pytest.mark.parametrize("impl", [align, align_triton, align_chunked])
def test_alignment_matches_a_plain_restatement(impl):
    """Every implementation; 150 x 2 slots: more than two steps of the counting sort's 64-slot chunks (and 5
    chunks of the chunked one); 700 x 4 slots: 44 chunks sharing 303 blocks."""
    for t, k, e, bm in [(1, 1, 4, 16), (5, 2, 8, 16), (33, 2, 8, 16), (33, 1, 4, 64), (7, 8, 128, 16),
                        (150, 2, 5, 16), (700, 4, 128, 16)]:
        idx = torch.randint(0, e - 1, (t, k), generator=torch.Generator().manual_seed(t * k)).to(DEV)
        r = impl(idx, e, bm)
        flat = idx.reshape(-1).tolist()
        slots, owners = [], []
        for ex in range(e):
            mine = [s for s, x in enumerate(flat) if x == ex]
            runs = -(-len(mine) // bm)
            slots += mine + [-1] * (runs * bm - len(mine))
            owners += [ex] * runs
        blocks = max_blocks(t * k, e, bm)
        assert r.block_expert.numel() == blocks >= len(owners)
        assert r.slots.tolist() == slots + [-1] * (blocks * bm - len(slots))
        assert r.block_expert.tolist() == owners + [-1] * (blocks - len(owners))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_grouped_gemm_equals_the_exact_product_per_slot(scheme):
    """w13 GEMM: A rows gathered as token = slot // k; each slot's row equals the float64 product (+ bias)
    of its own expert rounded to bf16; an expert with no tokens is never read. The launch order does not
    change a byte: M-blocks fastest (no A reuse) and groups of 2 and 4 M-blocks walking the N tiles (7 blocks,
    6 N tiles; the last group short) give the plan's output."""
    e, h, i, t, k = 6, 128, 192, 9, 2
    m = experts(scheme, e, h, i, bias=True, seed=1)
    x = torch.randn(t, m.h_pad, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    idx = routing_of(t, k, e, seed=3)
    xq, xs = nu.quantize_activation(x.cpu(), m.act_kind)
    path = kp.moe_plan(scheme, t, k, e)
    routing = align(idx, e, path.block_m)
    assert routing.block_expert.numel() == 7 and 2 * i // path.block_n == 6

    def gemm(p):
        return moe_gemm(xq.to(DEV), xs.to(DEV), m.w13, m.w13_scale, m.w13_bias, routing, t * k, k, torch.bfloat16, p)
    y, *others = [gemm(path)] + [gemm(dataclasses.replace(path, a_reuse_bytes=blocks * path.block_m * m.h_pad))
                                 for blocks in (0, 2, 4)]   # alive together: each in its own memory
    assert all(torch.equal(y, other) for other in others)
    for s in range(t * k):
        ex = int(idx.reshape(-1)[s])
        ref = exact_product(xq[s // k:s // k + 1], xs[s // k:s // k + 1], m.w13[ex].cpu(), m.w13_scale[ex].cpu(),
                            ACT_GROUP[m.act_kind], WEIGHT_GROUP[m.scheme]).float() + m.w13_bias[ex].cpu().float()
        assert nu.rel_diff(y[s].cpu().float(), ref[0]) < 1e-5
        assert (y[s].cpu() != ref[0].bfloat16()).float().mean() < 0.02   # float32 sums: rare last-bit ties


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_every_table_tile_gives_the_same_bytes(scheme):
    """Each tile of the MoE table (prefill's 128 x 128, 64 x 256, ...) sums the same 128-deep K blocks in the same
    order: every tile is within float32 rounding of the exact product, and tiles of one MMA instruction give the
    same bytes. On sm_90 that is two families: BLOCK_M >= 64 runs Hopper's wgmma, whose FP8 sums inside a K block
    round differently from the narrower tiles' MMA (on the H100 ~5% of these bf16 outputs differ by one bit, rel_diff
    1.4e-6 for both; the tune_moe run compares the wgmma tiles at real shapes). The interpreter: one family."""
    e, h, i, t, k = 4, 256, 320, 40, 2
    m = experts(scheme, e, h, i, seed=4)
    x = torch.randn(t, m.h_pad, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEV)
    idx = routing_of(t, k, e, seed=6)
    xq, xs = (v.to(DEV) for v in nu.quantize_activation(x.cpu(), m.act_kind))
    plan = kp.moe_plan(scheme, t, k, e)
    ref = torch.cat([exact_product(xq[s // k:s // k + 1].cpu(), xs[s // k:s // k + 1].cpu(), m.w13[ex].cpu(),
                                   m.w13_scale[ex].cpu(), ACT_GROUP[m.act_kind], WEIGHT_GROUP[m.scheme]).float()
                     for s, ex in enumerate(idx.reshape(-1).tolist())])
    families: dict[bool, list[torch.Tensor]] = {}
    tiles = sorted({row[1:] for row in kp.MoeTable().rows})
    for tile in tiles:
        path = dataclasses.replace(plan, block_m=tile[0], block_n=tile[1], num_warps=tile[2], num_stages=tile[3],
                                   kernel="sorted")
        y = moe_gemm(xq, xs, m.w13, m.w13_scale, None, align(idx, e, path.block_m), t * k, k, torch.bfloat16, path)
        assert torch.isfinite(y).all() and nu.rel_diff(y.cpu().float(), ref) < 1e-5, tile
        families.setdefault(DEV.type == "cuda" and tile[0] >= 64, []).append(y)
    assert len(tiles) == 4 and {len(ys) for ys in families.values()} <= {2, 4}
    assert all(torch.equal(ys[0], y) for ys in families.values() for y in ys[1:])


@pytest.mark.parametrize("act", ["token", "group"])
@pytest.mark.parametrize("gate", ["silu", "clamped_swiglu"])
@pytest.mark.parametrize("ip", [128, 384])
def test_fused_gate_quantization_bytes(act, gate, ip):
    """The fused kernel quantizes the torch gate's values: scales equal, FP8 bytes equal to the Triton
    quantizer's on the same values, and to numerics' up to the interpreter's cast defects. On a GPU,
    Triton's exp (ex2.approx) and torch's expf may round a rare gate value to the neighbouring bf16
    value: there a few bytes may differ and the scales agree to a bf16 ulp."""
    g = torch.Generator().manual_seed(ip)
    h = (torch.randn(7, 2 * ip, generator=g) * torch.logspace(-3, 1, 7)[:, None]).bfloat16()
    h[2] = 0   # the scale floor
    q, s = gated_quant(h.to(DEV), gate, act, 1.702, LIMIT)
    a = gate_ref(h, ip, "glu" if gate == "silu" else gate)
    q_ref, s_ref = nu.quantize_activation(a, act)
    same = q.cpu().view(torch.uint8) == quantize(a.to(DEV), act)[0].cpu().view(torch.uint8)
    if INTERPRET:
        assert torch.equal(s.cpu(), s_ref) and same.all()
        assert_fp8_equal(q, q_ref, precast(a, s_ref, ACT_GROUP[act], "row" if act == "token" else "group"))
    else:
        assert torch.allclose(s.cpu(), s_ref, rtol=2.0 ** -8, atol=0) and (~same).float().mean() < 2e-3


# One token; H = 256 and I = 192 (two 1x128 groups along K, the last partial: padded; 4 experts, was 8: each
# expert with slots is a program more); 33 tokens (an expert with more slots than a 16-row block: several blocks)
SHAPES = [(1, 1, 4, 128, 128), (5, 2, 4, 256, 192), (33, 2, 6, 128, 128)]
GATES = [("glu", False), ("clamped_swiglu", True)]
# Every scheme on every shape; the gate (with its biases) alternates so that each scheme and each shape meets
# both. The gate and the biases are compile-time branches of the gate kernel and of the GEMMs' epilogues,
# apart from the scheme's scale code and from the shape's tiling, so their full product repeats those paths.
LAYER_CASES = [(scheme, *GATES[(row + col) % 2], *shape) for row, shape in enumerate(SHAPES)
               for col, scheme in enumerate(SCHEMES)]


@pytest.mark.parametrize("scheme,gate,bias,t,k,e,h,i", LAYER_CASES)
def test_layer_matches_the_exact_oracle(scheme, gate, bias, t, k, e, h, i):
    m = experts(scheme, e, h, i, gate, bias, seed=t + e)
    assert m.backend == "triton"
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(t)) * 2).bfloat16().to(DEV)
    idx = routing_of(t, k, e, seed=t * 7)
    wts = torch.rand(t, k, generator=torch.Generator().manual_seed(9)).to(DEV)
    y = m(x, idx, wts)
    ref = oracle(m, x, idx, wts)
    assert y.shape == (t, h) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert nu.rel_diff(y.cpu().float(), ref.float()) < 1e-4
    worst = max(nu.rel_diff(y[r].cpu().float(), ref[r].float()) for r in range(t))
    assert worst < 1e-4


# The routing's alignment does not depend on the scheme (one BLOCK_M for all three, the same torch, Triton or
# chunked code): one scheme shows that the layer reads each alignment's result alike.
@pytest.mark.parametrize("scheme", ["block"])
def test_every_alignment_gives_the_same_bytes(scheme):
    m = experts(scheme, 8, 128, 128, seed=15)
    x = torch.randn(33, 128, generator=torch.Generator().manual_seed(16)).bfloat16().to(DEV)
    idx, wts = routing_of(33, 2, 8, seed=17), torch.rand(33, 2, generator=torch.Generator().manual_seed(18)).to(DEV)
    path = dataclasses.replace(kp.moe_plan(scheme, 33, 2, 8), kernel="sorted", align="torch")
    run = lambda p: experts_forward(x, idx, wts, expert_weights(m), expert_gate(m), p)  # noqa: E731
    want = run(path).view(torch.int16)
    for how in ("triton", "triton-chunked"):
        assert torch.equal(run(dataclasses.replace(path, align=how)).view(torch.int16), want), how


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp16_activations(scheme):
    """fp16 rounding points (the gate's ops, the GEMM outputs) as the reference's fp16 torch ops."""
    m = experts(scheme, 4, 128, 128, seed=11)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(12)).half().to(DEV)
    idx, wts = routing_of(5, 2, 4, seed=13), torch.rand(5, 2, generator=torch.Generator().manual_seed(14)).to(DEV)
    y = m(x, idx, wts)
    assert y.dtype == torch.float16
    assert nu.rel_diff(y.cpu().float(), oracle(m, x, idx, wts).float()) < 1e-4


# tensor and channel run the same GEMM code (per-token activation scales; the weight's scale indexed per expert
# or per row), so channel stands for both; block's 1x128 group scales take other code.
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_batch_invariance(scheme):
    """A token's output is bit-identical alone, among 3 and among 64 tokens (one plan for every T)."""
    m = experts(scheme, 8, 128, 128, seed=4, batch_invariant=True)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 128, generator=g) * torch.logspace(-2, 2, 64)[:, None]).bfloat16().to(DEV)
    idx = routing_of(64, 2, 8, seed=6)
    wts = torch.rand(64, 2, generator=g).to(DEV)
    full = m(x, idx, wts)
    for rows in (slice(0, 1), slice(5, 8), slice(40, 41)):
        part = m(x[rows], idx[rows], wts[rows])
        assert torch.equal(part.view(torch.int16), full[rows].view(torch.int16))


def test_dense_input_layout_equals_the_reference_loop():
    """Llama4 layout through the same kernels: rows routed to their expert, zero rows exactly zero."""
    e, t = 4, 5
    ref = experts("block", e, 128, 128, seed=8, backend="reference")
    tri = experts("block", e, 128, 128, seed=8)
    ref.dense_input = tri.dense_input = True
    x = torch.randn(e * t, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    x[torch.rand(e * t, generator=torch.Generator().manual_seed(10)) < 0.5] = 0
    y = tri(x.to(DEV)).cpu()
    assert torch.equal(y[x.eq(0).all(-1)], torch.zeros_like(y[x.eq(0).all(-1)]))
    want = ref(x.to(DEV)).cpu()
    assert nu.rel_diff(y.float(), want.float()) < (2e-2 if INTERPRET else 1e-4)  # interpreter: cast defects


def test_backend_choice_and_refusals():
    """auto is the cpu experts backend on CPU; the Triton kernels refuse activations they do not compute."""
    cpu = Fp8Experts(4, 128, 128, Fp8Config(), act_fn=torch.nn.SiLU(), device="cpu")
    cpu.load_(torch.randn(4, 256, 128), torch.randn(4, 128, 128))
    assert cpu.backend == "cpu"
    gelu = Fp8Experts(4, 128, 128, Fp8Config(backend="triton"), act_fn=torch.nn.GELU(), name="layers.3.experts")
    with pytest.raises(RuntimeError, match=r"layers\.3\.experts.*triton: .*not glu with GELU"):
        gelu.load_(torch.randn(4, 256, 128).to(DEV), torch.randn(4, 128, 128).to(DEV))
    with pytest.raises(ValueError, match="valid for experts: auto, triton, cpu, reference"):
        Fp8Experts(4, 128, 128, Fp8Config(backend="torch"), act_fn=torch.nn.SiLU())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("t", [1, 5])
def test_graph_packing_round_trips(dtype, k, t):
    """The graphed call's single input carries x, the ids and the weights bit for bit (also one token, whose
    packed row width is not a multiple of 4 elements: a [1, n] slice keeps the parent's row stride)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(t, 128, generator=g).to(dtype)
    idx, wts = torch.randint(0, 1000, (t, k), generator=g, dtype=torch.int32), torch.rand(t, k, generator=g)
    x2, idx2, wts2 = unpack(pack(x, idx, wts), 128, k)
    assert torch.equal(x2, x) and idx2.dtype == torch.int64 and torch.equal(idx2, idx.long())
    assert torch.equal(wts2.view(torch.int32), wts.view(torch.int32))


def test_plan_is_a_pure_table_lookup():
    p1, p2 = kp.moe_plan("block", 1, 8, 128), kp.moe_plan("block", 16384, 8, 128)
    assert (p1.block_m, p2.block_m) == (16, 128) and p1.act == "group"
    assert (p1.kernel, p2.kernel) == ("direct", "sorted") and "triton-moe-direct" in p1.name
    # the direct kernels at one token (of top-8 or top-2) up to 64 routed slots, never in batch-invariant mode
    assert [kp.moe_plan("channel", t, 8, 128).kernel for t in (1, 2, 64)] == ["direct", "sorted", "sorted"]
    assert [kp.moe_plan("channel", t, 2, 8).kernel for t in (1, 2)] == ["direct", "sorted"]
    assert [kp.moe_plan("channel", 1, k, 256).kernel for k in (64, 65)] == ["direct", "sorted"]
    assert [kp.moe_plan("channel", t, 8, 128, table=DIRECT).kernel for t in (64, 65)] == ["direct", "sorted"]
    assert kp.moe_plan("channel", 1, 8, 128, batch_invariant=True).kernel == "sorted"
    assert kp.moe_plan("channel", 1, 8, 128, table=kp.MoeTable(direct_max_tokens=0)).kernel == "sorted"
    inv = {dataclasses.replace(kp.moe_plan("channel", t, 2, 8, batch_invariant=True), align="")
           for t in (1, 3, 64, 4096)}   # one GEMM config; the alignment's result is the same either way
    assert len(inv) == 1 and next(iter(inv)).invariant
    table = kp.MoeTable(rows=((None, 32, 64, 4, 2),))
    assert kp.moe_plan("tensor", 1, 1, 4, table=table).block_m == 32
    assert "BLOCK_M=16" in p1.name and "align=triton-chunked" in p2.name
    top = kp.MoeTable().triton_align_max_slots // 8   # the most tokens of top-8 the one-program sort takes
    assert [kp.moe_plan("tensor", t, 8, 128).align for t in (1, top, top + 1)] == ["none", "triton", "triton-chunked"]


def test_fast_accumulation_is_planned_for_the_sorted_token_path_only():
    """Fp8Config(fast_accum=True): the sorted path's grouped GEMMs with per-token scales; never the direct kernels
    (few slots), block's 1x128 groups (scaled per K-block) or batch-invariant mode."""
    fast = lambda scheme, t, **kw: kp.moe_plan(scheme, t, 8, 128, fast_accum=True, **kw)  # noqa: E731
    assert fast("channel", 4096).fast_accum and fast("tensor", 4096).fast_accum
    assert "fast-accum" in fast("channel", 4096).name and "fast-accum" not in kp.moe_plan("channel", 4096, 8, 128).name
    assert not fast("channel", 1).fast_accum and fast("channel", 1).kernel == "direct"
    assert not fast("block", 4096).fast_accum
    assert not fast("channel", 4096, batch_invariant=True).fast_accum


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_fast_accumulation_layer_matches_the_exact_oracle(scheme):
    """The layer with fast accumulation on the sorted path (K = 384: three 128-deep blocks, whose products stay
    in one accumulator) against the float64 oracle, as the promoting path is; its plan says fast-accum."""
    e, h, i, t, k = 6, 384, 128, 40, 2
    m = experts(scheme, e, h, i, "glu", True, seed=21)
    m_fast = experts(scheme, e, h, i, "glu", True, seed=21, fast_accum=True)
    assert m_fast.fast_accum and not m.fast_accum
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(22)) * 2).bfloat16().to(DEV)
    idx = routing_of(t, k, e, seed=23)
    wts = torch.rand(t, k, generator=torch.Generator().manual_seed(24)).to(DEV)
    table = kp.MoeTable(direct_max_tokens=0)   # the sorted path at these few slots, as at prefill sizes
    path = kp.moe_plan(scheme, t, k, e, table=table, fast_accum=True)
    assert path.kernel == "sorted" and path.fast_accum
    y = experts_forward(x, idx, wts, expert_weights(m_fast), expert_gate(m_fast), path)
    ref = oracle(m, x, idx, wts)
    assert torch.isfinite(y).all() and nu.rel_diff(y.cpu().float(), ref.float()) < 1e-3
    slow = experts_forward(x, idx, wts, expert_weights(m), expert_gate(m), dataclasses.replace(path, fast_accum=False))
    assert nu.rel_diff(slow.cpu().float(), ref.float()) < 1e-4

"""The kernel plan (`kernels.plan.plan`) against the rules of issue 24 and the dispatch it replaced, written
out here on their own: over a grid of (scheme, M, N, K, batch_invariant, compiling) every path must be
the one these rules name. A custom table changes the choice; the tables cannot be changed in place."""

import dataclasses
import itertools

import pytest
import torch

from fp8now import Fp8Config, Fp8Linear, Scheme
from fp8now.kernels.plan import PRODUCERS, QUANT_INSIDE, TABLES, Table, plan

ACT = {Scheme.TENSOR: "token", Scheme.CHANNEL: "token", Scheme.BLOCK: "group"}
MS = [1, 2, 3, 4, 5, 8, 16, 17, 32, 33, 64, 65, 256, 4096]
NS = [1024, 2048, 4096, 6144, 6160, 8192, 8208, 14336, 28672]
KS = [1024, 1536, 4096, 8192, 8320, 14336]


def expected(scheme: Scheme, m: int, n: int, k: int, invariant: bool, compiling: bool, inside: bool = True):
    """(quantizer, GEMM, config, pdl) the H200 rules give a triton-backend call; `inside`: the GEMV and the
    decode kernel quantize their own input (issue 38; Table.quant_inside) where a Triton quantizer would."""
    group = scheme is Scheme.BLOCK
    quant = "torch" if compiling and not group else "triton"
    own = "fused" if inside and quant == "triton" else quant    # the decode GEMMs' quantizer
    if invariant:
        return quant, "triton-block" if group else "triton-rowwise", {}, False
    few = 4096 <= n <= 8192
    splits = 4 if k > 8192 and n < 8192 else 2
    if m == 1 and (scheme is Scheme.CHANNEL or (scheme is Scheme.TENSOR and n <= 6144)
                   or (group and n >= 4096)):
        return own, "triton-gemv", {}, own == "triton" and not compiling
    if m == 1 and scheme is Scheme.TENSOR:
        return quant, "cublas-tensorwise", {}, False
    if m <= 16 and not group:
        pdl = m <= 4 and not compiling and own == "triton"
        if few:
            return own, "triton-decode-exchange" if splits == 2 else "triton-decode", \
                {"SPLIT_K": splits, "num_stages": 6}, pdl
        return own, "triton-decode", {}, pdl
    if m == 1 and n <= 8192:
        return "fused", "triton-decode", {}, False
    if m <= 16 and few:
        return own, "triton-decode", {"SPLIT_K": 2 * splits}, False
    if group:
        cublas = m > 32 and k % 512 == 0
        return quant, "cublas-blockwise" if cublas else "triton-block", {}, False
    if m > 64:
        return quant, "cublas-rowwise", {}, False
    return quant, "triton-rowwise", {"BLOCK_N": 64, "GROUP_M": 1, "num_stages": 5, "SPLIT_K": 2 if n < 8192 else 1}, False


@pytest.mark.parametrize("inside", [True, False])
def test_triton_plan_follows_the_rules_over_the_grid(inside):
    table = Table(quant_inside=QUANT_INSIDE) if inside else Table()
    for scheme, m, n, k, invariant, compiling in itertools.product(Scheme, MS, NS, KS, (False, True), (False, True)):
        path = plan("triton", scheme, ACT[scheme], m, n, k, "cuda-fp8", invariant, compiling, table)
        got = (path.quant, path.gemm, dict(path.config), path.pdl)
        assert got == expected(scheme, m, n, k, invariant, compiling, inside), (scheme, m, n, k, invariant, compiling)
        assert path.invariant == invariant and path.act == ACT[scheme] and path.scheme is scheme
        assert ("cublas" in path.name) == path.gemm.startswith("cublas")


def test_a_producer_hands_its_bytes_to_every_gemm_it_feeds():
    """With a producer in front (issue 38: RMSNorm or SiLU * up writing the FP8 input), every triton path
    reads its bytes: the same GEMM as without one, no quantizer, no programmatic dependent launch, named
    after the producer, as the default table plans it; unless the table leaves that producer's kernel or its
    quantization out. The other backends quantize their input themselves; an unknown producer is refused."""
    on = Table(producer_kernels=PRODUCERS)
    assert Table() == on   # on by default (measured faster on the H100: BENCHMARKS.md "Whole model")
    for producer in ("rmsnorm", "silu-mul"):
        for scheme, m, n, k, invariant, compiling in itertools.product(Scheme, MS, NS, KS[:3], (False, True),
                                                                        (False, True)):
            args = ("triton", scheme, ACT[scheme], m, n, k, "cuda-fp8", invariant, compiling)
            fed, alone = plan(*args, table=on, producer=producer), plan(*args, table=on)
            assert plan(*args, producer=producer) == fed   # the default table
            assert (fed.gemm, fed.config, fed.invariant, fed.quant, fed.pdl) == \
                (alone.gemm, alone.config, alone.invariant, producer, False)
            assert fed.name.startswith(f"{producer}-{ACT[scheme]} + {fed.gemm}")
            for table in (Table(producer_kernels=PRODUCERS, producer_quant=()), Table(producer_kernels=()),
                          Table(producer_kernels=(producer == "rmsnorm") * ("silu-mul",))):
                assert plan(*args, table=table, producer=producer) == plan(*args, table=table)
        assert plan("cpu", Scheme.CHANNEL, "token", 1, 64, 64, "cpu", producer=producer).quant == "cpu"
        assert plan("torch", Scheme.BLOCK, "group", 1, 64, 128, "cuda-fp8", producer=producer).quant == "torch"
    with pytest.raises(ValueError, match="unknown producer 'gelu'"):
        plan("triton", Scheme.CHANNEL, "token", 1, 64, 64, "cuda-fp8", producer="gelu")


def test_other_backends_name_their_one_path():
    for scheme in Scheme:
        act = ACT[scheme]
        ref = plan("reference", scheme, act, 7, 256, 512, "cuda-fp8")
        assert ref.name == f"torch-{act} + reference"
        gpu = plan("torch", scheme, act, 7, 256, 512, "cuda-fp8").name
        assert gpu == f"torch-{act} + " + ("cublas-blockwise" if scheme is Scheme.BLOCK else "cublas-rowwise")
        cpu = plan("torch", scheme, act, 7, 256, 512, "cpu").gemm
        assert cpu == ("torch-blockwise" if scheme is Scheme.BLOCK else "torch-rowwise")
    assert plan("torch", Scheme.TENSOR, "tensor", 3, 64, 64, "cuda-fp8").gemm == "cublas-tensorwise"
    assert plan("triton-w8a16", Scheme.BLOCK, "group", 3, 64, 128, "cuda").name == "triton-w8a16"
    with pytest.raises(ValueError, match="no plan for backend 'nope'"):
        plan("nope", Scheme.TENSOR, "token", 1, 64, 64, "cpu")


def test_a_custom_table_changes_the_choice():
    args = ("triton", Scheme.CHANNEL, "token")
    assert plan(*args, 17, 4096, 4096, "cuda-fp8").gemm == "triton-rowwise"
    assert plan(*args, 17, 4096, 4096, "cuda-fp8", table=Table(rowwise_max_m=16)).gemm == "cublas-rowwise"
    assert plan(*args, 64, 4096, 4096, "cuda-fp8", table=Table(rowwise_mid=())).config == ()   # the block table's
    assert plan(*args, 1, 4096, 4096, "cuda-fp8", table=Table(gemv=())).gemm == "triton-decode-exchange"
    assert plan(*args, 4, 1024, 4096, "cuda-fp8", table=Table(quant_inside=())).pdl
    assert not plan(*args, 4, 1024, 4096, "cuda-fp8", table=Table(pdl_max_m=2, quant_inside=())).pdl
    assert plan(*args, 1, 4096, 4096, "cuda-fp8").quant == "triton"   # by default no GEMM quantizes inside
    assert plan(*args, 1, 4096, 4096, "cuda-fp8", table=Table(quant_inside=QUANT_INSIDE)).quant == "fused"
    assert plan(*args, 1, 4096, 4096, "cuda-fp8", table=Table(quant_inside=(("triton-decode", 16),))).quant == "triton"
    assert plan(*args, 8, 4096, 4096, "cuda-fp8", table=Table(quant_inside=(("triton-decode-exchange", 4),))).name \
        == "triton-token + triton-decode-exchange (SPLIT_K=2, num_stages=6)"
    assert plan(*args, 8, 4096, 4096, "cuda-fp8", table=Table(few_splits_n=(1, 0))).config == ()
    assert plan(*args, 8, 4096, 4096, "cuda-fp8", compiling=True,
                table=Table(compiled_quant=(), quant_inside=QUANT_INSIDE)).quant == "fused"
    assert plan(*args, 8, 4096, 4096, "cuda-fp8", compiling=True,
                table=Table(compiled_quant=(), quant_inside=())).quant == "triton"
    block = ("triton", Scheme.BLOCK, "group")
    assert plan(*block, 4096, 4096, 4096, "cuda-fp8").gemm == "cublas-blockwise"
    assert plan(*block, 4096, 4096, 4096, "cuda-fp8", table=Table(block_large="triton")).gemm == "triton-block"
    assert plan(*block, 64, 4096, 4096, "cuda-fp8", table=Table(block_max_m=64)).gemm == "triton-block"
    assert plan(*block, 1, 2048, 4096, "cuda-fp8", table=Table(fused_block_max_n=1024)).gemm == "triton-block"
    tensor = ("triton", Scheme.TENSOR, "token")
    assert plan(*tensor, 1, 8192, 4096, "cuda-fp8", table=Table(tensorwise_m1=False)).gemm == "triton-decode-exchange"
    assert plan(*tensor, 1, 8192, 4096, "cuda-fp8", table=Table(gemv=(("tensor", 1, 0, 8192),))).gemm == "triton-gemv"


def test_tables_are_read_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TABLES["cuda-fp8"].rowwise_max_m = 1
    with pytest.raises(TypeError):
        TABLES["cuda-fp8"] = Table(rowwise_max_m=1)


def test_a_layer_reports_and_runs_its_plan():
    """On CPU the cpu backend: one path at every M, no workspace (its working copy is its prepare hook's)."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(256, 64), Fp8Config(scheme="block"))
    assert layer.backend == "cpu" and layer.workspace is None and layer._work.shape == (64, 256)
    assert {layer.path(m).name for m in (1, 16, 4096)} == {"cpu-group + bf16-matmul"}
    y = layer(torch.randn(3, 256))
    assert y.shape == (3, 64) and torch.isfinite(y).all()

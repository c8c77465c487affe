"""Issue 38 on one GPU in one call: the decode fusions' bytes on real shapes, then their GPU time.

    PYTHONPATH=src python benchmarks/check_decode_fusion.py     # -> $OUT/decode_fusion_<gpu>.json
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/check_decode_fusion.py --smoke   # CPU: tiny, untimed

Correctness (a failing row says FAIL, and the script exits 1 after the table):
- `gemm` rows: an Fp8Linear whose GEMM quantizes its own input (the default plan: the GEMV at M = 1, the
  split-K decode kernel at M = 8) against the same layer after the Triton quantizer
  (`Table(quant_inside=())`): outputs equal bit for bit, and rel_diff < 1e-4 to the float64 product of
  `numerics`' operands; 4096x4096, 14336x4096, 4096x14336, 6144x4096 (the 8B's fused qkv), every scheme.
- `producer` rows: the RMSNorm kernel (K 4096) and SiLU(gate) * up (I 14336) at M = 1 and 8: FP8 bytes and
  scales equal to `numerics.quantize_activation` of the kernel's own output (on a GPU the casts agree);
  the fraction of output elements that differ from transformers' LlamaRMSNorm / act_fn(gate) * up is
  reported (another summation order or exp: not a failure).
- `block` rows: the 8B's MLP input (post-attention RMSNorm, gate, up, SiLU * up, down) and attention
  input (input RMSNorm, q, k, v) through fp8now.layers.producers: producers writing the FP8 (default) equal the
  producers' bf16 output quantized by each linear, bit for bit.
Timing: GPU µs per call, CUDA graphs over separate weight (or input) copies per implementation
(timing.GraphTimer). before: transformers' ops + the Triton quantizer (+ GEMMs after it); kernels: the
producer kernel's bf16 output + the quantizer; fused: what the default plan runs.
Floor of a Llama-3.1-8B decode step: its FP8 linears (6.98 GB) and bf16 lm_head (1.05 GB) read once.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

import record
from timing import GraphTimer, copies_for

from fp8now import Fp8Config, Fp8Linear, Scheme, numerics, rel_diff
from fp8now.kernels import triton_quant
from fp8now.kernels.plan import Table
from fp8now.kernels.reference import exact_matmul
from fp8now.kernels.triton_norm import rms_norm
from fp8now.kernels.triton_silu_mul import silu_mul
from fp8now.layers.producers import install

# The 8B's sizes (hidden, key/value rows, intermediate), the layer shapes, M; `--smoke`: tiny ones on CPU.
DIMS = dict(hidden=4096, kv=1024, inter=14336, shapes=[(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)],
            m=[1, 8])
SMOKE = dict(hidden=256, kv=128, inter=384, shapes=[(384, 256), (256, 384)], m=[1, 5])
# (producer_kernels=() throughout: the tables as they were when these rows were measured, before the producers'
# kernels became the default; this script calls the producers' kernels itself)
APART = Table(quant_inside=(), producer_kernels=())
TABLES = {"before": Table(producer_kernels=(), quant_inside=()),
          "kernels": Table(producer_kernels=(), producer_quant=(), quant_inside=()), "fused": Table(producer_kernels=())}
QUANTIZE = {"token": triton_quant.quantize_act_token, "group": triton_quant.quantize_act_group}
H100_BYTES_PER_S = 3.0e12


def varied(rows: int, cols: int, seed: int, dev: torch.device, scale: float = 1.0) -> torch.Tensor:
    """bf16 with magnitudes varying by powers of two across rows and 128-column tiles."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=dev)
    x *= 2.0 ** torch.randint(-3, 4, (rows, 1), generator=g, device=dev).float()
    x *= (2.0 ** torch.randint(-3, 4, (1, -(-cols // 128)), generator=g, device=dev).float()
          ).repeat_interleave(128, dim=1)[:, :cols]
    return (x * scale).to(torch.bfloat16)


def fp8_layer(lin: nn.Linear, scheme: Scheme, table: Table | None = None, name: str = "") -> Fp8Linear:
    layer = Fp8Linear.from_linear(lin, Fp8Config(scheme=scheme, backend="triton", decode_graphs=False), name=name)
    layer.use_table(table)
    return layer


def linear(n: int, k: int, seed: int, dev: torch.device) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(varied(n, k, seed, dev, 0.02))
    return lin


class Timer:
    """GPU µs of `call(copy)` over copies `make()` builds, a set per implementation (None on CPU). Built, not
    deep-copied: an Fp8Linear holds its backend module, which copy.deepcopy cannot copy."""

    def __init__(self, weight_bytes: int, dev: torch.device):
        self.graphs = GraphTimer(copies_for(weight_bytes)) if dev.type == "cuda" else None

    def us(self, make, call) -> float | None:
        if self.graphs is None:
            return None
        return 1e3 * self.graphs.ms([make() for _ in range(self.graphs.copies)], call)


def gemm_rows(d: dict, dev: torch.device) -> list[dict]:
    rows = []
    for n, k in d["shapes"]:
        timer = Timer(n * k, dev)
        lin = linear(n, k, n + k, dev)
        for scheme in Scheme:
            fused, apart = fp8_layer(lin, scheme), fp8_layer(lin, scheme, APART)
            for m in d["m"]:
                x = varied(m, k, m * k, dev)
                y, y_apart = fused(x), apart(x)
                x_q, x_s = reference_quantize(x, fused.act_kind)
                ref = exact_matmul(x_q, x_s, fused.weight, fused.weight_scale, scheme)
                row = dict(kind="gemm", what=f"{n}x{k}", scheme=scheme.value, m=m, plan=fused.path(m).name,
                           plan_apart=apart.path(m).name, equal=torch.equal(y, y_apart),
                           rel=float(rel_diff(y.double(), ref)),
                           apart_us=timer.us(lambda: fp8_layer(lin, scheme, APART), lambda c: c(x)),
                           fused_us=timer.us(lambda: fp8_layer(lin, scheme), lambda c: c(x)))
                row["ok"] = row["equal"] and row["rel"] < 1e-4
                rows.append(row)
                print(row, flush=True)
    return rows


class Producer(nn.Module):
    """One producer call on its own inputs (buffers: separate copies per timed call), done three ways."""

    def __init__(self, what: str, how: str, act: str, tensors: list[torch.Tensor], eps: float = 1e-5):
        super().__init__()
        self.what, self.how, self.act, self.eps = what, how, act, eps
        for i, t in enumerate(tensors):
            self.register_buffer(f"t{i}", t.clone())

    def forward(self):
        from transformers.activations import ACT2FN
        if self.what == "rmsnorm":
            x, w = self.t0, self.t1
            if self.how == "before":   # transformers' LlamaRMSNorm, then the quantizer
                h = x.float()
                return QUANTIZE[self.act](w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
                                               ).to(x.dtype))
            y, q, s = rms_norm(x, w, self.eps, None if self.how == "kernels" else self.act)
            return QUANTIZE[self.act](y) if self.how == "kernels" else (y, q, s)
        g, u = self.t0, self.t1
        if self.how == "before":
            return QUANTIZE[self.act](ACT2FN["silu"](g) * u)
        return QUANTIZE[self.act](silu_mul(g, u)) if self.how == "kernels" else silu_mul(g, u, self.act)


def reference_quantize(y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`numerics` on a GPU; on the CPU the Triton quantizer, whose interpreted cast the kernels share
    (Triton's interpreter rounds some values wrongly: SPEC §2)."""
    return numerics.quantize_activation(y, act) if y.is_cuda else QUANTIZE[act](y)


def producer_rows(d: dict, dev: torch.device) -> list[dict]:
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    rows = []
    norm = LlamaRMSNorm(d["hidden"], eps=1e-5).to(dev, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d["hidden"], device=dev))
    w = norm.weight.detach()
    for m in d["m"]:
        x, g, u = (varied(m, d[key], seed * m, dev) for key, seed in (("hidden", 11), ("inter", 13), ("inter", 17)))
        with torch.no_grad():
            want = {"rmsnorm": norm(x), "silu-mul": ACT2FN["silu"](g) * u}
        got = {"rmsnorm": rms_norm(x, w, norm.variance_epsilon)[0], "silu-mul": silu_mul(g, u)}
        for what, ins in (("rmsnorm", [x, w]), ("silu-mul", [g, u])):
            timer = Timer(sum(t.numel() * t.element_size() for t in ins), dev)
            for act in ("token", "group"):
                out = Producer(what, "fused", act, ins)()
                q, s = out[1:] if what == "rmsnorm" else out
                q_ref, s_ref = reference_quantize(got[what], act)
                ok = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
                differ = float((got[what].view(torch.int16) != want[what].view(torch.int16)).float().mean())
                row = dict(kind="producer", what=what, scheme=act, m=m, ok=ok, differ_from_transformers=differ)
                for how in TABLES:
                    row[f"{how}_us"] = timer.us(lambda: Producer(what, how, act, ins), lambda c: c())
                rows.append(row)
                print(row, flush=True)
    return rows


class QKV(nn.Module):
    """The attention's projections, reading the input norm's output (what fp8now.layers.producers looks for)."""

    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, o, bias=False) for o in (hidden, kv, kv))

    def forward(self, h):
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)


class Half(nn.Module):
    """Half a Llama decoder layer without attention and residual: norm -> q/k/v, or norm -> MLP."""

    def __init__(self, which: str, d: dict):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        self.which = which
        if which == "attention":
            self.input_layernorm, self.self_attn = LlamaRMSNorm(d["hidden"], eps=1e-5), QKV(d["hidden"], d["kv"])
        else:
            config = LlamaConfig(hidden_size=d["hidden"], intermediate_size=d["inter"], hidden_act="silu")
            self.post_attention_layernorm, self.mlp = LlamaRMSNorm(d["hidden"], eps=1e-5), LlamaMLP(config)

    def forward(self, x):
        if self.which == "attention":
            return torch.cat(self.self_attn(self.input_layernorm(x)), dim=-1)
        return self.mlp(self.post_attention_layernorm(x))


def half(which: str, d: dict, scheme: Scheme, table: Table, dev: torch.device) -> Half:
    with torch.device(dev):   # initialized where it runs (the 8B's MLP on the host took seconds)
        block = Half(which, d).to(torch.bfloat16)
    for i, (name, lin) in enumerate(list(block.named_modules())):
        if isinstance(lin, nn.Linear):
            with torch.no_grad():
                lin.weight.copy_(varied(*lin.weight.shape, seed=i, dev=dev, scale=0.02))
            parent, leaf = name.rsplit(".", 1)
            setattr(block.get_submodule(parent), leaf, fp8_layer(lin, scheme, table, name))
    if install(block) != (1 if which == "attention" else 2):
        raise SystemExit(f"fp8now.layers.producers did not take the {which} half: check its module names")
    return block


def block_rows(d: dict, dev: torch.device) -> list[dict]:
    rows = []
    for which in ("attention", "mlp"):
        h = d["hidden"]
        timer = Timer(h * (h + 2 * d["kv"]) if which == "attention" else 3 * h * d["inter"], dev)
        for scheme in (Scheme.CHANNEL, Scheme.BLOCK):
            blocks = {how: half(which, d, scheme, table, dev) for how, table in TABLES.items()}
            for m in d["m"]:
                x = varied(m, h, 5 * m, dev)
                outs = {how: b(x) for how, b in blocks.items()}
                row = dict(kind="block", what=which, scheme=scheme.value, m=m,
                           ok=torch.equal(outs["fused"], outs["kernels"]),
                           rel_to_before=float(rel_diff(outs["fused"].double(), outs["before"].double())))
                for how, table in TABLES.items():
                    row[f"{how}_us"] = timer.us(lambda: half(which, d, scheme, table, dev), lambda c: c(x))
                rows.append(row)
                print(row, flush=True)
    return rows


def floor_row() -> dict:
    """Bytes a Llama-3.1-8B decode step must read (FP8 linears, bf16 head) and their time at 3.0 TB/s."""
    linears = 32 * 4096 * (4096 + 1024 + 1024 + 4096 + 3 * 14336)
    head = 2 * 128256 * 4096
    return dict(kind="floor", what="llama3.1-8b step", fp8_linear_gb=linears / 1e9, bf16_head_gb=head / 1e9,
                ms_at_3_tb_s=(linears + head) / H100_BYTES_PER_S * 1e3, ok=True)


def gpu_tag() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((t for t in ("h200", "h100", "a100", "l40s") if t in name), name.replace(" ", "_"))


def fmt(us) -> str:
    return "-" if us is None else f"{us:.1f}"


def table(rows: list[dict]) -> str:
    lines = ["kind      what          scheme   M  ok    GPU µs (gemm: quantizer+GEMM / fused; others: before / "
             "kernels / fused)"]
    for r in rows:
        if r["kind"] == "floor":
            lines.append(f"floor     8B decode step: {r['fp8_linear_gb']:.2f} GB FP8 + {r['bf16_head_gb']:.2f} GB "
                         f"bf16 head = {r['ms_at_3_tb_s']:.2f} ms at 3.0 TB/s")
            continue
        head = f"{r['kind']:<9} {r['what']:<13} {r['scheme']:<8} {r['m']:>2}  {'ok' if r['ok'] else 'FAIL':<4}  "
        if r["kind"] == "gemm":
            n, k = map(int, r["what"].split("x"))
            rate = "" if r["fused_us"] is None else f"{n * k / r['fused_us'] / 1e6:.2f} TB/s, "
            lines.append(head + f"{fmt(r['apart_us'])} / {fmt(r['fused_us'])}  ({rate}{r['plan']})")
        else:
            note = (f"rel to before {r['rel_to_before']:.1e}" if r["kind"] == "block"
                    else f"{r['differ_from_transformers']:.2%} of outputs differ from transformers'")
            lines.append(head + " / ".join(fmt(r[f"{how}_us"]) for how in TABLES) + f"  ({note})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default $OUT/decode_fusion_<gpu>.json ($OUT: /tmp/out)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), untimed")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("check_decode_fusion needs a CUDA GPU (or --smoke on CPU with TRITON_INTERPRET=1)")
    d = SMOKE if args.smoke else DIMS
    out = args.out or os.path.join(os.environ.get("OUT", "/tmp/out"), f"decode_fusion_{gpu_tag()}.json")
    with torch.no_grad():
        rows = producer_rows(d, dev) + gemm_rows(d, dev) + block_rows(d, dev) + [floor_row()]
    record.write(out, record.meta(dev.type), rows)
    print(table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows ok; wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

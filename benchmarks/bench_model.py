"""Whole models end to end: plain transformers bf16 against fp8now's schemes and torchao's float8 per-row,
loaded from disk one at a time and measured by the same code (src/fp8now/bench.py: load, accuracy,
prefill, decode with a static KV cache replayed from a CUDA graph).

MODEL: a checkpoint folder, `smollm2` (the embedded model, real weights), or a preset written once into
--workdir as a random-weight bf16 checkpoint of real shapes: `llama3.1-8b` (all 32 layers),
`qwen3-30b-a3b` (8 of its 48 layers by default), `tiny` (CPU smoke runs).

    PYTHONPATH=src python benchmarks/bench_model.py llama3.1-8b --torchao --workdir /tmp/fp8now-bench
        # -> results/model_h200.json; a table of ratios against bf16 prints last
    ... --impls bf16,fp8now-channel --phases load,decode      # one part of a run
    ... --impls fp8now-tensor --add                            # adds to the file (same commit and GPU)
    ... --profile                                  # + GPU µs per kernel family of each prefill / decode row
    PYTHONPATH=src python benchmarks/bench_model.py tiny --device cpu --out model.json   # CPU smoke

Implementations: bf16, fp8now-<scheme> per --schemes (with --full also fp8now-<scheme>-full: lm_head and the
input embedding in FP8 too, Fp8Config(head=True, embedding=True)), and with --torchao torchao's float8 dynamic
per-row peers (torchao 0.18: `Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), mm_config=
Float8MMConfig(use_fast_accum=...))`), quantizing the same linears fp8now does (not lm_head, routers, or
transformers' fused expert tensors, which are no nn.Linear): `torchao-row` (its default fast accumulation)
and `torchao-row-f32acc` (float32 accumulation), each eager and under torch.compile (`-compiled`: the
model's forward compiled in torch.compile's default mode, as torchao recommends using it; no CUDA graphs
of its own, so its decode step is replayed from the same CUDA graph as every other row's; prefill shapes
compile on their first, untimed call; `-regional`: each decoder layer compiled alone instead, transformers'
"regional compilation", whose one compile serves every layer of the model: minutes less per shape, at the cost of
fusions across a layer's edges). `--torchao-compile` picks eager, compiled, both or regional; `--fp8now-compile`
adds fp8now's rows under the same compile (`fp8now-<scheme>-compiled`, `-regional`, and with `--fast-accum`
`fp8now-<scheme>-fast-regional` and so on: like for like with torchao's
compiled peers, inductor fusing transformers' elementwise ops around both; fp8now's producer kernels step aside
under compile, inductor fusing its activation quantizer instead). The bf16
logits of the accuracy prompts are kept in --workdir, so a run split with --impls compares every
implementation against the same reference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import record
from bench_linear import TORCHAO_ACCUM
from timing import host_hotspots, host_ms, kernels_of

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --torchao-compile -> (name suffix, compile: None, "model" or "regional") of the torchao peers
TORCHAO_COMPILE = {"eager": (("", None),), "compiled": (("-compiled", "model"),),
                   "both": (("", None), ("-compiled", "model")), "regional": (("-regional", "regional"),)}
# --fp8now-compile -> (name suffix, compile) of the fp8now rows added under torch.compile (the eager ones are always there)
FP8NOW_COMPILE = {"none": (), "compiled": (("-compiled", "model"),), "regional": (("-regional", "regional"),),
                  "both": (("-compiled", "model"), ("-regional", "regional"))}


def compile_model(model: torch.nn.Module, how: str | None) -> torch.nn.Module:
    """torch.compile (default mode) of the model's forward (`how` "model") or of each decoder layer alone
    ("regional": the layers share one compile); None: as it is. It compiles at the first call of each shape,
    which every measurement leaves untimed."""
    if how == "model":   # one compile per shape: a run's prefill, decode and accuracy shapes pass dynamo's default 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        model.forward = torch.compile(model.forward)
    elif how == "regional":
        # a layer's int attributes (layer_idx, read by the cache update) may be guarded per layer: let every
        # layer have its own compile rather than fall back to eager past dynamo's default 8
        layers = model.model.layers
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers))
        for layer in layers:
            layer.compile()
    elif how is not None:
        raise ValueError(f"compile_model: how must be None, 'model' or 'regional', got {how!r}")
    return model


def torchao_loader(fast_accum: bool, compiled: str | None = None):
    """bf16 `from_pretrained`, then torchao's float8 dynamic per-row quantize_ of fp8now's target linears
    (the load time includes both), then `compile_model(model, compiled)`."""
    def load(folder: Path, device: torch.device):
        from torchao.float8.inference import Float8MMConfig
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
        from torchao.quantization.granularity import PerRow

        from fp8now import Fp8Config
        from fp8now.cli.bench_load import bf16_loader
        from fp8now.hf.modules import target_linears

        model = bf16_loader(folder, device)[0]
        targets = set(target_linears(model, Fp8Config())[0])
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), mm_config=Float8MMConfig(use_fast_accum=fast_accum)),
            filter_fn=lambda module, fqn: fqn in targets)
        return compile_model(model, compiled), None
    return load


# Kernel families by name (torch.profiler's CUDA kernel names), first match wins. "norm / SiLU*up": the
# producers' kernels (fp8now.layers.producers), which also write the next linears' FP8 input where they read it.
KERNEL_KINDS = (
    ("quantizer", ("_quant_kernel", "_amax_kernel")),
    ("fp8now norm / SiLU*up", ("_rms_norm_kernel", "_silu_mul")),
    ("fp8now MoE", ("_moe_gemm_kernel", "_combine_kernel", "_gated_token_kernel", "_gated_group_kernel",
                    "_w13_gated_kernel", "_w2_combine_kernel", "_align_kernel", "_chunk_counts_kernel", "_place_kernel")),
    ("fp8now GEMM", ("_decode_kernel", "_gemv_kernel", "_rowwise_gemm_kernel", "_block_gemm_kernel",
                     "split_reduce_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("cuBLAS/CUTLASS GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "sm90", "matmul", "cublas")),
)


def kernel_times(fn) -> dict:
    """{"kernels": GPU µs per call of fn per kernel family, and the 8 longest kernels} (torch.profiler):
    where the time of a prefill or decode row goes; "host": the host's ms to enqueue one call, and its Python
    hotspots (timing.host_ms drained by a sync, host_hotspots: a host-bound row's enqueue time is near its wall time)."""
    kinds: dict[str, float] = {}
    top = []
    for key, us in kernels_of(fn):
        low = key.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p.lower() in low for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us
        top.append((us, key))
    top.sort(reverse=True)
    return {"kernels": dict(kinds={k: round(v, 1) for k, v in kinds.items()},
                            top=[dict(name=n, us=round(t, 1)) for t, n in top[:8]]),
            "host": dict(enqueue_ms=round(host_ms(fn, drain=torch.cuda.synchronize), 3),
                         top=host_hotspots(fn, drain=torch.cuda.synchronize))}


def with_table(loader, **fields):
    """`loader`, then every FP8 linear of the model planned from Table(**fields) (kernels.plan): a plan
    choice other than the defaults (the producers' kernels off, GEMMs quantizing inside), measured whole-model."""
    from fp8now.kernels.plan import Table
    from fp8now.layers.linear import Fp8Linear

    def load(folder: Path, device: torch.device):
        model, report = loader(folder, device)
        table = Table(**fields)
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.use_table(table)
        return model, report
    load.warm = loader.warm
    return load


def with_compile(loader, how: str):
    """`loader`, then `compile_model(model, how)`."""
    def load(folder: Path, device: torch.device):
        model, report = loader(folder, device)
        return compile_model(model, how), report
    load.warm = loader.warm
    return load


def implementations(args) -> dict:
    """impl name -> loader, filtered by --impls (an unknown name is an error listing the known ones)."""
    from fp8now.cli.bench_load import bf16_loader, fp8now_loader

    schemes = [s for s in args.schemes.split(",") if s]
    impls = {"bf16": bf16_loader, **{f"fp8now-{s}": fp8now_loader(s) for s in schemes}}
    if args.fast_accum:   # Fp8Config(fast_accum=True): the tensor cores' fast accumulation (not block)
        impls.update({f"fp8now-{s}-fast": fp8now_loader(s, fast_accum=True) for s in schemes if s != "block"})
    if args.full:         # Fp8Config(head=True, embedding=True): lm_head and the embedding in FP8 too
        impls.update({f"fp8now-{s}-full": fp8now_loader(s, head=True, embedding=True) for s in schemes})
    if args.producers:    # the RMSNorm and SiLU*up producers' kernels off (on by default: kernels.plan.PRODUCERS)
        impls.update({f"fp8now-{s}-noprod": with_table(fp8now_loader(s), producer_kernels=()) for s in schemes})
        impls.update({f"fp8now-{s}-nohead": with_table(fp8now_loader(s), head_norm_kernel=False) for s in schemes})
    if args.unstacked:    # one GEMV launch per layer at one token (on by default: q/k/v and gate/up in one each)
        impls.update({f"fp8now-{s}-unstacked": with_table(fp8now_loader(s), stacked_gemv=False) for s in schemes})
    # under --fp8now-compile: fp8now-<scheme> and, with --fast-accum, fp8now-<scheme>-fast (torchao's accumulation)
    eager = [(s, False) for s in schemes] + [(s, True) for s in schemes if args.fast_accum and s != "block"]
    impls.update({f"fp8now-{s}{'-fast' * fast}{how}": with_compile(fp8now_loader(s, fast_accum=fast), compiled)
                  for how, compiled in FP8NOW_COMPILE[args.fp8now_compile] for s, fast in eager})
    if args.torchao:
        impls.update({f"torchao-row{accum}{how}": torchao_loader(fast, compiled)
                      for how, compiled in TORCHAO_COMPILE[args.torchao_compile]
                      for accum, fast in TORCHAO_ACCUM[args.torchao_accum]})
    if not args.impls:
        return impls
    wanted = [v.strip() for v in args.impls.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in impls]
    if unknown:
        raise SystemExit(f"--impls {', '.join(unknown)}: not in this run's implementations "
                         f"({', '.join(impls)}; torchao's need --torchao)")
    return {name: impls[name] for name in wanted}


def reference_file(workdir: Path, model: str, folder: Path, opts) -> tuple[Path, dict]:
    """Where the bf16 accuracy logits of `model` are kept, and what they must have been made from."""
    return workdir / f"{model}-bf16-logits.pt", {"folder": str(folder), "prompts": opts.prompts, "seed": opts.seed}


def stored_reference(path: Path, key: dict):
    if not path.is_file():
        return None
    data = torch.load(path)
    return data["logits"] if data.get("key") == key else None


def main() -> None:
    from fp8now.cli.bench import decode_mode, measure, ratio_table
    from fp8now.cli.bench_alone import measure_alone
    from fp8now.cli.bench_args import add_arguments, options
    from fp8now.cli.bench_presets import NAMES, bench_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["llama3.1-8b"], metavar="MODEL",
                    help=f"checkpoint folders or presets ({', '.join(NAMES)}); default llama3.1-8b")
    ap.add_argument("--out", default=os.path.join(RESULTS, "model_h200.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--schemes", default="channel,block,tensor",
                    help="fp8now schemes, measured in this order after bf16 (default: %(default)s)")
    ap.add_argument("--torchao", action="store_true", help="add torchao's float8 per-row peers")
    ap.add_argument("--torchao-accum", default="both", choices=sorted(TORCHAO_ACCUM),
                    help="torchao-row (fast, its default), torchao-row-f32acc (f32), or both (default)")
    ap.add_argument("--torchao-compile", default="both", choices=sorted(TORCHAO_COMPILE),
                    help="the torchao peers eager, under torch.compile (-compiled), both (default), or each "
                         "decoder layer compiled alone (-regional: one compile for all layers)")
    ap.add_argument("--fp8now-compile", default="none", choices=sorted(FP8NOW_COMPILE),
                    help="also fp8now's rows under torch.compile: fp8now-<scheme>-compiled (the model's forward), "
                         "-regional (each decoder layer alone), both, or none (default): like for like with "
                         "--torchao-compile's peers")
    ap.add_argument("--fast-accum", action="store_true",
                    help="also fp8now-<scheme>-fast: tensor / channel with Fp8Config(fast_accum=True)")
    ap.add_argument("--full", action="store_true",
                    help="also fp8now-<scheme>-full: the output head and the input embedding in FP8 too")
    ap.add_argument("--unstacked", action="store_true",
                    help="also fp8now-<scheme>-unstacked: Table(stacked_gemv=False), one GEMV launch per layer at one "
                         "token (on by default: one for q/k/v and one for gate/up, fp8now.layers.stacked)")
    ap.add_argument("--producers", action="store_true",
                    help="also fp8now-<scheme>-noprod: the RMSNorm and SiLU*up producer kernels off (on by default), "
                         "and fp8now-<scheme>-nohead: Qwen3's per-head norms in transformers' ops "
                         "(Table.head_norm_kernel)")
    ap.add_argument("--impls", default="", help="only these implementations, e.g. bf16,fp8now-channel")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel family of every prefill and "
                    "decode row (torch.profiler; CUDA only)")
    ap.add_argument("--add", action="store_true", help="keep the rows of --out (same commit and GPU) but those "
                    "this call measures again (model, impl, phase, decode mode): a run split over several calls")
    ap.add_argument("--alone", help=argparse.SUPPRESS)          # the child process of a load row (bench_alone)
    ap.add_argument("--alone-folder", help=argparse.SUPPRESS)
    ap.add_argument("--alone-reload", action="store_true", help=argparse.SUPPRESS)
    add_arguments(ap)
    args = ap.parse_args()
    if args.alone:
        from fp8now.cli.bench_alone import alone_main
        alone_main(implementations(args)[args.alone], args.alone_folder, args.device, args.cold, args.alone_reload)
        return
    opts = options(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA GPU (or --device cpu, e.g. with the tiny preset)")
    if args.profile and device.type != "cuda":
        sys.exit("--profile times CUDA kernels: it needs --device cuda")
    impls = implementations(args)
    mode = decode_mode(opts, device)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fp8now-bench-"))
    info, rows = record.meta(args.device), []
    if args.add:
        if not os.path.isfile(args.out):
            sys.exit(f"--add: {args.out} does not exist; copy the previous call's file there, or run without --add")
        info, rows = record.continued(args.out, info, lambda r: True)

    def emit(row: dict) -> None:
        rows.append(row)
        record.write(args.out, info, rows)

    try:
        for arg in args.models:
            def log(text: str, arg=arg) -> None:
                print(f"[{time.strftime('%H:%M:%S')}] {arg}: {text}", file=sys.stderr, flush=True)
            name, folder = bench_model_dir(arg, workdir, args.layers, device, log=log)
            rows[:] = [r for r in rows if not (r["model"] == name and r["impl"] in impls  # --add: measured again
                                               and r["phase"] in opts.phases and r.get("mode") in (None, mode)
                                               and r.get("cold", opts.cold) == opts.cold)]
            path, key = reference_file(workdir, name, folder, opts)
            child = [sys.executable, os.path.abspath(__file__), "--schemes", args.schemes,
                     "--torchao-accum", args.torchao_accum, "--torchao-compile", args.torchao_compile,
                     "--fp8now-compile", args.fp8now_compile,
                     *["--torchao"] * args.torchao, *["--fast-accum"] * args.fast_accum, *["--full"] * args.full,
                     *["--producers"] * args.producers, *["--unstacked"] * args.unstacked]
            result = measure(name, folder, impls, device, opts, emit, log, stored_reference(path, key),
                             kernel_times if args.profile else None,
                             lambda impl, reload, folder=folder: measure_alone(child, impl, folder, device, opts.cold,
                                                                               reload))
            if result["reference"] is not None:
                torch.save({"key": key, "logits": result["reference"]}, path)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(ratio_table(rows))


if __name__ == "__main__":
    main()

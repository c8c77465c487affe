"""`fp8now.load`: a checkpoint folder -> a model with FP8 layers, quantized while it loads (SPEC §5).

The one pipeline (loading.pipeline) with a file source: the skeleton on the meta device, the plan (which modules
become FP8, this rank's slices under tensor parallelism), every header checked, then the tensors streamed: at
most one layer's float weight on the device at a time, quantized as soon as it is complete and dropped at once.
A checkpoint whose config.json has a `quantization_config` is FP8 already: its bytes are adopted as they are.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ..config import Fp8Config
from ..hf.names import model_key
from ..hf.folder import check_folder
from ..hf.skeleton import auto_map_notice, build_skeleton, read_raw_config
from ..layers.cpu_quantizer import install as install_cpu_quantizer, weight_quantizer
from ..layers.guard import install as install_guard
from ..layers.linear import Fp8Linear
from ..layers.moe import Fp8Experts
from ..layers.shared_input import share_inputs
from ..report import LoadReport
from .devices import resolve_device
from .pipeline import finish, stream_files
from .plan import plan_quantize
from .prequantized import plan_prequantized, prequantized_config
from .rows import add_experts, build_report
from .sizes import check_sizes
from .sinks import Sinks
from .source import FileSource

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def load(model_dir: str | Path, config: Fp8Config | None = None,
         device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16, *,
         measure_error: bool = True, tp_plan: str | dict[str, str] | None = None,
         tp_group=None, moe_parallel: str | None = None) -> tuple[nn.Module, LoadReport]:
    """Load a bf16/fp16/fp32 Hugging Face checkpoint folder with its block linears quantized to FP8.

    Builds the transformers model on the meta device, swaps the target linears for `Fp8Linear`,
    checks every tensor header (names, shapes, dtypes) against the model, then streams the tensors:
    each layer is quantized as soon as its weight (and bias) arrived, on `device` (None or "auto":
    cuda if available, else cpu). Non-quantized tensors are stored in `dtype`. `measure_error` computes each
    layer's SQNR / rel_diff for the report (one chunked dequantize per layer).
    Returns `(model, report)`; the model is in eval mode with no tensor left on meta. keep_bf16="auto:F" is
    fp8now.load's (fp8now.sensitivity.keep.load: it scores the layers, then runs this with them ignored).

    `tp_plan="auto"` (the model's own transformers plan) or a dict {module pattern: style}, inside
    torchrun with torch.distributed initialised: each rank of `tp_group` (default: all) reads only
    its slice of every planned tensor and quantizes it to the bytes of that slice at TP=1 (SPEC §6).
    MoE experts go by `moe_parallel`: "ep" (default: whole experts per rank) or "tp" (every expert
    split across the ranks), or by the experts styles of a plan dict.
    """
    start = time.perf_counter()
    config = config or Fp8Config()
    if config.keep_bf16 is not None:
        raise ValueError(f"keep_bf16={config.keep_bf16!r} is applied by fp8now.load (fp8now.sensitivity.keep.load), "
                         "which scores the layers before this pipeline runs; call that one")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16, float16 or float32, got {dtype}")
    device = resolve_device(device)
    at_start = None
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.reset_peak_memory_stats(device)
        at_start = torch.cuda.memory_allocated(device)
    model_dir = Path(model_dir)
    check_folder(model_dir)          # regular files inside the folder only: nothing is opened before this
    raw = read_raw_config(model_dir)
    source = FileSource(model_dir)   # the index checked, every header read (no data)
    check_sizes(raw, source.headers(), model_dir)   # before the skeleton: a config the files cannot hold
    quantization = prequantized_config(model_dir)
    if quantization is not None and (tp_plan is not None or moe_parallel is not None):
        raise ValueError(f"{model_dir} holds an FP8 checkpoint (quantization_config): tp_plan is not supported "
                         "for pre-quantized loading yet; load the bf16 checkpoint with tp_plan, or this one "
                         "without it")
    model = build_skeleton(model_dir, dtype)
    if quantization is not None:   # FP8 files: adopted as they are
        rename = model_key(model)
        source = FileSource(model_dir, rename)
        plan, info = plan_prequantized(model, source.headers(), model_dir, quantization, config, rename)
        what = f"{model_dir} ({info.fmt}, pre-quantized)"
    else:
        plan = plan_quantize(model, config, str(model_dir), dtype, tp_plan=tp_plan, tp_group=tp_group,
                             moe_parallel=moe_parallel)
        what = str(model_dir)
    quantizers = None
    if device.type == "cpu" and quantization is None:   # the weights quantized here, by the compiled quantizer?
        work = dtype.itemsize * sum(m.weight.numel() if isinstance(m, Fp8Linear) else m.w13.numel() + m.w2.numel()
                                    for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts)))
        quantizers = weight_quantizer(plan.scheme, work)
    sinks = Sinks(plan, device, dtype, measure_error, quantizers=quantizers)
    stream_files(plan, source, sinks)
    finish(model, device, str(model_dir))
    share_inputs(model)
    install_guard(model)   # reload_weights is atomic for this model's forwards (layers.guard)
    report = build_report(model, sinks.rows, plan.ignored, what, device, dtype, plan.scheme,
                          plan.weight_numerics)
    report.cpu_quantizer = install_cpu_quantizer(model, dtype)
    report.cpu_weight_quantizer = sinks.quantizer_note()
    add_experts(report, model, plan.experts.rows if plan.experts is not None else plan.adopted.experts.rows)
    report.skipped_tensors = sinks.skipped
    report.notices = [n for n in (auto_map_notice(model_dir, raw),) if n] + source.notices + sinks.absurd
    report.files = [p.name for p in source.files]
    report.load_s = time.perf_counter() - start
    if at_start is not None:
        report.peak_device_bytes = torch.cuda.max_memory_allocated(device)
        report.device_bytes_at_start = at_start
    return model, report

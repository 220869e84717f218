#!/usr/bin/env bash
# The kernel tests and the MoE benchmark on the GPU machine, results under $OUT.
#
#   bash scripts/gpu_run.sh bash scripts/gpu_measure.sh tests|bench|half|decode|all
#
# Run it through scripts/gpu_run.sh (Vulkan, carried wheels, onnxruntime 1.32). One device
# command may run 10 minutes: `tests` and `bench` fit one call each (`all` is both, for a
# machine with more time). Writes (at most 8 files come back from $OUT):
#   tests:  $OUT/tests.log (pytest -ra of tests/kernels), $OUT/tests.xml (junit),
#           $OUT/speed.jsonl (the planner-vs-fastest timings, tests/kernels/test_planner_choices.py)
#   bench:  $OUT/bench.log, $OUT/bench.json (every measurement), $OUT/table.txt (the
#           comparison tables), $OUT/moe_kernels.png (time against tokens)
# Both log the GPU clocks (nvidia-smi) before and after. Budgets: GPU_TESTS_S (default 480)
# and GPU_BENCH_S (540) seconds; BENCH_ARGS adds benchmark options (default: the full-size
# Qwen3-30B-A3B and gpt-oss-20b layers, every variant, ORT WebGPU where carried). `half` is
# `bench` with the QMoE layers in float32 and float16, the planner's choice in each (issue 20:
# float16 at least as fast at every size; the report's float16-vs-float32 table). `decode`
# is `bench` for the decode path (issue 20): the Qwen3-30B-A3B layers (QMoE, then MoE) at 1
# and 16 tokens, the decode variants only, each dispatch's added cost (--stages, prefix
# timing), and the routed variant's tunables swept (DECODE_SWEEP overrides the list); its
# budget defaults to 230 s.
set -uo pipefail
mode="${1:-all}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

clocks() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
    --format=csv,noheader 2>/dev/null || true
}

status=0
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  echo "clocks before tests: $(clocks)" | tee "$OUT/tests.log"
  rm -f "$OUT/speed.jsonl"
  ONNX_MOE_FUSE_SPEED_LOG="$OUT/speed.jsonl" timeout "${GPU_TESTS_S:-480}" \
    python3 -m pytest -ra -q -p no:cacheprovider --junitxml="$OUT/tests.xml" tests/kernels \
    2>&1 | tee -a "$OUT/tests.log"
  status=${PIPESTATUS[0]}
  echo "pytest exit status $status; clocks after: $(clocks)" | tee -a "$OUT/tests.log"
fi

if [ "$mode" = bench ] || [ "$mode" = half ] || [ "$mode" = decode ] || [ "$mode" = all ]; then
  webgpu=()
  if [ -n "${ORT_WEBGPU_DIR:-}" ]; then webgpu=(--ort-webgpu "$ORT_WEBGPU_DIR"); fi
  if [ -n "${BENCH_ARGS:-}" ]; then
    read -r -a extra <<<"$BENCH_ARGS"  # split on blanks, no pathname expansion
  elif [ "$mode" = half ]; then
    extra=(--ops qmoe --cases '*_a3b' '*_20b' --dtype float32 float16 --chosen-only)
  elif [ "$mode" = decode ]; then
    sweep='[{"decodeRoutedRows":1},{"decodeRoutedRows":4},{"decodeRoutedGroups":8},'
    sweep+='{"decodeRoutedGroups":2},{"decodeRoutedGroups":8,"decodeRoutedRows":4},'
    sweep+='{"decodeInPlaceCodes":0},{"decodeFc2Rows":4},{"decodeFc2Rows":16}]'
    extra=(--ops qmoe moe --cases '*_a3b' --tokens 1 16 --stages --no-ort --budget 3
      --variants '*decode*' '*gemv*' --sweep "${DECODE_SWEEP:-$sweep}")
  else
    extra=(--cases '*_a3b' '*_20b')
  fi
  echo "clocks before the benchmark: $(clocks)" | tee "$OUT/bench.log"
  budget="${GPU_BENCH_S:-540}"
  if [ "$mode" = decode ]; then budget="${GPU_BENCH_S:-230}"; fi
  timeout "$budget" python3 benchmarks/bench_moe_kernels.py "${webgpu[@]}" \
    "${extra[@]}" --json "$OUT/bench.json" --table "$OUT/table.txt" \
    --plot "$OUT/moe_kernels.png" 2>&1 | tee -a "$OUT/bench.log"
  bench=${PIPESTATUS[0]}
  echo "benchmark exit status $bench; clocks after: $(clocks)" | tee -a "$OUT/bench.log"
  if [ "$bench" != 0 ] && [ -f "$OUT/bench.json" ]; then
    # Cut short: the tables and the plot of what was measured (the record is saved per case).
    python3 benchmarks/moe_report.py "$OUT/bench.json" --plot "$OUT/moe_kernels.png" \
      | tee "$OUT/table.txt"
  fi
  [ "$status" = 0 ] && status=$bench
fi
exit "$status"

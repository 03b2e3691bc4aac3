#!/usr/bin/env bash
# One call on the GPU machine that verifies everything GPU-side, in phases (PHASES picks, in order):
#   prebuild  every module a d12 step builds, compiled 16 at a time into the cubin cache
#           (dev/prebuild.py), so that no timed or time-limited command below compiles first
#   tests   the whole `pytest -m gpu` suite, one process per test file (a kernel fault that kills the
#           CUDA context fails its own file, not the rest); TESTS narrows it to some files
#   shards  the whole suite in TEST_SHARDS (default 2) concurrent pytest processes (--shard K/N):
#           about half the wall time of `tests` on one GPU (H100, 2026-11-26: 265 s against 481)
#   bench   the step benchmark: defaults, --attention-kernel 1 and 2, --softmax-kernel 5
#           --matmul-kernel 5, and the previous matmul defaults (engine 2: --matmul-kernel 6
#           --matmul-backward-kernel 2)
#   sample  the sampling benchmark (batch 1 and 8, with and without the KV cache)
#   profile the per-kernel step profile, and a short real d12 training run
#   lab     the kernel lab for LAB_OPS (default: all), bounded by LAB_SECONDS
#   (the device machine's preparation script, here, once)
#   device run, carry [".device", ".llmc_cache"]:  source .device/setup.sh && bash dev/gpu_session.sh
#   (.llmc_cache from `LLMC_CACHE=.llmc_cache python dev/prebuild.py` here: ~50 MB, within the carry's 64 MiB)
# .llmc_cache (optional) prebuilt cubins (LLMC_CACHE=.llmc_cache). The tiny shakespeare shards that some
# GPU tests and the profile's training run read are made first when missing (prepro_tinyshakespeare.py
# tokenizes the committed input.txt with the vocabulary the package ships: no network). .whl (optional)
# holds wheels to put on PYTHONPATH. Logs go to $OUT (or ./gpu_out).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # llmc for the dev/ scripts, without an install
[ -d .llmc_cache ] && export LLMC_CACHE=$PWD/.llmc_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
S="$OUT/summary.txt"
[ -f dev/data/tinyshakespeare/tiny_shakespeare_val.bin ] || python3 prepro_tinyshakespeare.py > "$OUT/prepro.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/device.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$S"; }
PHASES=${PHASES:-prebuild tests bench sample profile lab}
for phase in $PHASES; do case $phase in
prebuild)
  step "prebuild"
  timeout 300 python3 dev/prebuild.py -j 16 2>&1 | tail -1 | tee -a "$S" ;;
shards)
  N=${TEST_SHARDS:-2}
  step "pytest -m gpu in $N concurrent shards"
  for k in $(seq 0 $((N - 1))); do
    (timeout "${SHARD_SECONDS:-560}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --shard "$k/$N" > "$OUT/gpu_shard$k.txt" 2>&1
     echo "rc=$?" >> "$OUT/gpu_shard$k.txt") &
  done
  wait
  for k in $(seq 0 $((N - 1))); do
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_shard$k.txt" | head -5 | tee -a "$S"
    grep -E "[0-9]+ (passed|failed|error)" "$OUT/gpu_shard$k.txt" | tail -1 | tee -a "$S"
  done ;;
tests)
  # every test file with GPU tests (those that mark some test `gpu`), unless TESTS names some
  for f in ${TESTS:-$(grep -l "mark.gpu" tests/test_*.py)}; do
    n=$(basename "$f" .py)
    step "pytest -m gpu $f"
    timeout "${TEST_SECONDS:-240}" python3 -m pytest -m gpu -q -rs -s "$f" > "$OUT/$n.txt" 2>&1
    echo "rc=$? $(grep -E '^(FAILED|ERROR)' "$OUT/$n.txt" | head -5)" | tee -a "$S"
    grep -E "[0-9]+ (passed|failed|error)" "$OUT/$n.txt" | tail -1 | tee -a "$S"
  done ;;
bench)
  step "bench default"
  timeout 100 python3 dev/bench_step.py --steps 20 2>&1 | tail -4 | tee -a "$S"
  step "bench --precision bf16, B=4 and 16"
  timeout 100 python3 dev/bench_step.py --steps 20 --precision bf16 2>&1 | tail -3 | tee -a "$S"
  timeout 100 python3 dev/bench_step.py --steps 20 --precision bf16 -b 16 2>&1 | tail -3 | tee -a "$S"
  step "bench --attention-kernel 1 (the composite attention, the previous default)"
  timeout 100 python3 dev/bench_step.py --steps 20 --attention-kernel 1 2>&1 | tail -3 | tee -a "$S"
  step "bench --attention-kernel 2 (fused, tiles staged by the threads)"
  timeout 100 python3 dev/bench_step.py --steps 20 --attention-kernel 2 2>&1 | tail -3 | tee -a "$S"
  step "bench --softmax-kernel 5 --matmul-kernel 5"
  timeout 60 python3 dev/bench_step.py --steps 10 --softmax-kernel 5 --matmul-kernel 5 2>&1 | tail -3 | tee -a "$S"
  step "bench LLMC_GRAPHS=0 (kernel by kernel)"
  LLMC_GRAPHS=0 timeout 100 python3 dev/bench_step.py --steps 20 2>&1 | tail -3 | tee -a "$S"
  step "bench -b 1 -t 64, graphs and LLMC_GRAPHS=0"
  timeout 60 python3 dev/bench_step.py --steps 20 -b 1 -t 64 2>&1 | tail -2 | tee -a "$S"
  LLMC_GRAPHS=0 timeout 60 python3 dev/bench_step.py --steps 20 -b 1 -t 64 2>&1 | tail -2 | tee -a "$S"
  step "bench ${BENCH_EXTRA:-(no extra)}"
  [ -n "${BENCH_EXTRA:-}" ] && timeout 60 python3 dev/bench_step.py --steps 20 $BENCH_EXTRA 2>&1 | tail -3 | tee -a "$S"
  step "bench --matmul-kernel 6 --matmul-backward-kernel 2"
  timeout 60 python3 dev/bench_step.py --steps 20 --matmul-kernel 6 --matmul-backward-kernel 2 2>&1 | tail -3 | tee -a "$S" ;;
sample)
  step "sampling benchmark"
  timeout 150 python3 dev/bench_sample.py --device cuda 2>&1 | tee -a "$S" ;;
profile)
  step "profile"
  timeout 60 python3 dev/profile_step.py --md "$OUT/profile.md" ${PROFILE_ARGS:-} 2>&1 | tail -32 | tee -a "$S"
  step "train d12"
  timeout 90 python3 train_gpt2.py -e d12 -x 20 -v 10 -m 4 -s 20 -g 32 -l 6e-4 -u 5 > "$OUT/train.txt" 2>&1; tail -12 "$OUT/train.txt" | tee -a "$S" ;;
lab)
  step "lab (${LAB_SECONDS:-300}s) ${LAB_OPS:-all}"
  timeout "${LAB_SECONDS:-300}" python3 dev/cuda/run_all.py ${LAB_QUICK:+--quick} ${LAB_OPS:-} 2>&1 | tee -a "$S"
  tar czf "$OUT/lab.tar.gz" docs/lab 2>/dev/null ;;
*) echo "unknown phase $phase" | tee -a "$S" ;;
esac; done
step "done"

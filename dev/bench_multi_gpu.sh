#!/usr/bin/env bash
# Data parallel on a multi-GPU machine, in one call. Logs are written under $WORK (default
# /tmp/llmc_multi_gpu); what comes back goes to $OUT (default gpu_out): summary.txt, logs.tgz (every
# log) and the two Chrome traces -- four files, under the GPU machine's limit of eight:
#   1. agreement: d12 for 10 steps, 1 GPU at B=8 vs NP GPUs at B=8/NP (-z 0 and -z 1), same tokens:
#      per-step and val losses side by side, the largest differences (TF32 noise expected)
#   2. throughput at d12, B=16 per GPU, T=1024: 1 GPU, NP GPUs -z 0, NP GPUs -z 1; tokens/s (median
#      of the steps after warm-up), scaling efficiency, GPU memory per rank (nvidia-smi, sampled)
#   3. a profile of one step per -z: kernels and per-layer reductions with CUDA event times
#      (profile_z*.txt, and profile_z*.json for chrome://tracing / ui.perfetto.dev)
#   4. bad input on the GPU: more ranks than GPUs -> one line, non-zero exit, no hang
#
#   on a machine with 2+ GPUs, mpirun, mpi4py, nccl4py and PyCUDA (dev/data carried along if wanted):
#       bash dev/bench_multi_gpu.sh
# Knobs: NP (default: every GPU), STEPS (throughput steps, 30), PHASES ("agree speed profile bad"),
# EXTRA (more train_gpt2.py flags for the speed runs, e.g. "--precision bf16").
# NCCL_NVLS_ENABLE stays 0 (NVLink multicast off; llmc/dist.py also sets it when unset).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
RES=${OUT:-gpu_out}; mkdir -p "$RES"
OUT=${WORK:-/tmp/llmc_multi_gpu}; rm -rf "$OUT"; mkdir -p "$OUT"   # (the logs' folder; $RES gets the results)
[ -d .llmc_cache ] && export LLMC_CACHE=$PWD/.llmc_cache
NP=${NP:-$(nvidia-smi -L | wc -l)}
STEPS=${STEPS:-30}
S="$OUT/summary.txt"
step() { echo "=== $* ($(date +%T))" | tee -a "$S"; }

# Open MPI wants to be told it may run as root and should not pin each rank to one core; MPICH's
# mpiexec needs neither
MPI_FLAGS=""
if mpirun --version 2>&1 | grep -qi "open mpi"; then
  MPI_FLAGS="--bind-to none"; [ "$(id -u)" = 0 ] && MPI_FLAGS="$MPI_FLAGS --allow-run-as-root"
fi
mpi() { local n=$1; shift; timeout "${RUN_SECONDS:-400}" mpirun $MPI_FLAGS -np "$n" "$@"; }

step "machine"
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; mpirun --version 2>&1 | head -2
  python3 -c "import mpi4py, nccl.core as n; print('mpi4py', mpi4py.__version__, '| nccl4py', n.__version__, '| NCCL', n.get_version())"
} 2>&1 | tee -a "$S"

# data: tiny shakespeare if it was carried along, else a synthetic stream (a random text of 128K
# tokens, repeated: the ranks' slices differ, so the agreement checks the reductions; the loss falls)
TRAIN=dev/data/tinyshakespeare/tiny_shakespeare_train.bin VAL=dev/data/tinyshakespeare/tiny_shakespeare_val.bin
if [ ! -f "$TRAIN" ]; then
  TRAIN=/tmp/llmc_synth/train.bin VAL=/tmp/llmc_synth/val.bin
  python3 -c "
import numpy as np; from llmc.data import write_shard
r = np.random.default_rng(0); base = r.integers(0, 50257, 1 << 17)
write_shard('$TRAIN', np.tile(base, 3)); write_shard('$VAL', base[:40960])" || exit 1
  echo "data: synthetic ($TRAIN)" | tee -a "$S"
fi
D=(-i "$TRAIN" -j "$VAL")

losses() { grep -oP "^step\s+\d+/\d+ \| loss \K[0-9.]+" "$1" | tr '\n' ' '; }
for phase in ${PHASES:-agree speed profile bad}; do case $phase in
agree)
  BN=$((8 / NP))
  COMMON=(-e d12 -t 1024 -x 10 -v 5 -m 2 -s 0 -l 6e-4 -u 2 -c 0.1 "${D[@]}")
  step "agree: 1 GPU B=8"
  timeout 400 python3 train_gpt2.py "${COMMON[@]}" -b 8 > "$OUT/agree_1gpu.txt" 2>&1; echo "rc=$?" | tee -a "$S"
  for z in 0 1; do
    step "agree: $NP GPUs B=$BN -z $z"
    mpi "$NP" python3 train_gpt2.py "${COMMON[@]}" -b "$BN" -z $z > "$OUT/agree_${NP}gpu_z$z.txt" 2>&1
    echo "rc=$?" | tee -a "$S"
  done
  python3 - "$OUT" "$NP" <<'PY' 2>&1 | tee -a "$S"
import re, sys
out, n = sys.argv[1], sys.argv[2]
def read(name):
    t = open(f"{out}/{name}").read()
    return ([float(v) for v in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", t, re.M)],
            [float(v) for v in re.findall(r"^val loss ([0-9.]+)", t, re.M)])
one = read("agree_1gpu.txt")
runs = {z: read(f"agree_{n}gpu_z{z}.txt") for z in (0, 1)}
print("step  1 GPU      " + "  ".join(f"{n} GPU -z {z}" for z in runs))
for i, l in enumerate(one[0]):
    print(f"{i + 1:4d}  {l:.6f}  " + "  ".join(f"{r[0][i]:.6f}" if i < len(r[0]) else "   -    " for r in runs.values()))
print("val   " + " ".join(f"{v:.6f}" for v in one[1]) + "  |  " + "  |  ".join(" ".join(f"{v:.6f}" for v in r[1]) for r in runs.values()))
for z, r in runs.items():
    d = max((abs(a - b) for a, b in zip(r[0] + r[1], one[0] + one[1])), default=float("nan"))
    print(f"max |loss difference|, {n} GPUs -z {z} vs 1 GPU: {d:.2e} over {len(r[0])} steps + {len(r[1])} val")
d = max((abs(a - b) for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1])), default=float("nan"))
print(f"max |loss difference|, -z 1 vs -z 0: {d:.2e}")
PY
  ;;
speed)
  for run in "1 0" "$NP 0" "$NP 1"; do
    set -- $run; n=$1 z=$2; name="speed_${n}gpu_z$z"
    step "speed: d12 B=16 T=1024 on $n GPU(s) -z $z, $STEPS steps"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/$name.mem.csv" &
    smi=$!
    if [ "$n" = 1 ]; then
      timeout 400 python3 train_gpt2.py -e d12 -b 16 -t 1024 -x "$STEPS" -v 0 -s 0 "${D[@]}" ${EXTRA:-} > "$OUT/$name.txt" 2>&1
    else
      mpi "$n" python3 train_gpt2.py -e d12 -b 16 -t 1024 -x "$STEPS" -v 0 -s 0 -z "$z" "${D[@]}" ${EXTRA:-} > "$OUT/$name.txt" 2>&1
    fi
    echo "rc=$?" | tee -a "$S"
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    python3 - "$OUT/$name" "$n" <<'PY' 2>&1 | tee -a "$S"
import re, statistics, sys
base, n = sys.argv[1], int(sys.argv[2])
t = open(base + ".txt").read()
rows = re.findall(r"^step\s+(\d+)/\d+ \| loss [0-9.]+ .*?\| ([0-9.]+) ms \|.*?(\d+) tok/s", t, re.M)
late = [(float(ms), int(tok)) for s, ms, tok in rows if int(s) > 5]
if late:
    print(f"  {statistics.median(t for _, t in late):,.0f} tokens/s, {statistics.median(m for m, _ in late):.2f} ms/step "
          f"(median of steps 6..{len(rows)})")
peak = {}
for line in open(base + ".mem.csv"):
    try:
        i, used = (int(v) for v in line.split(","))
        peak[i] = max(peak.get(i, 0), used)
    except ValueError:
        pass
print("  peak GPU memory used (nvidia-smi, MiB): " + ", ".join(f"GPU {i}: {m}" for i, m in sorted(peak.items())))
PY
  done
  python3 - "$OUT" "$NP" <<'PY' 2>&1 | tee -a "$S"
import re, statistics, sys
out, n = sys.argv[1], sys.argv[2]
def tok(name):
    rows = re.findall(r"^step\s+(\d+)/\d+ .*\| (\d+) tok/s", open(f"{out}/{name}.txt").read(), re.M)
    late = [int(t) for s, t in rows if int(s) > 5]
    return statistics.median(late) if late else float("nan")
one = tok("speed_1gpu_z0")
for z in (0, 1):
    many = tok(f"speed_{n}gpu_z{z}")
    print(f"scaling, {n} GPUs -z {z}: {many:,.0f} / ({n} x {one:,.0f}) = {many / (int(n) * one):.1%}")
PY
  ;;
profile)
  for z in 1 0; do
    step "profile: one d12 B=16 T=1024 step on $NP GPUs, -z $z"
    mpi "$NP" python3 dev/profile_multi_gpu.py -e d12 -b 16 -t 1024 -z $z --out "$OUT/profile_z$z" > "$OUT/profile_z$z.log" 2>&1
    echo "rc=$?" | tee -a "$S"; grep -E "^(d12|rank|  reductions|  memory)" "$OUT/profile_z$z.log" | tee -a "$S"
  done ;;
bad)
  step "bad: $((NP + 1)) ranks on $NP GPUs (expect one error line, exit 1, no hang)"
  LLMC_DIST_TIMEOUT=30 mpi $((NP + 1)) python3 train_gpt2.py -e d12 -x 1 "${D[@]}" > "$OUT/bad_ranks.txt" 2>&1
  echo "rc=$?" | tee -a "$S"; grep "^error" "$OUT/bad_ranks.txt" | tee -a "$S"
  step "bad: -z 1 resume with another rank count"
  timeout 300 python3 train_gpt2.py -e d12 -b 4 -t 256 -x 2 -v 0 -s 0 -o "$OUT/ck1" "${D[@]}" > "$OUT/bad_resume_write.txt" 2>&1
  mpi "$NP" python3 train_gpt2.py -e d12 -b 4 -t 256 -x 4 -v 0 -s 0 -o "$OUT/ck1" -y 1 "${D[@]}" > "$OUT/bad_resume.txt" 2>&1
  echo "rc=$?" | tee -a "$S"; grep "^error" "$OUT/bad_resume.txt" | tee -a "$S"
  rm -rf "$OUT/ck1"
  step "resume: $NP GPUs -z 1, 4 steps with a checkpoint at 2, then resumed from 2 (losses must match)"
  # (--deterministic: no float atomics, so the resumed run can match the whole one bit for bit)
  C=(-e d12 -b 4 -t 256 -x 4 -n 2 -v 0 -s 0 -z 1 --deterministic "${D[@]}")
  mpi "$NP" python3 train_gpt2.py "${C[@]}" -o "$OUT/ckA" > "$OUT/resume_full.txt" 2>&1
  mpi "$NP" python3 train_gpt2.py "${C[@]}" -o "$OUT/ckB" > /dev/null 2>&1
  rm -f "$OUT"/ckB/*_00000004*      # model, every rank's state and the DONE marker of step 4
  ls "$OUT/ckB" | tee -a "$S"
  mpi "$NP" python3 train_gpt2.py "${C[@]}" -o "$OUT/ckB" -y 1 > "$OUT/resume_part.txt" 2>&1
  echo "full:    $(losses "$OUT/resume_full.txt")" | tee -a "$S"
  echo "resumed: $(losses "$OUT/resume_part.txt")" | tee -a "$S"
  cmp "$OUT/ckA/model_00000004.bin" "$OUT/ckB/model_00000004.bin" && echo "final weights identical" | tee -a "$S"
  rm -rf "$OUT/ckA" "$OUT/ckB" ;;
*) echo "unknown phase $phase" | tee -a "$S" ;;
esac; done
step "done"

# what comes back: the summary, every log in one archive (no checkpoints), the traces
cp "$S" "$RES/summary.txt"
tar -czf "$RES/logs.tgz" -C "$OUT" --exclude='ck*' . 2>/dev/null
cp "$OUT"/profile_z*.json "$RES/" 2>/dev/null
exit 0

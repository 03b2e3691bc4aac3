set -o pipefail
R=$OUT
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_attention.py tests/test_encoder.py tests/test_layernorm.py tests/test_hardening.py tests/test_adamw.py tests/test_cost.py > $R/pytest.txt 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $R/pytest.txt | head -20; tail -1 $R/pytest.txt
{
for b in 16 4; do
 echo "### layernorm_forward b=$b"; timeout 60 python3 dev/cuda/layernorm_forward.py 5 6 --dtype bf16 --batch $b --quick
 echo "### layernorm_backward b=$b"; timeout 60 python3 dev/cuda/layernorm_backward.py 5 6 --dtype bf16 --batch $b --quick
done
echo "### encoder_backward fp32"; timeout 60 python3 dev/cuda/encoder_backward.py 3 5 6 --batch 16 --quick
echo "### encoder_backward bf16"; timeout 60 python3 dev/cuda/encoder_backward.py 3 6 --dtype bf16 --batch 16 --quick
echo "### attention_forward bf16 b16"; timeout 90 python3 dev/cuda/attention_forward.py --dtype bf16 --batch 16 --quick
echo "### attention_forward bf16 b4"; timeout 90 python3 dev/cuda/attention_forward.py --dtype bf16 --quick
} > $R/lab.txt 2>&1
grep -E "^###|%|TFLOP|FAIL|rror" $R/lab.txt | head -70
for b in 16 4; do
 for f in "" "--attention-kernel 4 --attention-backward-kernel 3" "--layernorm-kernel 6 --layernorm-backward-kernel 6"; do
  echo "bench bf16 b=$b $f: $(timeout 100 python3 dev/bench_step.py --precision bf16 -b $b $f 2>&1 | grep -E 'ms/step|median' | tail -1)"
 done
done | tee $R/bench.txt

# run 8, call 1: fused decode kernels (Triton) on the GPU: their tests, then graph decode fused vs unfused
# (HYBRID_FUSED_DECODE=0) in one call, the floor per layer, then the GPU test files. Clean `git archive HEAD`.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
timeout 120 python3 -m pytest -q -x tests/test_gpu_kernels.py > $OUT/t_gpu_kernels.txt 2>&1; echo "kernels: $(tail -1 $OUT/t_gpu_kernels.txt)"
grep -h -B5 -A25 "^E  " $OUT/t_gpu_kernels.txt | head -60
echo "# kernel tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for v in fused:bf16 unfused:bf16 fused:int8 unfused:int8 fused:int4; do
  k=${v%%:*}; d=${v##*:}; f=0; [ $k = fused ] && f=1
  HYBRID_FUSED_DECODE=$f timeout 100 $E --cpu-dtype $d --out /tmp/e2e_${k}_$d > /tmp/e2e_${k}_$d.txt 2>&1
  echo "== $k $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement)=[0-9.]+" /tmp/e2e_${k}_$d.txt | tr '\n' ' ') $(grep -E "Error" /tmp/e2e_${k}_$d.txt | head -2)"
done | tee $OUT/e2e.txt
cat /tmp/e2e_*_*.txt > $OUT/e2e_logs.txt
echo "# e2e done at $(( $(date +%s) - T0 )) s"
for f in 1 0; do
  HYBRID_FUSED_DECODE=$f timeout 60 python3 -m bench.decode_probe --dtypes bf16 --cases 1x8 --iters 20 --floor --out /tmp/floor_$f.json > /tmp/floor_$f.txt 2>&1
  echo "== floor fused=$f"; grep -iE "floor|us" /tmp/floor_$f.txt | tail -8
done | tee $OUT/floor.txt
echo "# floor done at $(( $(date +%s) - T0 )) s"
for f in tests/test_gpt_oss_gpu.py tests/test_generate_gpu.py tests/test_hybrid_gpu.py tests/test_deepseek_gpu.py tests/test_expert_deferral.py tests/test_decode_fusions.py tests/test_replace_gpu.py; do
  L=$(( 590 - ($(date +%s) - T0) )); [ $L -lt 20 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $(( L < 90 ? L : 90 )) python3 -m pytest -q -x $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B5 -A20 "^E  " /tmp/t_*.txt | head -50
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

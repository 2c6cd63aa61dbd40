# run 23, call 2 (session 28): call 1's host drew a slow, noisy ceiling (109 GB/s, 77-80 in the e2e runs), so the
# kernel-alone A/B again with more rounds, bf16 and int8 (target 5's dtypes): hsum 0/1 with whole tail tasks, and
# hsum 1 with the tail cut in 4; then every GPU test file at this code (hsum 1, the CPU lane's kernels changed);
# then the fixed-cost fit with and without the tail cut. Built in place from the call's copy of the tree.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 200 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 \
  --variants fused+hsum=0,fused,fused+tail_split=4 --rounds 5 --out $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "ceiling" $OUT/probe.txt; sed -n '/^# medians/,$p' $OUT/probe.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
for f in tests/test_hybrid_gpu.py tests/test_generate_gpu.py tests/test_decode_fusions.py tests/test_expert_deferral.py \
         tests/test_replace_gpu.py tests/test_deepseek_gpu.py tests/test_gpt_oss_gpu.py tests/test_l2_touch.py \
         tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py; do
  L=$(( 480 - ($(date +%s) - T0) )); [ $L -lt 20 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
L=$(( 575 - ($(date +%s) - T0) ))
[ $L -gt 40 ] && timeout $L python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x1,1x2,1x4,1x8,2x8,4x8 --iters 30 \
  --variants fused,fused+tail_split=4 --rounds 2 --fit --out $OUT/probe_fit.json > $OUT/probe_fit.txt 2>&1
grep -iE "ceiling|fit|fixed" $OUT/probe_fit.txt | tail -8
echo "# all done at $(( $(date +%s) - T0 )) s"

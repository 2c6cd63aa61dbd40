# run 12, call 3 (prepared in session 17, not yet run): the GPU test files call 2 had no time for, then e2e
# int8/int4 at batch 1 and 8 again on this call's host (run 11 call 4's steps); a clean `git archive HEAD`
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in tests/test_generate_gpu.py tests/test_replace_gpu.py tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py; do
  L=$(( 200 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for d in int8 int4; do
  L=$(( 370 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "$d not run (time)"; continue; }
  timeout $(( L < 90 ? L : 90 )) $E --cpu-dtype $d --out /tmp/e2e_$d > /tmp/e2e_$d.txt 2>&1
  echo "== $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_llc_roofline|replay_token_agreement|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e_$d.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_$d.txt) $(grep -E "Error" /tmp/e2e_$d.txt | head -2)"
done | tee $OUT/e2e.txt
cat /tmp/e2e_*.txt > $OUT/e2e_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

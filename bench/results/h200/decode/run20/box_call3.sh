# run 20, call 3 (session 25): the GPU test files call 2 had no time for, on call 2's archive, in the ~150 s the
# session's device time still allowed (the planned prefill at 2048 / 8192 tokens was dropped for it).
# On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in tests/test_decode_fusions.py tests/test_replace_gpu.py tests/test_expert_deferral.py tests/test_gpt_oss_gpu.py \
         tests/test_deepseek_gpu.py tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py tests/test_l2_touch.py; do
  L=$(( 150 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
echo "# all done at $(( $(date +%s) - T0 )) s"

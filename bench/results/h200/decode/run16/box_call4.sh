# run 16, call 4 (in place of call 3, which three refused starts left too little device time for): at the session's
# final decode code (StepInputs: a step's inputs in one pinned copy), the step-input probe, every GPU test file
# (test_generate_gpu first: it checks graph decode, which StepInputs changed, against eager), then int4 end to end.
# On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
python3 -m bench.step_inputs_probe --out $OUT/step_inputs.json 2>&1 | tee $OUT/step_inputs.txt
for f in tests/test_generate_gpu.py tests/test_hybrid_gpu.py tests/test_replace_gpu.py tests/test_decode_fusions.py tests/test_expert_deferral.py tests/test_deepseek_gpu.py tests/test_gpt_oss_gpu.py tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py; do
  L=$(( 245 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 250 - ($(date +%s) - T0) ))
[ $L -gt 40 ] && timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu \
  --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4 --out /tmp/e2e > $OUT/e2e.txt 2>&1
echo "== int4 $(grep -oE "decode_b[18]_(tok_s|of_roofline|cpu_lane_GBps|replay_token_agreement)=[0-9.]+" $OUT/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" $OUT/e2e.txt) $(grep -E "Error" $OUT/e2e.txt | head -2)"
echo "# all done at $(( $(date +%s) - T0 )) s"

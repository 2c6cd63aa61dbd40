# run 17, call 2 (session 22): L2 warming (hybrid.gpu_kernels.prefetch / l2_warm: while a layer waits for its CPU
# lane, a side stream reads the next layer's q/k/v, o_proj and router weights into L2). The probe alone, the GPU
# tests that cover it, then end to end with HYBRID_L2_WARM=1 / 0 in turn (int4 and bf16, 12 layers, no expert
# resident, graphs), two rounds. On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.l2_prefetch_probe --out $OUT/l2_probe.json 2>&1 | grep -v Warn | tee $OUT/l2_probe.txt
for f in "tests/test_l2_warm.py" "tests/test_hybrid_gpu.py -k l2_warming" "tests/test_generate_gpu.py" "tests/test_decode_fusions.py"; do
  L=$(( 230 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename ${f%% *} .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A12 "^E  " /tmp/t_*.txt | head -40
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
for round in 1 2; do for dt in int4 bf16; do for w in 1 0; do
  L=$(( 570 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "$dt warm=$w round $round not run (time)"; continue; }
  HYBRID_L2_WARM=$w timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu \
    --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype $dt --out /tmp/e2e_${dt}_$w > /tmp/e2e_${dt}_${w}_$round.txt 2>&1
  echo "== $dt warm=$w round $round: $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|cpu_lane_share|replay_token_agreement)=[0-9.]+" /tmp/e2e_${dt}_${w}_$round.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_${dt}_${w}_$round.txt) $(grep -E "Error" /tmp/e2e_${dt}_${w}_$round.txt | head -2)"
done; done; done 2>&1 | tee $OUT/e2e_ab.txt
cat /tmp/e2e_*_1.txt /tmp/e2e_*_2.txt > $OUT/e2e_logs.txt 2>/dev/null
echo "# all done at $(( $(date +%s) - T0 )) s"

# run 16, call 1 (prepared in session 20, not yet run): int4 at 3-4 tokens per expert in one 4-row pass with the fp32
# sums in memory (hy_tune("i4_wide") 2) against token pairs (1) and the 2-row passes (0, still the default): the
# kernel alone in 3 rounds per case, forward and backward in turn, then end to end in one process (hybrid_e2e --ab,
# 6 rounds), int4 batch 1 and 8, then the captured decode floor with the CPU executor's own busy time per layer.
# On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m bench.decode_probe --dtypes int4 --cases 1x8,3x8same,4x8same,8x8 --iters 30 \
  --variants fused,fused+i4_wide=2,fused+i4_wide=1 --rounds 3 \
  --out $OUT/probe.json 2>&1 | grep -v Warn | tee $OUT/probe.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 420 - ($(date +%s) - T0) ))
timeout $(( L < 170 ? L : 170 )) python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu \
  --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4 --ab i4_wide=2/0 --ab-rounds 6 --out /tmp/e2e > $OUT/e2e.txt 2>&1
echo "== int4 --ab i4_wide=2/0 $(grep -oE "decode_b[18]_(tok_s|of_roofline|cpu_lane_GBps)=[0-9.]+" $OUT/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" $OUT/e2e.txt) $(grep -E "Error" $OUT/e2e.txt | head -2)"
grep "^# A/B" $OUT/e2e.txt
echo "# e2e done at $(( $(date +%s) - T0 )) s"
for b in 1 8; do
  L=$(( 580 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "timeline batch $b not run (time)"; continue; }
  timeout $(( L < 80 ? L : 80 )) python3 -m bench.decode_timeline --resident none --layers 2,8 --batch $b \
    --out $OUT/timeline_b$b.json 2>&1 | grep -v Warn | tee -a $OUT/timeline.txt | grep -E "^# (batch|experts|profiled|idle|CPU)"
done
echo "# all done at $(( $(date +%s) - T0 )) s"

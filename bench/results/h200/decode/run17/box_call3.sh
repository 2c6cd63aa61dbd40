# run 17, call 3 (session 22): call 2's probe found the L2 touch bought the projections nothing (13.51 vs 13.53 us
# per layer at batch 1) while bf16 end to end differed by 20% between HYBRID_L2_WARM=1 and 0, always in the same
# order (1 then 0). Here: the probe with a "hot" way (the projections run twice, the second timed: what L2 can give
# at most), then bf16 with the order reversed (0 then 1), to tell the warming from the order of the processes.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.l2_prefetch_probe --batch 1 --out $OUT/l2_probe.json 2>&1 | grep -v Warn | tee $OUT/l2_probe.txt
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
for w in 0 1 0; do
  L=$(( 330 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "bf16 warm=$w not run (time)"; continue; }
  HYBRID_L2_WARM=$w timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu \
    --prefill 128 --decode-batch 1 --steps 24 --cpu-dtype bf16 --out /tmp/e2e_$w > /tmp/e2e_$w.txt 2>&1
  echo "== bf16 warm=$w: $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e_$w.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_$w.txt) $(grep -E "Error" /tmp/e2e_$w.txt | head -2)"
done 2>&1 | tee $OUT/e2e_order.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

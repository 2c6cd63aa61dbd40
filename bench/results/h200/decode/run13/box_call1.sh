# run 13, call 1 (session 18): on a clean `git archive HEAD` (.boxcmd/src.tgz)
#  - int4 order A/B repeated: interleaved vs natural, groups of 128, cases 1x8 / 4x8same / 8x8 three times each in
#    one process (run 12 call 1 had one run: +11% at 4x8same, 2-7% behind at 1x8 and 8x8);
#  - end to end int4 at batch 1 and 8 in each order (HYBRID_INT4_ORDER), the DRAM ceiling measured in each run;
#  - prefill 2048/8192 twice (run 11 call 2: -6% at 2048 once).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
C=1x8,4x8same,8x8
timeout 150 python3 -m bench.decode_probe --dtypes int4,int4-natural --group 128 --cases 2x8same,$C,$C,$C \
  --variants fused --iters 30 --out $OUT/probe_int4_order.json 2>&1 | grep -v Warn | tee $OUT/probe_int4_order.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4"
for o in interleaved natural interleaved; do
  L=$(( 400 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "e2e $o not run (time)"; continue; }
  HYBRID_INT4_ORDER=$o timeout $(( L < 85 ? L : 85 )) $E --out /tmp/e2e_$o > /tmp/e2e_$o.txt 2>&1
  echo "== $o $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|dram_after_GBps|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e_$o.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_$o.txt) $(grep -E "Error" /tmp/e2e_$o.txt | head -2)"
  cat /tmp/e2e_$o.txt >> $OUT/e2e_int4_logs.txt
done | tee $OUT/e2e_int4.txt
for i in 1 2; do
  L=$(( 580 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "prefill $i not run (time)"; continue; }
  timeout $(( L < 75 ? L : 75 )) python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost \
    --prefill 2048,8192 --decode-batch 1 --steps 2 > /tmp/prefill_$i.txt 2>&1
  echo "prefill $i $(grep -oE "prefill_[0-9]+_tok_s=[0-9.]+" /tmp/prefill_$i.txt | tr '\n' ' ') $(grep Error /tmp/prefill_$i.txt | head -1)"
done | tee $OUT/prefill.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

# run 13, call 3 (session 18): the vector kernels' prefetch lead (hy_tune pf_rows: rows ahead into L2, default 8)
# on a clean `git archive HEAD`: the kernel alone (pool past the LLC, bf16 / int8 / int4, 8, 16 and 32 rows
# ahead, cases twice), then e2e int4 and int8 at batch 1 and 8 with pf_rows 8 and 16 alternating, then the
# captured decode floor's GPU timeline (what a layer's fixed part is now).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
C=1x8,4x8same,8x8
timeout 170 python3 -m bench.decode_probe --dtypes int4,int8,bf16 --cases $C,$C --variants fused,fused+pf_rows=16,fused+pf_rows=32 \
  --iters 30 --out $OUT/probe_pf_rows.json 2>&1 | grep -v Warn | tee $OUT/probe_pf_rows.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for run in "int4 8" "int4 16" "int8 8" "int8 16"; do
  set -- $run
  L=$(( 520 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "e2e $1 pf_rows=$2 not run (time)"; continue; }
  timeout $(( L < 85 ? L : 85 )) $E --cpu-dtype $1 --tune pf_rows=$2 --out /tmp/e2e > /tmp/e2e.txt 2>&1
  echo "== $1 pf_rows=$2 $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|dram_after_GBps|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e.txt) $(grep -E "Error" /tmp/e2e.txt | head -2)"
  cat /tmp/e2e.txt >> $OUT/e2e_logs.txt
done | tee $OUT/e2e_pf_rows.txt
L=$(( 585 - ($(date +%s) - T0) ))
[ $L -ge 40 ] && timeout $L python3 -m bench.decode_timeline --resident none --layers 2,8 --out $OUT/timeline.json > $OUT/timeline.txt 2>&1
tail -40 $OUT/timeline.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

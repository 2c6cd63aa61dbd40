# run 13, call 4 (session 18): pf_rows 8 against 16 again, now for the int8/int4 kernels only (bf16 keeps 8 rows),
# on a clean `git archive HEAD`: the kernel alone three times per case, then e2e int4 / int8 at batch 1 and 8 in
# the order int4 8, int4 16, int8 16, int8 8 (so that a drifting host moves both settings alike).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
C=1x8,2x8same,8x8
timeout 120 python3 -m bench.decode_probe --dtypes int4,int8 --cases $C,$C,$C --variants fused,fused+pf_rows=16 \
  --iters 30 --out $OUT/probe_pf_rows.json 2>&1 | grep -v Warn | tee $OUT/probe_pf_rows.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for run in "int4 8" "int4 16" "int8 16" "int8 8"; do
  set -- $run
  L=$(( 390 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "e2e $1 pf_rows=$2 not run (time)"; continue; }
  timeout $(( L < 85 ? L : 85 )) $E --cpu-dtype $1 --tune pf_rows=$2 --out /tmp/e2e > /tmp/e2e.txt 2>&1
  echo "== $1 pf_rows=$2 $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|dram_after_GBps|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e.txt) $(grep -E "Error" /tmp/e2e.txt | head -2)"
  cat /tmp/e2e.txt >> $OUT/e2e_logs.txt
done | tee $OUT/e2e_pf_rows.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

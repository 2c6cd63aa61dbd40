# run 14, call 2 (session 19): decode tasks sized by bytes (hy_tune("byte_tasks"): int8 tasks 2x, int4 4x the rows
# of bf16's, so each reads the same bytes) against the same rows for every dtype, and task_min=1, on a clean
# `git archive HEAD`: the kernel alone (pool past the LLC) twice per case, then e2e int4 at batch 1 and 8 with
# byte_tasks 1 and 0 (then int8 1 if time is left).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
C=1x8,4x8same,8x8
timeout 230 python3 -m bench.decode_probe --dtypes int4,int8 --cases $C,$C --iters 30 \
  --variants fused,fused+byte_tasks=1,fused+task_min=1,fused+byte_tasks=1+task_min=1 \
  --out $OUT/probe_byte_tasks.json 2>&1 | grep -v Warn | tee $OUT/probe_byte_tasks.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for run in "int4 1" "int4 0" "int8 1"; do
  set -- $run
  L=$(( 560 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "e2e $1 byte_tasks=$2 not run (time)"; continue; }
  timeout $(( L < 95 ? L : 95 )) $E --cpu-dtype $1 --tune byte_tasks=$2 --out /tmp/e2e > /tmp/e2e.txt 2>&1
  echo "== $1 byte_tasks=$2 $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|dram_after_GBps|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e.txt) $(grep -E "Error" /tmp/e2e.txt | head -2)"
  cat /tmp/e2e.txt >> $OUT/e2e_logs.txt
done | tee $OUT/e2e_byte_tasks.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

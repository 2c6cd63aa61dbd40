# run 14, call 3 (session 19): call 2 ran its variants in one order per case and the later ones read faster even
# where the settings were the same (8 x 8: task_min 1 and 2 give the same tasks there), so this call runs them
# A B C C B A: A = defaults, B = task_min=1, C = byte_tasks=1 (each second copy names a default knob so the
# variants stay distinct); then e2e int4 at batch 1 and 8 in the order A B C C B A.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m bench.decode_probe --dtypes int4,int8 --cases 1x8,4x8same,8x8 --iters 30 \
  --variants fused,fused+task_min=1,fused+byte_tasks=1,fused+byte_tasks=1+task_rows=256,fused+task_min=1+task_rows=256,fused+task_min=2 \
  --out $OUT/probe_abccba.json 2>&1 | grep -v Warn | tee $OUT/probe_abccba.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4"
for kv in task_min=2 task_min=1 byte_tasks=1 byte_tasks=1 task_min=1 task_min=2; do
  L=$(( 470 - ($(date +%s) - T0) )); [ $L -lt 55 ] && { echo "e2e $kv not run (time)"; continue; }
  timeout $(( L < 90 ? L : 90 )) $E --tune $kv --out /tmp/e2e > /tmp/e2e.txt 2>&1
  echo "== int4 $kv $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|dram_after_GBps|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e.txt) $(grep -E "Error" /tmp/e2e.txt | head -2)"
  cat /tmp/e2e.txt >> $OUT/e2e_logs.txt
done | tee $OUT/e2e_abccba.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

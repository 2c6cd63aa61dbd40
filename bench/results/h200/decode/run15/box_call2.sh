# run 15, call 2 (prepared in session 19; cut to ~470 s in session 20, when call 1 had left 1136 s of device time):
# the two leads run 14 left, with repeats in an order that cancels drift: byte-sized decode tasks
# (hy_tune("byte_tasks")) for int4 batch 8, and int4's L1 prefetch at 3-4 tokens (hy_tune("pf_l1")). Kernel alone,
# int4, 2 rounds per case, forward and backward in turn (decode_probe --rounds), then e2e in-process A/Bs
# (hybrid_e2e --ab, 6 rounds forward and backward in turn, one build each): int4 byte_tasks, int4 pf_l1.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 130 python3 -m bench.decode_probe --dtypes int4 --cases 1x8,4x8same,8x8,3x8same --iters 30 \
  --variants fused,fused+byte_tasks=1,fused+pf_l1=1 --rounds 2 \
  --out $OUT/probe.json 2>&1 | grep -v Warn | tee $OUT/probe.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --ab-rounds 6"
for run in "int4 byte_tasks=0/1" "int4 pf_l1=0/1"; do
  set -- $run
  L=$(( 465 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "e2e $1 --ab $2 not run (time)"; continue; }
  timeout $(( L < 150 ? L : 150 )) $E --cpu-dtype $1 --ab $2 --out /tmp/e2e > /tmp/e2e.txt 2>&1
  echo "== $1 --ab $2 $(grep -oE "decode_b[18]_(tok_s|of_roofline|cpu_lane_GBps)=[0-9.]+" /tmp/e2e.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e.txt) $(grep -E "Error" /tmp/e2e.txt | head -2)"
  grep "^# A/B" /tmp/e2e.txt
  cat /tmp/e2e.txt >> $OUT/e2e_logs.txt
done | tee $OUT/e2e_ab.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

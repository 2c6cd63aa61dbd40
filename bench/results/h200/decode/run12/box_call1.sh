# run 12, call 1 (prepared in sessions 16-17, not yet run): time what sessions 16 and 17 added after their
# device time, on a clean `git archive HEAD` (.boxcmd/src.tgz):
#  - int4's group-interleaved stored order (session 17, the default) against the natural one, groups of 128 and 32
#    (session 16's i4_pairs kernel is gone: the interleaved order removes the per-group converts it halved);
#  - int4 on AMX against its vector path (bench.cpu_moe's knee sweep; the AMX path is off without a measured knee);
#  - e2e int4 at batch 1 and 8 (with the DRAM ceiling measured again after each batch);
#  - prefill 2048/8192 twice (session 16 measured -6% at 2048 once).
# The GPU test files go in a second call (box_call2.sh pattern of run 11 call 4).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for g in 128 32; do
  timeout 75 python3 -m bench.decode_probe --dtypes int4,int4-natural --group $g --cases 1x8,2x8same,3x8same,4x8same,8x8 \
    --variants fused --iters 30 --out $OUT/probe_int4_order_g$g.json 2>&1 | grep -v Warn | tee $OUT/probe_int4_order_g$g.txt
done
echo "# probe done at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m bench.cpu_moe --shapes qwen3-30b-a3b --dtypes int4 --decode 8x1,8x4 --prefill 8x256,8x1024 \
  --knee-sweep 4,8,16,32,64 --scaling '' --out $OUT/cpu_moe_int4.json 2>&1 | grep -v Warn | tee $OUT/cpu_moe_int4.txt
echo "# cpu_moe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 420 - ($(date +%s) - T0) ))
timeout $(( L < 90 ? L : 90 )) python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu \
  --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4 --out /tmp/e2e_int4 > $OUT/e2e_int4.txt 2>&1
grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|dram_after_GBps|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" $OUT/e2e_int4.txt | tr '\n' ' '; echo
for i in 1 2; do
  L=$(( 585 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "prefill $i not run (time)"; continue; }
  timeout $(( L < 75 ? L : 75 )) python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost \
    --prefill 2048,8192 --decode-batch 1 --steps 2 > /tmp/prefill_$i.txt 2>&1
  echo "prefill $i $(grep -oE "prefill_[0-9]+_tok_s=[0-9.]+" /tmp/prefill_$i.txt | tr '\n' ' ') $(grep Error /tmp/prefill_$i.txt | head -1)"
done | tee $OUT/prefill.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

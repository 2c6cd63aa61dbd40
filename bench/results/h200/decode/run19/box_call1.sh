# run 19, call 1 (prepared in session 23, not yet run): where batch 8 loses. Session 23 found batch 8's expert
# reads 80% one token per expert (run18 call 4) and the kernels at 1-2 tokens with 1.6-2.2x of headroom over DRAM
# (run18 call 3), yet int4's batch-8 lane read 103 GB/s of a 130-145 GB/s ceiling. Same process order as the
# suspects: the kernel alone at batch-8-like routing (8 tokens x 8 random experts of a pool past the LLC: ~60
# experts, nearly all one token) against the e2e lane at batch 8 in the next process, twice, interleaved; if the
# lane reads well below the kernel alone at the same routing, the loss is in the lane (job start/finish, the GPU's
# traffic into host memory beside it), not in the kernel. On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
for i in 0 1; do
  L=$(( 560 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "round $i not run (time)"; continue; }
  timeout $(( L < 120 ? L : 120 )) python3 -m bench.decode_probe --dtypes int4,int8 --cases 1x8,8x8 --iters 30 \
    --variants fused --rounds 2 --out $OUT/probe_$i.json > $OUT/probe_$i.txt 2>&1
  echo "## probe $i"; grep -E "ceiling|^int[48] " $OUT/probe_$i.txt | tail -6
  for dt in int4 int8; do
    L=$(( 560 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "e2e $dt $i not run (time)"; continue; }
    timeout $(( L < 120 ? L : 120 )) python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs \
      --strategies cpu --prefill 128 --decode-batch 8 --steps 24 --cpu-dtype $dt --out /tmp/e2e_${dt}_$i > /tmp/e2e_${dt}_$i.txt 2>&1
    cp /tmp/e2e_${dt}_$i/*.json $OUT/e2e_${dt}_$i.json 2>/dev/null
    echo "== e2e $dt $i: $(grep -oE "decode_b8_(tok_s|of_roofline|cpu_lane_share|cpu_lane_GBps|dram_after_GBps)=[0-9.]+" /tmp/e2e_${dt}_$i.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_${dt}_$i.txt) $(grep -E "Error" /tmp/e2e_${dt}_$i.txt | head -2)"
  done
done 2>&1 | tee $OUT/summary.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

# run 11, call 2: the new decode-task defaults (256 rows, >= 2 per thread, pf_first, 2 MiB pages) against
# neighbours in one process (decode_probe, pool past the LLC); e2e int4/int8 at batch 1 and 8; prefill 2048/8192
# with 2 MiB pages vs 4 KiB (HYBRID_HUGEPAGES=1/0); a clean `git archive HEAD`
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
V=fused,fused+pf_first=0,fused+task_rows=128,fused+task_rows=512,fused+task_min=1,fused+task_min=4,small-tasks
timeout 170 python3 -m bench.decode_probe --dtypes bf16,int8,int4 --cases 1x8,4x8same,8x8 --variants $V --iters 30 --out $OUT/probe.json 2>&1 | grep -v Warn | tee $OUT/probe.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for d in int4 int8; do
  L=$(( 420 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "$d not run (time)"; continue; }
  timeout $(( L < 90 ? L : 90 )) $E --cpu-dtype $d --out /tmp/e2e_$d > /tmp/e2e_$d.txt 2>&1
  echo "== $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_llc_roofline|replay_token_agreement|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e_$d.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_$d.txt) $(grep -E "Error" /tmp/e2e_$d.txt | head -2)"
done | tee $OUT/e2e.txt
cat /tmp/e2e_*.txt > $OUT/e2e_logs.txt
for h in 1 0; do
  L=$(( 585 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "prefill thp$h not run (time)"; continue; }
  HYBRID_HUGEPAGES=$h timeout $(( L < 80 ? L : 80 )) python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2 > /tmp/prefill_$h.txt 2>&1
  echo "prefill thp$h $(grep -oE "prefill_[0-9]+_tok_s=[0-9.]+" /tmp/prefill_$h.txt | tr '\n' ' ') $(grep Error /tmp/prefill_$h.txt | head -1)"
done | tee $OUT/prefill.txt
cat /tmp/prefill_*.txt > $OUT/prefill_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

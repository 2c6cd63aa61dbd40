# run 10, call 2: the bf16/int8 vector kernels' prefetch (a = 6083777: one block ahead into L1; b = 81dfe59: two
# blocks ahead into L2) interleaved in one call: the CPU kernel alone with a pool well past the LLC (384 experts),
# e2e bf16 / int8 at batch 1 and 8; int4 thread scaling at 8x8 (compute- or bandwidth-bound?); the host's topology
export PYTHONUNBUFFERED=1
T0=$(date +%s)
lscpu > $OUT/lscpu.txt; grep -E "^(Model name|Thread|Core|Socket|L2|L3|NUMA node0)" $OUT/lscpu.txt
for t in a b; do mkdir -p /tmp/$t && tar xzf .boxcmd/src_$t.tgz -C /tmp/$t; done
(cd /tmp/a && python3 setup.py build_ext --inplace > /tmp/build_a.txt 2>&1) & ba=$!
cd /tmp/b && python3 setup.py build_ext --inplace > /tmp/build_b.txt 2>&1 || { tail -30 /tmp/build_b.txt; exit 1; }
wait $ba || { tail -30 /tmp/build_a.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for t in a b; do
  (cd /tmp/$t && timeout 100 python3 -m bench.decode_probe --dtypes bf16,int8 --experts 384 --cases 1x8,4x8same,8x8 --variants fused --iters 40 2>&1 | grep -v Warn | sed "s/^/$t /")
done | tee $OUT/probe_ab.txt
echo "# probes done at $(( $(date +%s) - T0 )) s"
for n in 4 8 15; do
  (cd /tmp/b && timeout 60 python3 -m bench.decode_probe --dtypes int4 --experts 512 --cases 1x8,8x8 --variants fused --iters 30 --threads $n 2>&1 | grep -v Warn | sed "s/^/thr$n /")
done | tee $OUT/int4_threads.txt
echo "# thread scaling done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for v in a:int8 b:int8 a:bf16 b:bf16; do
  t=${v%%:*}; d=${v##*:}
  L=$(( 585 - ($(date +%s) - T0) )); [ $L -lt 30 ] && { echo "$v not run (time)"; continue; }
  (cd /tmp/$t && timeout $(( L < 85 ? L : 85 )) $E --cpu-dtype $d --out /tmp/e2e_${t}_$d > /tmp/e2e_${t}_$d.txt 2>&1)
  echo "== $t $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement|cpu_lane_share|cpu_lane_GBps|cold_reused_from_last_step)=[0-9.]+" /tmp/e2e_${t}_$d.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_${t}_$d.txt) $(grep -E "Error" /tmp/e2e_${t}_$d.txt | head -2)"
done | tee $OUT/e2e_ab.txt
cat /tmp/e2e_*_*.txt > $OUT/e2e_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

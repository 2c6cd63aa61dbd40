# run 11, call 1: is the CPU kernel's per-thread DRAM read rate the page size or the task starts?
# decode_probe (pool past the LLC) with 4 KiB vs 2 MiB pages (HYBRID_HUGEPAGES=0/1; the DRAM probe follows the
# same policy) x variants fused / fused-pf1 / fused-big / fused-pf1-big; then e2e int4/int8 with and without
export PYTHONUNBUFFERED=1
T0=$(date +%s)
lscpu > $OUT/lscpu.txt; grep -E "^(Model name|L3)" $OUT/lscpu.txt
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)" | tee $OUT/thp.txt
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for h in 0 1; do
  HYBRID_HUGEPAGES=$h timeout 150 python3 -m bench.decode_probe --dtypes bf16,int8,int4 --cases 1x8,4x8same,8x8 --variants fused,fused-pf1,fused-big,fused-pf1-big --iters 30 --out $OUT/probe_thp$h.json 2>&1 | grep -v Warn | sed "s/^/thp$h /"
  grep AnonHugePages /proc/meminfo
done | tee $OUT/probe.txt
echo "# probes done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for v in 1:int4 0:int4 1:int8 0:int8; do
  h=${v%%:*}; d=${v##*:}
  L=$(( 585 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "$v not run (time)"; continue; }
  HYBRID_HUGEPAGES=$h timeout $(( L < 90 ? L : 90 )) $E --cpu-dtype $d --out /tmp/e2e_${h}_$d > /tmp/e2e_${h}_$d.txt 2>&1
  echo "== thp$h $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement|cpu_lane_share|cpu_lane_GBps)=[0-9.]+" /tmp/e2e_${h}_$d.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_${h}_$d.txt) $(grep -E "Error" /tmp/e2e_${h}_$d.txt | head -2)"
done | tee $OUT/e2e.txt
cat /tmp/e2e_*_*.txt > $OUT/e2e_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

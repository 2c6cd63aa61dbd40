# run 15, call 3 (prepared in session 19, not yet run): where batch 8's serial part goes. In run 14 call 1 an int4
# batch-8 step spent 94 us per layer outside the CPU lane where batch 1 spent 63 (arithmetic from its e2e fields:
# (decode_b8_ms - cpu_lane_ms_per_step) / 12 = (13.98 - 12.85) / 12, (2.43 - 1.68) / 12); the floor model at batch 1 and 8
# (bench.decode_timeline --batch: per-layer slope, GPU kernels per layer, idle gaps), every expert on the CPU lane.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
i=0
for b in 1 8 1 8; do
  i=$((i + 1))
  L=$(( 400 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "timeline batch $b not run (time)"; continue; }
  timeout $(( L < 120 ? L : 120 )) python3 -m bench.decode_timeline --resident none --layers 2,8 --batch $b \
    --out $OUT/timeline_${i}_b$b.json 2>&1 | grep -v Warn | tee -a $OUT/timeline.txt | grep -E "^# (batch|experts|profiled|idle)"
done
echo "# all done at $(( $(date +%s) - T0 )) s"

# run 19, call 2 (prepared in session 23, not yet run): the router-norm fold A/B'd in one process, which run 18
# could not do (one process per setting; batch 8 read slower with the fold in four pairs, inside the host's drift):
# bench.hybrid_e2e --ab env:HYBRID_ROUTER_NORM=0/1 captures each value's own graphs and runs the values forward and
# backward in turn over the same prompts. int4 (the shortest step, where 0.7 us per layer weighs most) then bf16.
# On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
for dt in int4 bf16; do
  L=$(( 570 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "$dt not run (time)"; continue; }
  timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 \
    --decode-batch 1,8 --steps 24 --cpu-dtype $dt --ab env:HYBRID_ROUTER_NORM=0/1 --ab-rounds 6 --out /tmp/e2e_$dt \
    > $OUT/e2e_ab_$dt.txt 2>&1
  cp /tmp/e2e_$dt/*.json $OUT/e2e_ab_$dt.json 2>/dev/null
  echo "== $dt"; grep -E "^# A/B|Error" $OUT/e2e_ab_$dt.txt
done
echo "# all done at $(( $(date +%s) - T0 )) s"

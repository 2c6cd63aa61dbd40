# run 20, call 1 (session 25): the token rows' quantization as the fused phase's first tasks (fused_prep, new in
# d865bd7, default 1) against the separate phase 0 (fused_prep=0): AVX-512/AMX tests of the changed kernels, the
# kernel alone (both values in each round, forward and backward), then end to end in one process (hybrid_e2e --ab,
# 6 rounds, int4 batch 1 and 8). Then run 19 call 2's router-norm fold A/B (env:HYBRID_ROUTER_NORM=0/1), int4.
# On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
python3 -c "import cpu_kernels; print('isas', cpu_kernels.available_isas())"
timeout 90 python3 -m pytest -q tests/test_cpu_activation.py tests/test_cpu_decode_path.py > $OUT/cpu_tests.txt 2>&1; tail -2 $OUT/cpu_tests.txt
grep -B2 -A12 "^E  " $OUT/cpu_tests.txt | head -30
echo "# tests done at $(( $(date +%s) - T0 )) s"
timeout 130 python3 -m bench.decode_probe --dtypes int4,int8 --cases 1x8,8x8 --iters 30 \
  --variants fused,fused+fused_prep=0 --rounds 2 --out $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "ceiling|^# medians|^int[48] " $OUT/probe.txt | tail -12
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4 --ab-rounds 6"
L=$(( 400 - ($(date +%s) - T0) ))
timeout $(( L < 180 ? L : 180 )) $E --ab fused_prep=0/1 --out /tmp/e2e_prep > $OUT/e2e_ab_prep.txt 2>&1
cp /tmp/e2e_prep/*.json $OUT/e2e_ab_prep.json 2>/dev/null
grep -E "DRAM read|^# A/B|Error" $OUT/e2e_ab_prep.txt
echo "# e2e prep done at $(( $(date +%s) - T0 )) s"
L=$(( 575 - ($(date +%s) - T0) ))
[ $L -gt 90 ] && timeout $L $E --ab env:HYBRID_ROUTER_NORM=0/1 --out /tmp/e2e_norm > $OUT/e2e_ab_norm.txt 2>&1
cp /tmp/e2e_norm/*.json $OUT/e2e_ab_norm.json 2>/dev/null
grep -E "DRAM read|^# A/B|Error" $OUT/e2e_ab_norm.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

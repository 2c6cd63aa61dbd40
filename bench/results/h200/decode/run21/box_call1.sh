# run 21, call 1 (session 26): greedy decode queued one step ahead (graphs feed their own next inputs; new in
# 2e3d44c). The GPU test file of it, then end to end in one process: the same steps timed one by one between host
# syncs (ahead=0, the measurement of every earlier call) and queued one ahead (1, how generation now runs them),
# 6 rounds forward and backward, int4 at batch 1 and 8, then bf16 at batch 1. On a clean `git archive HEAD`.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 100 python3 -m pytest -q tests/test_generate_gpu.py > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
grep -B2 -A20 "^E  " $OUT/gpu_tests.txt | head -40
echo "# tests done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --steps 24 --ab ahead=0/1"
timeout 230 $E --cpu-dtype int4 --decode-batch 1,8 --ab-rounds 6 --out /tmp/e2e_i4 > $OUT/e2e_ab_int4.txt 2>&1
cp /tmp/e2e_i4/*.json $OUT/e2e_ab_int4.json 2>/dev/null
grep -E "DRAM read|^# A/B|Error|error" $OUT/e2e_ab_int4.txt | head
echo "# int4 done at $(( $(date +%s) - T0 )) s"
L=$(( 570 - ($(date +%s) - T0) ))
[ $L -gt 90 ] && timeout $L $E --cpu-dtype bf16 --decode-batch 1 --ab-rounds 4 --out /tmp/e2e_bf > $OUT/e2e_ab_bf16.txt 2>&1
cp /tmp/e2e_bf/*.json $OUT/e2e_ab_bf16.json 2>/dev/null
grep -E "DRAM read|^# A/B|Error|error" $OUT/e2e_ab_bf16.txt | head
echo "# all done at $(( $(date +%s) - T0 )) s"

# run 10, call 1: where batch-8 int8/int4 and batch-1 int4 lose against their rooflines: the CPU kernel alone
# (bench.decode_probe) at decode routings, e2e with the CPU lane's own busy time per step (cpu_lane_* fields),
# and the GPU test file with the strengthened in-place lane-input check; a clean `git archive HEAD`
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.decode_probe --dtypes bf16,int8,int4 --cases 1x8,4x8same,8x8 --variants fused --out $OUT/decode_probe.json 2>&1 | grep -v Warn | tee $OUT/decode_probe.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for d in int4 int8 bf16; do
  L=$(( 480 - ($(date +%s) - T0) )); [ $L -lt 30 ] && { echo "$d not run (time)"; continue; }
  timeout $(( L < 90 ? L : 90 )) $E --cpu-dtype $d --out /tmp/e2e_$d > /tmp/e2e_$d.txt 2>&1
  echo "== $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement|cpu_lane_ms_per_step|cpu_lane_share|cpu_lane_GBps|ms|cold_experts_per_layer_step)=[0-9.]+" /tmp/e2e_$d.txt | tr '\n' ' ') $(grep -E "measured now" /tmp/e2e_$d.txt) $(grep -E "Error" /tmp/e2e_$d.txt | head -2)"
done | tee $OUT/e2e.txt
cat /tmp/e2e_*.txt > $OUT/e2e_logs.txt
echo "# e2e done at $(( $(date +%s) - T0 )) s"
L=$(( 580 - ($(date +%s) - T0) ))
timeout $L python3 -m pytest -q tests/test_hybrid_gpu.py > /tmp/t_hy.txt 2>&1; echo "test_hybrid_gpu $(tail -1 /tmp/t_hy.txt)" | tee $OUT/gpu_tests.txt
grep -h -B5 -A20 "^E  " /tmp/t_hy.txt | head -40
echo "# all done at $(( $(date +%s) - T0 )) s"

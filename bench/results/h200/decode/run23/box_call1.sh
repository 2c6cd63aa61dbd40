# run 23, call 1 (session 28): the AVX-512 kernels' transposing block sums (hsum, new, default 1) and the cut tail
# tasks (tail_split, new, default 1) on the box: the CPU kernel tests of the changed code (AVX-512 + AMX), the kernel
# alone with every variant in each round (forward and backward), then hsum end to end in one process (int4 and bf16,
# batch 1 and 8). Built in place from the call's copy of the tree.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
python3 -c "import cpu_kernels; print('isas', cpu_kernels.available_isas())"
timeout 150 python3 -m pytest -q tests/test_cpu_decode_path.py tests/test_cpu_moe.py tests/test_cpu_int4_order.py \
  tests/test_cpu_int4_amx.py > $OUT/cpu_tests.txt 2>&1; tail -2 $OUT/cpu_tests.txt
grep -B2 -A12 "^E  " $OUT/cpu_tests.txt | head -30
echo "# tests done at $(( $(date +%s) - T0 )) s"
timeout 240 python3 -m bench.decode_probe --dtypes bf16,int8,int4 --cases 1x8,4x8same --iters 30 \
  --variants fused+hsum=0,fused,fused+tail_split=2,fused+tail_split=4 --rounds 3 --out $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "ceiling|^# medians" $OUT/probe.txt; sed -n '/^# medians/,$p' $OUT/probe.txt | tail -25
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24 --ab-rounds 4"
for dt in int4 bf16; do
  L=$(( 570 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "e2e $dt not run (time)"; continue; }
  timeout $(( L < 170 ? L : 170 )) $E --cpu-dtype $dt --ab hsum=0/1 --out /tmp/e2e_$dt > $OUT/e2e_ab_$dt.txt 2>&1
  grep -E "DRAM read|^# A/B|Error" $OUT/e2e_ab_$dt.txt
  echo "# e2e $dt done at $(( $(date +%s) - T0 )) s"
done
cd /tmp && cat e2e_int4/*.json > $OUT/e2e_ab.json 2>/dev/null; cat e2e_bf16/*.json >> $OUT/e2e_ab.json 2>/dev/null
echo "# all done at $(( $(date +%s) - T0 )) s"

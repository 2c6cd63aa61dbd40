# run 24, call 1 (for the session after 28): what issue 12 still needs at this code, in one call. Every GPU test file
# at tail_split 4 (the default since 2729cde; run 23 call 2 ran them at tail_split 1) while llama.cpp builds (the
# tests time nothing), then the seventeenth side by side (targets 1-4), then target 5's kernel-alone command.
# Run with carry [".peer"] (the peer files copied from ../shared/peers, ignored by .git/info/exclude). Built in place.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
LB=/tmp/lcpp
(bash .peer/build_llama_bench.sh $LB > /tmp/llama_build.txt 2>&1) & bp=$!
for _ in $(seq 60); do [ -d "$LB/src/llama.cpp/gguf-py" ] && break; sleep 1; done
(PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3.gguf --layers 12 && PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3q8.gguf --layers 12 --experts-type q8_0) > /tmp/gguf.txt 2>&1 & gp=$!
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
for f in tests/test_hybrid_gpu.py tests/test_generate_gpu.py tests/test_decode_fusions.py tests/test_expert_deferral.py \
         tests/test_replace_gpu.py tests/test_deepseek_gpu.py tests/test_gpt_oss_gpu.py tests/test_l2_touch.py \
         tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py; do
  L=$(( 260 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
wait $bp || { tail -20 /tmp/llama_build.txt; exit 1; }
wait $gp || { tail -20 /tmp/gguf.txt; exit 1; }
echo "# llama built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 540 - ($(date +%s) - T0) ))
timeout $L python3 -m bench.vs_llamacpp --llama-bench $LB/bin/llama-bench --gguf-bf16 /tmp/q3.gguf --gguf-q8 /tmp/q3q8.gguf --profile $P --cases bf16,int8,quarter,int4 --out $OUT/vs > $OUT/vs_llamacpp.txt 2>&1
echo "rc=$?"; grep -E "^(bf16|int8|quarter|int4) " $OUT/vs_llamacpp.txt; grep -E "Error" $OUT/vs_llamacpp.txt | head -3
python3 -m bench.vs_llamacpp --summarize $OUT/vs/vs_llamacpp.json 2>&1 | tail -3
echo "# vs done at $(( $(date +%s) - T0 )) s"
L=$(( 590 - ($(date +%s) - T0) ))
[ $L -gt 40 ] && timeout $L python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 --variants fused \
  --rounds 3 --out $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "ceiling" $OUT/probe.txt; sed -n '/^# medians/,$p' $OUT/probe.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

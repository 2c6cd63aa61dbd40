# run 15, call 4 (session 20): the tenth side by side with llama.cpp, at the same HEAD as call 1 (the ninth), with
# the two GPU test files call 1 ran out of time for (test_gpu_kernels_gemv, test_gpu_kernels) while llama.cpp builds.
# Call 1 missed the quarter ratio (1.13x); this is a second sample of the same code on another host draw. The first
# try of this call lost its machine mid-run (181 s of device time gone), so it runs bf16 and quarter only (no Q8_0 GGUF).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cp -r .peer /tmp/src/.peer && cd /tmp/src
LB=/tmp/lcpp
(bash .peer/build_llama_bench.sh $LB > /tmp/llama_build.txt 2>&1) & bp=$!
for _ in $(seq 60); do [ -d "$LB/src/llama.cpp/gguf-py" ] && break; sleep 1; done
(PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3.gguf --layers 12) > /tmp/gguf.txt 2>&1 & gp=$!
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
for f in tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py; do
  L=$(( 200 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
echo "# tests done at $(( $(date +%s) - T0 )) s"
wait $bp || { tail -20 /tmp/llama_build.txt; exit 1; }
wait $gp || { tail -20 /tmp/gguf.txt; exit 1; }
echo "# llama built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 400 - ($(date +%s) - T0) ))
timeout $L python3 -m bench.vs_llamacpp --llama-bench $LB/bin/llama-bench --gguf-bf16 /tmp/q3.gguf --cases bf16,quarter --profile $P --out $OUT/vs > $OUT/vs_llamacpp.txt 2>&1
echo "rc=$?"; grep -E "^(bf16|int8|quarter|int4) |^\|" $OUT/vs_llamacpp.txt; grep -E "Error" $OUT/vs_llamacpp.txt | head -3
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt; cat /tmp/build.txt /tmp/gguf.txt /tmp/llama_build.txt > $OUT/build_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

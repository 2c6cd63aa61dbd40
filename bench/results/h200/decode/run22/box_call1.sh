# run 22, call 1 (session 27): the fifteenth side by side with llama.cpp again (run 21 call 2 ran it, its output files were lost
# with that session), at HEAD 703b5cd (greedy graph steps queued one
# ahead, 2e3d44c; bench.hybrid_e2e times them so by default, as generation runs them). While llama.cpp
# builds, the smaller GPU test files (test_hybrid_gpu, test_gpu_kernels and test_server_e2e run in call 2). On a clean
# `git archive HEAD` (.boxcmd/src.tgz) and the peer files (.peer).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cp -r .peer /tmp/src/.peer && cd /tmp/src
LB=/tmp/lcpp
(bash .peer/build_llama_bench.sh $LB > /tmp/llama_build.txt 2>&1) & bp=$!
for _ in $(seq 60); do [ -d "$LB/src/llama.cpp/gguf-py" ] && break; sleep 1; done
(PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3.gguf --layers 12 && PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3q8.gguf --layers 12 --experts-type q8_0) > /tmp/gguf.txt 2>&1 & gp=$!
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
for f in tests/test_replace_gpu.py tests/test_deepseek_gpu.py tests/test_gpt_oss_gpu.py tests/test_gpu_kernels_gemv.py tests/test_l2_touch.py tests/test_decode_fusions.py tests/test_expert_deferral.py; do
  L=$(( 190 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
wait $bp || { tail -20 /tmp/llama_build.txt; exit 1; }
wait $gp || { tail -20 /tmp/gguf.txt; exit 1; }
echo "# llama built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 545 - ($(date +%s) - T0) ))
timeout $L python3 -m bench.vs_llamacpp --llama-bench $LB/bin/llama-bench --gguf-bf16 /tmp/q3.gguf --gguf-q8 /tmp/q3q8.gguf --profile $P --cases bf16,int8,quarter,int4 --out $OUT/vs > $OUT/vs_llamacpp.txt 2>&1
echo "rc=$?"; grep -E "^(bf16|int8|quarter|int4) |^\|" $OUT/vs_llamacpp.txt; grep -E "Error" $OUT/vs_llamacpp.txt | head -3
echo "# vs done at $(( $(date +%s) - T0 )) s"

cat /tmp/build.txt /tmp/gguf.txt /tmp/llama_build.txt > $OUT/build_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

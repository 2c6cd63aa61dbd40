# run 23, call 3 (session 28): the sixteenth side by side with llama.cpp, at the new defaults (hsum 1: the AVX-512
# kernels' transposing block sums; tail_split 4: the last down tasks cut in four), then target 5's kernel-alone
# command at those defaults. llama.cpp is built from the peer tarball (.peer, carried) in the same call; nothing
# timed runs while it builds. Built in place from the call's copy of the tree.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
LB=/tmp/lcpp
(bash .peer/build_llama_bench.sh $LB > /tmp/llama_build.txt 2>&1) & bp=$!
for _ in $(seq 60); do [ -d "$LB/src/llama.cpp/gguf-py" ] && break; sleep 1; done
(PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3.gguf --layers 12 && PYTHONPATH=$LB/src/llama.cpp/gguf-py python3 .peer/make_gguf.py /tmp/q3q8.gguf --layers 12 --experts-type q8_0) > /tmp/gguf.txt 2>&1 & gp=$!
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
wait $bp || { tail -20 /tmp/llama_build.txt; exit 1; }
wait $gp || { tail -20 /tmp/gguf.txt; exit 1; }
echo "# llama built at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
L=$(( 520 - ($(date +%s) - T0) ))
timeout $L python3 -m bench.vs_llamacpp --llama-bench $LB/bin/llama-bench --gguf-bf16 /tmp/q3.gguf --gguf-q8 /tmp/q3q8.gguf --profile $P --cases bf16,int8,quarter,int4 --out $OUT/vs > $OUT/vs_llamacpp.txt 2>&1
echo "rc=$?"; grep -E "^(bf16|int8|quarter|int4) |^\|" $OUT/vs_llamacpp.txt; grep -E "Error" $OUT/vs_llamacpp.txt | head -3
python3 -m bench.vs_llamacpp --summarize $OUT/vs/vs_llamacpp.json 2>&1 | tail -12
echo "# vs done at $(( $(date +%s) - T0 )) s"
L=$(( 585 - ($(date +%s) - T0) ))
[ $L -gt 45 ] && timeout $L python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 --variants fused \
  --rounds 3 --out $OUT/probe.json > $OUT/probe.txt 2>&1
grep -E "ceiling" $OUT/probe.txt; sed -n '/^# medians/,$p' $OUT/probe.txt
cat /tmp/build.txt /tmp/gguf.txt /tmp/llama_build.txt > $OUT/build_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

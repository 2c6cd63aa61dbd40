# run 10, call 4: the GPU test files call 3 had no time for (llama.cpp built beside them), then the CPU kernel
# alone with the pool past the LLC (decode_probe's new default), same archive as call 3
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in tests/test_hybrid_gpu.py tests/test_generate_gpu.py tests/test_gpt_oss_gpu.py tests/test_deepseek_gpu.py; do
  L=$(( 230 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
L=$(( 320 - ($(date +%s) - T0) ))
[ $L -gt 40 ] && timeout $L python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --variants fused --iters 30 --out $OUT/decode_probe.json 2>&1 | grep -v Warn | tee $OUT/decode_probe.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

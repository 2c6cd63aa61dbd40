# run 22, call 3 (session 27): the CPU kernel alone again (call 2's command, a second draw of the host), then the
# per-call fixed cost of the decode path: bench.decode_probe --fit over 1-32 distinct experts at one token each
# (time = fixed + bytes / stream rate), the floor timeline again (call 2's files did not come back), and the GPU
# test files not yet run at HEAD. .boxcmd/src.tgz = git archive HEAD.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 --variants fused --rounds 3 \
  --out $OUT/probe.json > $OUT/probe.txt 2>&1; grep -v Warn $OUT/probe.txt | tail -7
echo "# probe done at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x1,1x2,1x4,1x8,2x8,4x8 --iters 30 --variants fused \
  --rounds 2 --fit --out $OUT/probe_fit.json > $OUT/probe_fit.txt 2>&1; grep -v Warn $OUT/probe_fit.txt | tail -5
echo "# fit done at $(( $(date +%s) - T0 )) s"
timeout 90 python3 -m bench.decode_timeline --resident none --layers 2,8 --batch 1 2>&1 | grep -v Warn > $OUT/floor.txt
grep -E "^# (experts 64 wide: floor|profiled)" $OUT/floor.txt
for f in tests/test_gpu_kernels_gemv.py tests/test_gpu_kernels.py tests/test_server_e2e.py tests/test_generate_gpu.py \
         tests/test_decode_fusions.py tests/test_expert_deferral.py; do
  L=$(( 575 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

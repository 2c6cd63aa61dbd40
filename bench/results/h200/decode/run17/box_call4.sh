# run 17, call 4 (session 22): the host's DRAM read ceiling sampled back to back for 90 s with nothing else running
# (bench.ceiling_drift, 15 threads as the e2e benches' executor), then test_hybrid_gpu (cut short by time in call 1).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.ceiling_drift --seconds 90 --threads 15 --out $OUT/drift.json > $OUT/drift.txt 2>&1; tail -3 $OUT/drift.txt
L=$(( 330 - ($(date +%s) - T0) ))
timeout $L python3 -m pytest -q tests/test_hybrid_gpu.py tests/test_l2_touch.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

# run 9, call 1: what each doorbell hand-off costs (bench.doorbell_probe), the floor's idle gaps by kernel pair
# (bench.decode_timeline, now with the lane re-arming done words), and the GPU test files touching the lane
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m bench.doorbell_probe --out $OUT/doorbell_probe.json 2>&1 | grep -v Warn | tee $OUT/doorbell_probe.txt
echo "# probe done at $(( $(date +%s) - T0 )) s"
timeout 150 python3 -m bench.decode_timeline --resident none --out $OUT/timeline_none.json 2>&1 | grep -v Warn | head -60 | tee $OUT/timeline.txt
echo "# timeline done at $(( $(date +%s) - T0 )) s"
for f in tests/test_hybrid_gpu.py tests/test_expert_deferral.py tests/test_generate_gpu.py; do
  n=$(basename $f .py); timeout 120 python3 -m pytest -q -x $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
echo "# all done at $(( $(date +%s) - T0 )) s"

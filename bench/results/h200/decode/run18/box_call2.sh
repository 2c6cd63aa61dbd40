# run 18, call 2: the folded router norm with its weight tile loaded before the norm (preload_w). The router
# GPU tests (compiled), bench.router_probe --norm-in (fold per config, preload on/off, against add_rms_norm +
# the router), then the floor timeline off/on at batch 1 and 8. On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in "tests/test_gpu_kernels.py -k router" "tests/test_hybrid_gpu.py -k norm_in_the_router"; do
  n=$(basename ${f%% *} .py); timeout 120 python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A12 "^E  " /tmp/t_*.txt | head -40
timeout 150 python3 -m bench.router_probe --norm-in --out $OUT/router_norm.json 2>&1 | grep -v Warn | tee $OUT/router_norm.txt
for on in 0 1; do for b in 1 8; do
  L=$(( 520 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "timeline norm=$on batch $b not run (time)"; continue; }
  echo "## HYBRID_ROUTER_NORM=$on batch $b" >> $OUT/timeline.txt
  HYBRID_ROUTER_NORM=$on timeout $(( L < 80 ? L : 80 )) python3 -m bench.decode_timeline --resident none --layers 2,8 --batch $b \
    --out $OUT/timeline_n${on}_b$b.json 2>&1 | grep -v Warn >> $OUT/timeline.txt
  echo "== norm=$on b$b $(grep -E "^# (experts 64 wide: floor|profiled)" $OUT/timeline.txt | tail -2 | tr '\n' ' ') $(grep -E "_router_gemv_topk$|_add_rms_norm$" $OUT/timeline.txt | tail -2 | tr -s ' ' | tr '\n' ';')"
done; done
echo "# all done at $(( $(date +%s) - T0 )) s"

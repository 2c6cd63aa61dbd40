# run 9, call 3: the decode GEMV (gpu_kernels.gemv) and the router GEMV configs timed (bench.gemv_probe,
# bench.router_probe); e2e with the GEMV in the fused decode path (b = HEAD) against without (a = 402d446),
# interleaved in one call; the floor at zero expert bytes; the GPU test files of the changed kernels
export PYTHONUNBUFFERED=1
T0=$(date +%s)
for t in a b; do mkdir -p /tmp/$t && tar xzf .boxcmd/src_$t.tgz -C /tmp/$t; done
(cd /tmp/a && python3 setup.py build_ext --inplace > $OUT/build_a.txt 2>&1) & ba=$!
cd /tmp/b && python3 setup.py build_ext --inplace > $OUT/build_b.txt 2>&1 || { tail -30 $OUT/build_b.txt; exit 1; }
wait $ba || { tail -30 $OUT/build_a.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in tests/test_gpu_kernels.py tests/test_gpu_kernels_gemv.py tests/test_hybrid_gpu.py tests/test_generate_gpu.py; do
  n=$(basename $f .py); timeout 100 python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B5 -A25 "^E  " /tmp/t_*.txt | head -40
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# tests done at $(( $(date +%s) - T0 )) s"
timeout 100 python3 -m bench.gemv_probe --budget-s 80 --out $OUT/gemv_probe.json > $OUT/gemv_probe.txt 2>&1; tail -30 $OUT/gemv_probe.txt
echo "# gemv probe done at $(( $(date +%s) - T0 )) s"
timeout 60 python3 -m bench.router_probe --out $OUT/router_probe.json 2>&1 | tee $OUT/router_probe.txt
echo "# router probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu --prefill 128 --decode-batch 1,8 --steps 24"
for v in a:bf16 b:bf16 a:int4 b:int4; do
  t=${v%%:*}; d=${v##*:}
  L=$(( 520 - ($(date +%s) - T0) )); [ $L -lt 30 ] && { echo "$v not run (time)"; continue; }
  (cd /tmp/$t && timeout $(( L < 80 ? L : 80 )) $E --cpu-dtype $d --out /tmp/e2e_${t}_$d > /tmp/e2e_${t}_$d.txt 2>&1)
  echo "== $t $d $(grep -oE "decode_b[18]_(tok_s|of_roofline|replay_token_agreement)=[0-9.]+" /tmp/e2e_${t}_$d.txt | tr '\n' ' ') $(grep -E "Error" /tmp/e2e_${t}_$d.txt | head -2)"
done | tee $OUT/e2e.txt
cat /tmp/e2e_*_*.txt > $OUT/e2e_logs.txt
L=$(( 590 - ($(date +%s) - T0) ))
[ $L -gt 40 ] && timeout $L python3 -m bench.decode_timeline --resident none --out $OUT/timeline_none.json 2>&1 | grep -v Warn | head -30 | tee $OUT/timeline.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

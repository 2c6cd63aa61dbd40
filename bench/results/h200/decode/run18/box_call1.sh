# run 18, call 1 (prepared in session 22, not yet run): the MoE input norm folded into the router kernel
# (HYBRID_ROUTER_NORM=1, opt-in; one kernel fewer per decode layer). The GPU tests that cover it
# first (compiled kernel cases, captured decode against the unfused norm), then the floor timeline with it off and
# on (GPU kernels busy per layer and the launches table, which should lose ~1 _add_rms_norm per layer), then int4
# end to end off/on/off/on (the host's DRAM ceiling drifts between processes: bench.ceiling_drift; compare the
# runs' of_roofline and cpu_lane_share, not tok/s alone). On a clean `git archive HEAD` (.boxcmd/src.tgz).
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src && tar xzf .boxcmd/src.tgz -C /tmp/src && cd /tmp/src
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt; exit 1; }
echo "# built at $(( $(date +%s) - T0 )) s"
for f in "tests/test_gpu_kernels.py -k router" "tests/test_hybrid_gpu.py -k norm_in_the_router" "tests/test_generate_gpu.py"; do
  L=$(( 200 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename ${f%% *} .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done | tee $OUT/gpu_tests.txt
grep -h -B2 -A12 "^E  " /tmp/t_*.txt | head -40
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
for on in 0 1; do for b in 1 8; do
  L=$(( 400 - ($(date +%s) - T0) )); [ $L -lt 40 ] && { echo "timeline norm=$on batch $b not run (time)"; continue; }
  echo "## HYBRID_ROUTER_NORM=$on batch $b" >> $OUT/timeline.txt
  HYBRID_ROUTER_NORM=$on timeout $(( L < 80 ? L : 80 )) python3 -m bench.decode_timeline --resident none --layers 2,8 --batch $b \
    --out $OUT/timeline_n${on}_b$b.json 2>&1 | grep -v Warn >> $OUT/timeline.txt
  echo "== norm=$on b$b $(grep -E "^# (experts 64 wide: floor|profiled)" $OUT/timeline.txt | tail -2 | tr '\n' ' ')"
done; done
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
for on in 0 1 0 1; do
  L=$(( 585 - ($(date +%s) - T0) )); [ $L -lt 60 ] && { echo "int4 norm=$on not run (time)"; continue; }
  HYBRID_ROUTER_NORM=$on timeout $L python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --graphs --strategies cpu \
    --prefill 128 --decode-batch 1,8 --steps 24 --cpu-dtype int4 --out /tmp/e2e_$on > /tmp/e2e_$on.txt 2>&1
  echo "== int4 norm=$on: $(grep -oE "decode_b[18]_(tok_s|of_roofline|of_roofline_after|cpu_lane_share|replay_token_agreement)=[0-9.]+" /tmp/e2e_$on.txt | tr '\n' ' ') $(grep -oE "DRAM read [0-9.]+ GB/s" /tmp/e2e_$on.txt) $(grep -E "Error" /tmp/e2e_$on.txt | head -2)"
done 2>&1 | tee $OUT/e2e_ab.txt
echo "# all done at $(( $(date +%s) - T0 )) s"

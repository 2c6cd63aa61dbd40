# run 22, call 2 (session 27): the targets the side-by-side call does not measure, at HEAD: the graph floor per
# layer (bench.decode_timeline's slope, 2 -> 8 layers, batch 1, no expert resident), the CPU kernel alone at decode
# routing against the DRAM ceiling of the same process (bf16 and int8, 8 experts x 1 token and x 4 tokens, three
# rounds), prefill 2048 / 8192 of HEAD against d835f47 (run 13's reference tree) in turn, then GPU test files in
# the time left. .boxcmd/src.tgz = git archive HEAD, old.tgz = git archive d835f47.
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p /tmp/src /tmp/old && tar xzf .boxcmd/src.tgz -C /tmp/src && tar xzf .boxcmd/old.tgz -C /tmp/old
(cd /tmp/old && python3 setup.py build_ext --inplace > $OUT/build_old.txt 2>&1) &
(cd /tmp/src && python3 -m pip install -e . --no-build-isolation --no-deps -q > $OUT/build.txt 2>&1)
wait
echo "# built at $(( $(date +%s) - T0 )) s"
cd /tmp/src
timeout 90 python3 -m bench.decode_timeline --resident none --layers 2,8 --batch 1 --out $OUT/timeline_b1.json \
  2>&1 | grep -v Warn > $OUT/timeline.txt; grep -E "^# (experts 64 wide: floor|profiled)" $OUT/timeline.txt
echo "# floor done at $(( $(date +%s) - T0 )) s"
timeout 170 python3 -m bench.decode_probe --dtypes bf16,int8 --cases 1x8,4x8same --iters 30 --variants fused --rounds 3 \
  --out $OUT/probe.json > $OUT/probe.txt 2>&1; grep -v Warn $OUT/probe.txt | tail -7
echo "# probe done at $(( $(date +%s) - T0 )) s"
P=bench/results/h200/profile_qwen3-30b-a3b_floor.json
E="python3 -m bench.hybrid_e2e --profile $P --layers 12 --resident 0 --strategies cost --prefill 2048,8192 --decode-batch 1 --steps 2"
for t in src old; do
  L=$(( 420 - ($(date +%s) - T0) )); [ $L -lt 45 ] && { echo "prefill $t not run (time)"; continue; }
  R=""; [ $t = src ] && R="--prefill-repeats 3"
  (cd /tmp/$t && timeout $(( L < 90 ? L : 90 )) $E $R --out /tmp/pf_$t > /tmp/pf.txt 2>&1)
  cat /tmp/pf.txt >> $OUT/prefill_logs.txt
  echo "$t $(grep -oE "prefill_[0-9]+_(tok_s|runs_tok_s)=[0-9.,]+" /tmp/pf.txt | tr '\n' ' ') $(grep -E "Error" /tmp/pf.txt | head -1)"
done | tee $OUT/prefill_ab.txt
echo "# prefill done at $(( $(date +%s) - T0 )) s"
for f in tests/test_hybrid_gpu.py tests/test_l2_touch.py; do
  L=$(( 575 - ($(date +%s) - T0) )); [ $L -lt 15 ] && { echo "$f not run (time)"; continue; }
  n=$(basename $f .py); timeout $L python3 -m pytest -q $f > /tmp/t_$n.txt 2>&1; echo "$f $(tail -1 /tmp/t_$n.txt)"
done > $OUT/gpu_tests.txt; cat $OUT/gpu_tests.txt
grep -h -B2 -A10 "^E  " /tmp/t_*.txt | head -30
cat /tmp/t_*.txt > $OUT/gpu_test_logs.txt
echo "# all done at $(( $(date +%s) - T0 )) s"
